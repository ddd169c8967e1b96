"""How long another thread waits to owe a write while the cleanup thread holds a backlog.

The cleanup thread picks what it can send under the lock that every ``owe()``
takes (a worker's main process owes each job's release). With ``N`` writes
waiting for a message's fate (``after`` says "not yet"), each pass over the
backlog must stay linear in ``N``, or the event loop stalls behind it.

    .venv/bin/python bench/cleanup_backlog.py [N ...]

prints, for each backlog size, the median and worst time an ``owe()`` from
another thread waited (over 50 calls) while the backlog waits, and how long one
pass takes to pick a backlog that became sendable at once (a store back after
an outage).
"""

from __future__ import annotations

import statistics
import sys
import time

from celery_unique.stores import cleanup
from celery_unique.stores.base import Release
from celery_unique.stores.memory import MemoryStore


def measure(backlog: int, calls: int = 50) -> tuple[float, float]:
    store = MemoryStore()
    sender = cleanup.Cleanup()
    waiting = [
        cleanup.Owed(
            store=store,
            what="waiting",
            deadline=cleanup.deadline_after(3600),
            release=Release(f"j{n}", f"k{n}", 0, None),
            after=lambda: False,
        )
        for n in range(backlog)
    ]
    sender.owe(*waiting)
    sender.start()
    time.sleep(0.2)  # let the thread start polling the backlog
    waits = []
    for n in range(calls):
        extra = cleanup.Owed(
            store=store,
            what="extra",
            deadline=cleanup.deadline_after(3600),
            release=Release(f"x{n}", f"x{n}", 0, None),
            after=lambda: False,
        )
        started = time.perf_counter()
        sender.owe(extra)
        waits.append(time.perf_counter() - started)
        time.sleep(0.01)
    return statistics.median(waits), max(waits)


def one_pass(backlog: int) -> float:
    """Seconds for the thread to pick ``backlog`` writes that are all sendable."""
    store = MemoryStore()
    sender = cleanup.Cleanup()  # not started: the pass is timed here
    sender.owe(
        *(
            cleanup.Owed(
                store=store,
                what="ready",
                deadline=cleanup.deadline_after(60),
                release=Release(f"j{n}", f"k{n}", 0, None),
            )
            for n in range(backlog)
        )
    )
    started = time.perf_counter()
    picked = sender._next_batch()
    elapsed = time.perf_counter() - started
    assert len(picked) == backlog
    return elapsed


def main() -> None:
    sizes = [int(arg) for arg in sys.argv[1:]] or [1_000, 10_000, 30_000]
    print(f"{'owed writes':>12} {'median wait':>12} {'worst wait':>12} {'one pass':>10}")
    for size in sizes:
        median, worst = measure(size)
        taken = one_pass(size)
        print(
            f"{size:>12,} {median * 1000:>10.2f}ms {worst * 1000:>10.2f}ms {taken * 1000:>8.1f}ms"
        )


if __name__ == "__main__":
    main()
