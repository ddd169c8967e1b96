"""The worker's side of the store under faults: keys held while jobs can run, freed once it answers.

A real prefork worker reaches the store through a loopback fault proxy; the
producer and the test read the store directly. The tests:

* kill the pool child between the job's return and its ack (``acks_late``):
  the message is redelivered and runs again, and the key stays held until
  that second run ends, while every reply of the store to the worker is
  slowed down;
* cut the worker off the store when the job ends: the release fails, is
  retried in the background, and frees the key within seconds of the store
  answering again (not after the lease);
* slow down the store's replies while a job runs longer than its lease: the
  lease is still renewed and the key stays held;
* deliver a copy of a finished job's message while the worker cannot reach
  the store and another job holds the key: the copy waits for the store
  instead of running unmarked beside that job.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_unique import Disposition
from tests.faultproxy import FaultProxy

from ._apps import KEY_HEADER, Spec
from .conftest import (
    Worker,
    eventually,
    finished,
    one_key,
    producer,
    queue_length,
    starts,
    task_of,
)

pytestmark = [pytest.mark.slow, pytest.mark.alone]

LONG_LEASE_S = 60.0


def worker_spec(
    make_spec: Callable[..., Spec], proxy: FaultProxy, **changes: Any
) -> tuple[Spec, Spec]:
    """The worker's spec (store through the proxy) and the producer's (store direct)."""
    producing = make_spec(**changes)
    working = Spec(
        **{**json.loads(producing.to_json()), "store_url": f"{proxy.url(0)}?socket_timeout=1"}
    )
    return working, producing


def held_throughout(job: Any, job_id: str, until: Callable[[], bool], timeout: float) -> int:
    """Sample the key until ``until()``; fail if it is ever not held by ``job_id``."""
    samples, deadline = 0, time.monotonic() + timeout
    while not until():
        assert job.holder() == job_id, "the key was free while the job could still run"
        samples += 1
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return samples


def test_a_child_killed_between_return_and_ack_keeps_the_key_for_the_rerun(
    make_spec: Callable[..., Spec],
    start_worker: Callable[..., Worker],
    marks: Any,
    proxy: FaultProxy,
) -> None:
    """acks_late: killed after returning, before the ack; it runs again and holds its key."""
    working, producing = worker_spec(make_spec, proxy, acks_late=True, lease_s=LONG_LEASE_S)
    start_worker(working)
    proxy.delay_replies(0.2)
    with one_key(producing, "linger") as job:
        first = job.dispatch(hold_s=1.0, first_hold_s=0.3, first_linger_s=30)
        lingering = f"{producing.marks}:lingering"
        eventually(lambda: marks.lrange(lingering, 0, -1), what="the job to return and linger")
        [(_, pid, _, _)] = starts(marks, producing)
        assert job.holder() == first.id
        os.kill(pid, signal.SIGKILL)
        samples = held_throughout(job, first.id, lambda: len(starts(marks, producing)) == 2, 60)
        # The rerun runs for a second: a dispatch meanwhile is handed it.
        again = job.dispatch()
        assert (again.disposition, again.id) == (Disposition.REUSED, first.id)
        samples += held_throughout(
            job, first.id, lambda: finished(marks, producing).count(first.id) == 2, 60
        )
        eventually(lambda: job.holder() is None, 10, "the key to be freed after the rerun")
    assert [run for _, _, run, _ in starts(marks, producing)] == [1, 2]
    assert samples > 5


def test_a_release_the_store_missed_is_retried_until_it_lands(
    make_spec: Callable[..., Spec],
    start_worker: Callable[..., Worker],
    marks: Any,
    proxy: FaultProxy,
) -> None:
    """The store unreachable when the job ends: the key is freed seconds after it is back."""
    working, producing = worker_spec(make_spec, proxy, lease_s=LONG_LEASE_S)
    worker = start_worker(working)
    with one_key(producing, "missed") as job:
        first = job.dispatch(hold_s=1.0)
        eventually(lambda: starts(marks, producing), what="the job to start")
        proxy.refuse(True)
        proxy.reset_all()
        eventually(lambda: first.id in finished(marks, producing), what="the job to end")
        # The worker tried to write the job's end, and failed.
        eventually(
            lambda: any(
                "store not answering" in line and first.id in line
                for line in worker.log().splitlines()
            ),
            20,
            "the worker's release to fail",
        )
        assert job.holder() == first.id
        proxy.refuse(False)
        back = time.monotonic()
        eventually(lambda: job.holder() is None, 10, "the retried release")
        freed_after = time.monotonic() - back
        assert job.dispatch().disposition is Disposition.CREATED
    print(f"\nreleased {freed_after:.2f} s after the store answered again")
    assert freed_after < 5


def test_slow_store_replies_still_renew_a_long_jobs_lease(
    make_spec: Callable[..., Spec],
    start_worker: Callable[..., Worker],
    marks: Any,
    proxy: FaultProxy,
) -> None:
    """A job running two leases long, every reply 0.3 s late: the key never lapses.

    (The worker's first renewal waits a third of the lease, and its store
    connection's handshake takes several of those late round trips.)
    """
    working, producing = worker_spec(make_spec, proxy, lease_s=4.0)
    start_worker(working)
    proxy.delay_replies(0.3)
    with one_key(producing, "renewed") as job:
        first = job.dispatch(hold_s=9.0)
        eventually(lambda: starts(marks, producing), what="the job to start")
        held_throughout(job, first.id, lambda: first.id in finished(marks, producing), 30)
        eventually(lambda: job.holder() is None, 10, "the release")


def test_a_copy_delivered_while_the_store_is_silent_waits_for_it(
    make_spec: Callable[..., Spec],
    start_worker: Callable[..., Worker],
    marks: Any,
    proxy: FaultProxy,
) -> None:
    """A finished job's message comes again while a new job runs and the store is silent."""
    working, producing = worker_spec(make_spec, proxy, lease_s=LONG_LEASE_S)
    worker = start_worker(working)
    with one_key(producing, "copied") as job:
        first = job.dispatch()
        eventually(lambda: job.holder() is None and first.id in finished(marks, producing))
        second = job.dispatch(hold_s=5.0)
        assert second.disposition is Disposition.CREATED
        eventually(lambda: [second.id] == [s[0] for s in starts(marks, producing)][1:])
        proxy.refuse(True)
        proxy.reset_all()
        # The broker delivers the first job's message again (a publish retried
        # after a dropped connection, unacknowledged messages restored): a copy
        # under its id, with its key header.
        copy = {"v": 1, "a": job.storage_key, "s": "active"}
        with producer(producing, plain=True) as plain:
            task_of(plain).apply_async(task_id=first.id, headers={KEY_HEADER: copy})
        # The copy reached a pool child, which could not mark the key and sent it again.
        eventually(
            lambda: f"job {first.id} is sent again" in worker.log(), 20, "the copy to be deferred"
        )
        ran = [job_id for job_id, *_ in starts(marks, producing)]
        assert ran == [first.id, second.id], "the copy ran unmarked beside the job holding its key"
        proxy.refuse(False)
        eventually(lambda: second.id in finished(marks, producing), what="the second job's end")
        eventually(lambda: job.holder() is None, 20, "the key to be freed")
        eventually(lambda: queue_length(producing) == 0, 20, "the copy to leave the queue")
        # Found stale once the store answered, or run after the second job ended.
        assert [job_id for job_id, *_ in starts(marks, producing)][:2] == [first.id, second.id]
