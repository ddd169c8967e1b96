"""Dispatch throughput with many concurrent producers: threads in one process, gevent greenlets.

Run by ``bench/run.py`` (each mode in a process of its own: gevent patches the
process before anything else is imported)::

    python bench/concurrency.py --mode threads --workers 8 [--quick] [--redis URL]
    python bench/concurrency.py --mode gevent --workers 200 [--quick] [--redis URL]

Prints one JSON object. Every row dispatches the same number of jobs, split
over ``--workers`` producers that start together; rows take turns within each
round (order rotated), and a row's ratio is the median of its per-round
ratios to plain ``apply_async`` under the same concurrency. A dispatch that
raises is counted, not retried (the peers' Redis clients refuse connections
past their pool's cap of 100: celery-once's cannot be given a larger one).
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and "gevent" in sys.argv:
    from gevent import monkey

    monkey.patch_all()

import argparse
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import harness
from harness import TENANT, Bench, fresh

#: The rows: plain, a created unique dispatch, and the peers.
ROWS = {
    "plain": "plain apply_async",
    "selector": "unique created: selector key",
    "once": "celery-once QueueOnce",
    "singleton": "celery-singleton Singleton",
}


def run_together(
    dispatch: Callable[[], Any], workers: int, total: int
) -> tuple[float, Counter[str]]:
    """Seconds for ``workers`` producers to make ``total`` dispatches in all, started
    together; and the dispatches that raised, by exception (every one is counted)."""
    share = total // workers
    start = threading.Barrier(workers + 1)
    failed: Counter[str] = Counter()

    def produce() -> None:
        start.wait()
        for _ in range(share):
            try:
                dispatch()
            except Exception as exc:
                failed[f"{type(exc).__name__}: {exc}"] += 1

    threads = [threading.Thread(target=produce) for _ in range(workers)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began, failed


def measure(bench: Bench, workers: int, rounds: int, total: int) -> dict[str, Any]:
    tasks = {key: getattr(bench.tasks, key) for key in ROWS}
    dispatches = {
        key: (lambda task=task: task.apply_async((TENANT, fresh()))) for key, task in tasks.items()
    }
    for dispatch in dispatches.values():  # connections and scripts, once per producer
        run_together(dispatch, workers, workers * 20)
    seconds: dict[str, list[float]] = {key: [] for key in ROWS}
    failed: dict[str, Counter[str]] = {key: Counter() for key in ROWS}
    keys = list(ROWS)
    for number in range(rounds):
        harness.reset_broker(bench)
        bench.store.flushdb()
        shift = number % len(keys)
        for key in [*keys[shift:], *keys[:shift]]:
            spent, errors = run_together(dispatches[key], workers, total)
            seconds[key].append(spent)
            failed[key] += errors
    held = bench.store.dbsize()
    return {
        "workers": workers,
        "dispatches": total,
        "rounds": rounds,
        "rows": {
            key: {
                "label": label,
                "per_s": total / harness.median(seconds[key]),
                "ratio": harness.median(
                    plain / mine for plain, mine in zip(seconds["plain"], seconds[key], strict=True)
                ),
                "round_seconds": seconds[key],
                "failed": sum(failed[key].values()),
                "failures": dict(failed[key].most_common(3)),
            }
            for key, label in ROWS.items()
        },
        "store_keys_after_last_round": held,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["threads", "gevent"], required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379", help="server (no db)")
    options = parser.parse_args()
    bench = harness.build(options.redis)
    bench.broker.flushdb()
    bench.store.flushdb()
    rounds, total = (3, 1600) if options.quick else (7, 4000)
    result = measure(bench, options.workers, rounds, total)
    result["mode"] = options.mode
    harness.reset_broker(bench)
    bench.store.flushdb()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
