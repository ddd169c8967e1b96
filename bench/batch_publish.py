"""Experiment: what ``dispatch_many`` gains by publishing through kombu's ``Producer.batch()``.

Run: ``python bench/batch_publish.py [--items 1000] [--rounds 7]``.

Publishing, not deciding, bounds a batch: the store decides 1,000 claims in
one EVALSHA, but each message still costs a full kombu publish with its own
LPUSH round trip. kombu >= 5.6 can buffer a producer's publishes and send them
as one Redis pipeline (``with producer.batch(): ...``). This prototype,
standalone and without touching the library, plans every item with the
library's ``plan()``, decides them with one ``RedisStore.decide``, and
publishes the created ones inside ``producer.batch()``.

Variants (1,000 fresh keys each, interleaved rounds, medians):

* ``singles``: 1,000 ``UniqueTask.apply_async`` calls;
* ``dispatch_many``: the library's batch, as it is today (if it exists);
* ``batched prototype``: plan + one decide + publishes in ``producer.batch()``;
* ``plain, batched``: 1,000 plain ``apply_async`` in ``producer.batch()`` (a floor).
"""

from __future__ import annotations

import argparse
from typing import Any

import harness
from celery.app.task import Task
from celery.utils import uuid
from harness import BROKER_DB, QUEUE, TENANT, fresh

import celery_unique
from celery_unique import dispatch
from celery_unique.config import runtime
from celery_unique.headers import HEADER
from celery_unique.receipt import stamp
from celery_unique.stores.base import Verdict


def batched_prototype(task: Any, items: int) -> list[Any]:
    rt = runtime(task.app)
    plans = []
    for _ in range(items):
        job_id = uuid()
        planned = dispatch.plan(task, task.__unique__, {}, (TENANT, fresh()), None, {},
                                job_id=job_id, rt=rt)  # fmt: skip
        assert planned is not None
        plans.append(planned)
    decisions = rt.store.decide([planned.claim for planned in plans])
    results: list[Any] = []
    with task.app.producer_or_acquire() as producer, producer.batch(items):
        for planned, decision in zip(plans, decisions, strict=True):
            if decision.verdict is not Verdict.CREATED:
                results.append(task.AsyncResult(decision.job_id))
                continue
            headers: Any = {HEADER: planned.header}
            result = Task.apply_async(
                task,
                (TENANT, 0),
                None,
                task_id=planned.claim.job_id,
                producer=producer,
                headers=headers,
            )
            results.append(stamp(result))
    return results


def plain_batched(task: Any, items: int) -> None:
    with task.app.producer_or_acquire() as producer, producer.batch(items):
        for _ in range(items):
            task.apply_async((TENANT, fresh()), producer=producer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    options = parser.parse_args()
    bench = harness.build(options.redis)
    bench.broker.flushdb()
    bench.store.flushdb()
    t, items = bench.tasks, options.items
    dispatch_many = getattr(celery_unique, "dispatch_many", None)
    variants: dict[str, Any] = {
        "singles": lambda: [t.selector.apply_async((TENANT, fresh())) for _ in range(items)],
        "dispatch_many": None
        if dispatch_many is None
        else lambda: dispatch_many([t.selector.s(TENANT, fresh()) for _ in range(items)]),
        "batched prototype": lambda: batched_prototype(t.selector, items),
        "plain, batched": lambda: plain_batched(t.plain, items),
    }
    trips: dict[str, tuple[int, int, int]] = {}
    for name, variant in variants.items():
        if variant is None:
            continue
        variant()
        harness.reset_broker(bench)
        with harness.RoundTrips() as counted:
            variant()
        trips[name] = (
            counted.counts[bench.store_db],
            counted.counts[BROKER_DB],
            int(bench.broker.llen(QUEUE)),
        )
        harness.reset_broker(bench)
    seconds: dict[str, list[float]] = {name: [] for name in trips}
    for number in range(options.rounds):
        names = list(trips)
        shift = number % len(names)
        for name in names[shift:] + names[:shift]:
            seconds[name].append(harness.timed(variants[name]))
            harness.reset_broker(bench)
        bench.store.flushdb()
    singles = harness.median(seconds["singles"])
    print(f"{items:,} items per call; median of {options.rounds} rounds")
    print(f"{'variant':<20} {'items/s':>9} {'x singles':>10} {'store RT':>9} {'broker RT':>10}")
    for name, values in seconds.items():
        store_rt, broker_rt, queued = trips[name]
        assert queued == items, (name, queued)
        value = harness.median(values)
        print(
            f"{name:<20} {items / value:>9,.0f} {singles / value:>10.2f} {store_rt:>9} "
            f"{broker_rt:>10}"
        )
    if dispatch_many is None:
        print("dispatch_many: not available")


if __name__ == "__main__":
    main()
