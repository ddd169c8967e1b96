"""Soak: producer processes hammer a few hundred keys while a real prefork worker runs the jobs.

Four spawned producers dispatch 10,000 jobs each, every one to a key drawn at
random among 200 (half held while ``queued``, half while ``active``). Each job
records its key, its id and two tickets from one Redis counter, taken when its
body starts and ends; the tickets order events across processes without
trusting any clock. Once the queue has drained, every created job must have
run exactly once, every reused dispatch must point at a job created for the
same key, no key may be left held, and for ``active`` keys the runs of one key
must be one after another: a new job is created only after the previous one
finished, so each created job is exactly one holding period of its key.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from celery_unique.keys import keyspace
from tests.spawned import run_in_processes

from ._apps import Spec
from ._soak import Report, Soak, produce, scope_of
from .conftest import Worker, eventually, open_store, queue_length

pytestmark = [pytest.mark.slow, pytest.mark.alone]

PRODUCERS = 4
DISPATCHES = 5_000
KEYS = 200
#: How long the producers may take, and then the worker to drain the queue (seconds).
PRODUCE_TIMEOUT_S = 180.0
DRAIN_TIMEOUT_S = 120.0


def run_producers(soak: Soak) -> list[Report]:
    reports: list[Report] = run_in_processes(produce, soak, PRODUCERS, PRODUCE_TIMEOUT_S)
    errors = [f"producer {r.producer}:\n{r.error}" for r in reports if r.error]
    assert not errors, "\n".join(errors)
    return reports


def runs_of(marks: Any, spec: Spec) -> list[tuple[str, str, int, int]]:
    """``(key, job id, start ticket, end ticket)`` of every run, as the jobs recorded them."""
    runs = []
    for raw in marks.lrange(f"{spec.marks}:runs", 0, -1):
        key, job_id, start, end = raw.decode().split()
        runs.append((key, job_id, int(start), int(end)))
    return runs


def test_soak_every_created_job_runs_once_and_no_key_is_left_held(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """40,000 dispatches on 200 keys: each created job runs once, one holding period each."""
    spec = make_spec(settings={"worker_prefetch_multiplier": 4})
    start_worker(spec)
    began = time.perf_counter()
    reports = run_producers(Soak(spec, DISPATCHES, KEYS, seed=6))
    produced = time.perf_counter() - began

    created = [pair for report in reports for pair in report.created]
    reused = [pair for report in reports for pair in report.reused]
    assert len(created) + len(reused) == PRODUCERS * DISPATCHES
    created_ids = [job_id for _, job_id in created]
    assert len(set(created_ids)) == len(created_ids), "a job id was created twice"

    eventually(
        lambda: marks.llen(f"{spec.marks}:runs") >= len(created) and queue_length(spec) == 0,
        DRAIN_TIMEOUT_S,
        "the worker to run every created job",
    )
    drained = time.perf_counter() - began
    runs = runs_of(marks, spec)

    # Every created job ran exactly once, under the key it was created for.
    assert Counter(job_id for _, job_id, _, _ in runs) == Counter(created_ids)
    assert {(key, job_id) for key, job_id, _, _ in runs} == set(created)
    assert {m.decode() for m in marks.smembers(f"{spec.marks}:ran")} == set(created_ids)
    per_key = Counter(key for key, _ in created)
    for key, count in per_key.items():
        assert int(marks.get(f"{spec.marks}:count:{key}")) == count, key

    # A reused dispatch returned a job created for the same key.
    created_for = defaultdict(set)
    for key, job_id in created:
        created_for[key].add(job_id)
    assert all(job_id in created_for[key] for key, job_id in reused)

    # Active keys: the runs of one key never overlap, so each created job is one
    # holding period of its key (the next job is created only after it finished).
    by_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for key, _, start, end in runs:
        if scope_of(key) == "active":
            by_key[key].append((start, end))
    lifetimes = 0
    for key, spans in by_key.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end < start, f"two jobs of active key {key} ran at once"
        lifetimes += len(spans)
    assert lifetimes == sum(n for key, n in per_key.items() if scope_of(key) == "active")

    with open_store(spec.store_url) as store:
        prefix = keyspace.namespace_prefix(spec.namespace)
        eventually(lambda: not list(store.scan(prefix=prefix)), what="every key to be released")

    slowest = max(report.seconds for report in reports)
    print(
        f"\nsoak: {PRODUCERS} producers x {DISPATCHES} dispatches over {KEYS} keys: "
        f"created {len(created)}, reused {len(reused)}; dispatching took {slowest:.1f} s "
        f"({PRODUCERS * DISPATCHES / slowest:.0f} dispatches/s), "
        f"producers done after {produced:.1f} s, queue drained after {drained:.1f} s"
    )
