"""``unique_on_duplicate`` on a real prefork worker: the latest arguments win, one run is owed.

The task (``faults.follow``) is keyed by customer, held while active, and
declared ``"latest"``; the debounce test chooses ``"debounce"`` per dispatch.
Each run records its job id, the ``version`` argument it ran with, and when
it started and ended (``time.monotonic_ns()``: one clock for every process).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_unique import Disposition
from celery_unique.keys import keyspace
from tests.faultproxy import FaultProxy
from tests.spawned import run_in_processes

from ._apps import FOLLOW, Spec
from .conftest import Worker, eventually, follow_runs, job_key, open_store, producer, task_of
from .test_worker_store_faults import worker_spec

pytestmark = pytest.mark.slow

#: After the last expected run, how long the test keeps watching for one more.
SETTLE_S = 2.0
#: Duplicates per test (and per process, in the race).
DUPLICATES = 50
RACERS = 8


def settled_runs(marks: Any, spec: Spec, count: int) -> list[tuple[str, int, int, int]]:
    """The runs once ``count`` have ended and no other came for :data:`SETTLE_S`."""
    eventually(lambda: len(follow_runs(marks, spec)) >= count, 30, f"{count} run(s) to end")
    time.sleep(SETTLE_S)
    return follow_runs(marks, spec)


def test_duplicates_of_a_queued_job_leave_it_the_last_arguments(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """50 duplicates while the job waits: one run, with the 50th duplicate's arguments."""
    spec = make_spec()
    with producer(spec) as app:
        follow = task_of(app, FOLLOW)
        first = follow.delay(customer=42, version=0)
        receipts = [follow.delay(customer=42, version=v) for v in range(1, DUPLICATES + 1)]
        assert first.disposition is Disposition.CREATED
        assert {r.id for r in receipts} == {first.id}
        assert all(r.arguments_replaced and not r.rerun_requested for r in receipts)

        start_worker(spec)
        done = settled_runs(marks, spec, 1)
        assert [(job, version) for job, version, *_ in done] == [(first.id, DUPLICATES)]
        with open_store(spec.store_url) as store:
            eventually(lambda: store.get(job_key(spec, "customer:42", FOLLOW)) is None)
        assert follow.delay(customer=42, version=99).disposition is Disposition.CREATED


def test_duplicates_of_a_running_job_owe_it_exactly_one_run_with_the_last_arguments(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """50 duplicates while the job runs: two runs in all, the second with the 50th's arguments."""
    spec = make_spec()
    start_worker(spec)
    with producer(spec) as app:
        follow = task_of(app, FOLLOW)
        first = follow.delay(customer=7, version=0, hold_s=2.0)
        eventually(lambda: marks.llen(f"{spec.marks}:follow_started"), what="the first run")
        receipts = [
            follow.delay(customer=7, version=v, hold_s=0.2) for v in range(1, DUPLICATES + 1)
        ]
        assert {r.id for r in receipts} == {first.id}
        assert all(r.rerun_requested for r in receipts)

        done = settled_runs(marks, spec, 2)
        assert len(done) == 2, done
        (job_1, version_1, _, end_1), (job_2, version_2, start_2, _) = done
        assert (job_1, version_1) == (first.id, 0)
        assert job_2 != first.id
        assert version_2 == DUPLICATES
        assert start_2 > end_1  # the follow-up never ran beside the job it follows
        with open_store(spec.store_url) as store:
            eventually(lambda: store.get(job_key(spec, "customer:7", FOLLOW)) is None)


def test_debounce_starts_at_the_cap_with_the_arguments_of_the_last_duplicate_before(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """A duplicate every 100 ms for 2 s, debounce 0.5 s, max 1 s: the job starts 1 s after
    the first dispatch with the latest arguments then; later duplicates owe one more run."""
    spec = make_spec()
    start_worker(spec)
    with producer(spec) as app:
        follow = task_of(app, FOLLOW)
        dispatched: list[tuple[int, int, int]] = []  # (version, began ns, returned ns)
        began_first = time.monotonic_ns()
        version = 0
        while time.monotonic_ns() - began_first < 2_000_000_000:
            began = time.monotonic_ns()
            receipt = follow.apply_async(
                # Runs past the burst's end: every later duplicate meets it running.
                kwargs={"customer": 5, "version": version, "hold_s": 1.2},
                unique_on_duplicate="debounce",
                unique_debounce=0.5,
                unique_debounce_max=1.0,
            )
            dispatched.append((version, began, time.monotonic_ns()))
            assert receipt.postponed_to is not None or receipt.rerun_requested
            version += 1
            time.sleep(max(0.0, 0.1 - (time.monotonic_ns() - began) / 1e9))

        done = settled_runs(marks, spec, 2)
        assert len(done) == 2, done
        (_, version_1, start_1, end_1), (_, version_2, start_2, _) = done
        delay_s = (start_1 - began_first) / 1e9
        print(f"\nfirst run started {delay_s:.3f} s after the first dispatch, version {version_1}")
        assert 1.0 <= delay_s <= 1.5
        # The latest arguments: every dispatch that returned before the run started is
        # no newer, and the run's own dispatch began before it.
        assert all(v <= version_1 for v, _, returned in dispatched if returned < start_1)
        assert dispatched[version_1][1] < start_1
        # Duplicates that met it running owed one run, with the very last arguments.
        assert version_2 == dispatched[-1][0]
        assert start_2 > end_1


def _race(spec: Spec, index: int, barrier: Any, results: Any) -> None:
    """One racer: :data:`DUPLICATES` duplicates of the running job, as fast as it can."""
    try:
        with producer(spec) as app:
            follow = task_of(app, FOLLOW)
            barrier.wait(timeout=30)
            receipts = [
                follow.delay(customer=9, version=1000 * (index + 1) + n) for n in range(DUPLICATES)
            ]
            results.put(
                (sorted({r.id for r in receipts}), all(r.rerun_requested for r in receipts))
            )
    except BaseException as exc:  # reported, not lost with the process
        results.put(repr(exc))


def test_racing_processes_owe_exactly_one_run(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """8 processes x 50 duplicates of a running job: exactly one follow-up run."""
    spec = make_spec()
    start_worker(spec)
    with producer(spec) as app:
        # It runs until every racer is done, however long their processes take to start.
        first = task_of(app, FOLLOW).delay(customer=9, version=0, until_let_go=True)
        eventually(lambda: marks.llen(f"{spec.marks}:follow_started"), what="the first run")
        reports = run_in_processes(_race, spec, RACERS, timeout=60)
        marks.set(f"{spec.marks}:let_go", 1)
        assert all(report == ([first.id], True) for report in reports), reports

        done = settled_runs(marks, spec, 2)
        assert len(done) == 2, done
        versions = {1000 * (i + 1) + n for i in range(RACERS) for n in range(DUPLICATES)}
        assert done[0][:2] == (first.id, 0)
        assert done[1][1] in versions


def test_a_retry_after_the_duplicate_is_the_run_it_was_owed(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """A duplicate during the first attempt; the job retries: the retry starts with the
    duplicate's arguments, and no further run follows it."""
    spec = make_spec()
    start_worker(spec)
    with producer(spec) as app:
        follow = task_of(app, FOLLOW)
        first = follow.delay(customer=3, version=0, hold_s=1.0, retry_once=True)
        eventually(lambda: marks.llen(f"{spec.marks}:follow_started"), what="the first attempt")
        assert follow.delay(customer=3, version=1).rerun_requested
        done = settled_runs(marks, spec, 1)
        # The first attempt raised its retry before recording: only the retry ended.
        assert [(job, version) for job, version, *_ in done] == [(first.id, 1)]
        with open_store(spec.store_url) as store:
            eventually(lambda: store.get(job_key(spec, "customer:3", FOLLOW)) is None)


def test_a_duplicate_after_the_run_ended_and_before_the_key_is_freed_is_run(
    make_spec: Callable[..., Spec],
    start_worker: Callable[..., Worker],
    marks: Any,
    proxy: FaultProxy,
) -> None:
    """The worker's store replies are held 0.5 s, so the end of the hold is sent at least
    that long after the run ended: a duplicate in between is run, with its arguments."""
    working, producing = worker_spec(make_spec, proxy)
    start_worker(working)
    with producer(producing) as app:
        follow = task_of(app, FOLLOW)
        first = follow.delay(customer=12, version=0, until_let_go=True)
        eventually(lambda: marks.llen(f"{producing.marks}:follow_started"), what="the first run")
        proxy.delay_replies(0.5)
        marks.set(f"{producing.marks}:let_go", 1)
        eventually(lambda: follow_runs(marks, producing), what="the first run to end")
        # The worker's writes for the end of the run reach the store at once; only
        # their replies are held, so its next step is at least 0.5 s away.
        time.sleep(0.2)
        late = follow.delay(customer=12, version=1)
        assert late.id == first.id or late.disposition is Disposition.CREATED
        proxy.delay_replies(0)

        done = settled_runs(marks, producing, 2)
        assert [version for _, version, *_ in done] == [0, 1], (late.disposition, done)
        with open_store(producing.store_url) as store:
            eventually(lambda: store.get(job_key(producing, "customer:12", FOLLOW)) is None)


def test_a_job_that_re_enqueues_itself_keeps_the_run_owed_to_a_duplicate(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """The running job is owed a run, then dispatches its successor with the same key (the
    key is handed over): the successor runs with its own arguments, the owed run after it
    with the duplicate's."""
    spec = make_spec()
    start_worker(spec)
    with producer(spec) as app:
        follow = task_of(app, FOLLOW)
        first = follow.delay(customer=13, version=0, until_let_go=True, successor=1)
        eventually(lambda: marks.llen(f"{spec.marks}:follow_started"), what="the first run")
        assert follow.delay(customer=13, version=2).rerun_requested
        marks.set(f"{spec.marks}:let_go", 1)

        done = settled_runs(marks, spec, 3)
        assert marks.lrange(f"{spec.marks}:successors", 0, -1) == [b"created"]
        assert [version for _, version, *_ in done] == [0, 1, 2], done
        (job_1, *_), (_, _, _, end_2), (_, _, start_3, _) = done
        assert job_1 == first.id
        assert start_3 > end_2  # the owed run follows the successor
        with open_store(spec.store_url) as store:
            eventually(lambda: store.get(job_key(spec, "customer:13", FOLLOW)) is None)


def test_a_job_replaced_by_another_task_on_a_shared_key_still_publishes_the_owed_run(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """A key shared across tasks (``unique_prefix=False``) names no task: the job, owed a run
    by a duplicate, replaces itself by a plain task; as that replacement ends, the owed run
    is the job's own task, with the duplicate's arguments (not one refused as naming
    another task than the replacement's)."""
    spec = make_spec()
    start_worker(spec)
    shared = {"unique_prefix": False}
    with producer(spec) as app:
        follow = task_of(app, FOLLOW)
        first = follow.apply_async(
            kwargs={"customer": 14, "version": 0, "hold_s": 1.0, "replace_by_tail": True},
            **shared,
        )
        eventually(lambda: marks.llen(f"{spec.marks}:follow_started"), what="the first run")
        assert follow.apply_async(kwargs={"customer": 14, "version": 1}, **shared).rerun_requested

        done = settled_runs(marks, spec, 2)
        assert [(job == first.id, version) for job, version, *_ in done] == [
            (True, 0),
            (False, 1),
        ], done
        with open_store(spec.store_url) as store:
            stored = keyspace.storage_key(spec.namespace, keyspace.ACTIVE, "", "customer:14")
            eventually(lambda: store.get(stored) is None, what="the key to be released")
