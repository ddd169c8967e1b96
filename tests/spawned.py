"""Run one function in several freshly spawned processes that start together."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def run_in_processes(
    target: Callable[..., None], spec: Any, count: int, timeout: float
) -> list[Any]:
    """Run ``target(spec, index, barrier, results)`` in ``count`` spawned processes.

    Each process waits on the shared barrier before its work (so they race
    for real) and puts exactly one report on ``results``; the reports come
    back in arrival order. Processes still alive afterwards are killed.
    """
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(count)
    results = context.Queue()
    children = [
        context.Process(target=target, args=(spec, index, barrier, results), daemon=True)
        for index in range(count)
    ]
    for child in children:
        child.start()
    try:
        return [results.get(timeout=timeout) for _ in children]
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
                child.join()
        results.close()
        results.join_thread()
