"""Workers killed mid-job: what becomes of the job and of its key.

* ``acks_late=True``: the message is redelivered, the key stays held until the
  redelivered job ends, and dispatches in between are REUSED;
* ``acks_late=False``, whole worker killed: the job is lost, and its key is
  freed by its lease, since no live worker renews it any more;
* one pool child killed: without ``acks_late`` the worker's main process
  reports the loss and frees the key at once; with ``acks_late`` (and
  ``task_reject_on_worker_lost``) the job runs again and keeps its key.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import pytest

from celery_unique import Disposition

from ._apps import WINDOWED, Spec
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

#: Redis transport options for a redelivery within seconds of a worker's death:
#: messages unacknowledged for 5 s become visible again, and every worker looks
#: for them once a second (kombu's default is an hour and a sweep every 100 s).
FAST_REDELIVERY = {
    "visibility_timeout": 5,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    # A worker killed while it holds the sweep's lock would block the others this long.
    "unacked_mutex_expire": 3,
}
#: Longer than any wait of these tests: only a release can free a key before it ends.
LONG_LEASE_S = 60.0
SHORT_LEASE_S = 3.0

pytestmark = pytest.mark.slow


def test_acks_late_job_of_a_killed_worker_keeps_its_key_and_runs_again(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """acks_late: a killed worker's job keeps its key, is reused meanwhile, reruns, frees it."""
    spec = make_spec(
        acks_late=True,
        lease_s=LONG_LEASE_S,
        settings={"broker_transport_options": FAST_REDELIVERY},
    )
    worker = start_worker(spec)
    with one_key(spec, "crash") as job:
        # Hangs on its first run (until killed), returns at once when run again.
        first = job.dispatch(first_hold_s=120)
        assert first.disposition is Disposition.CREATED
        eventually(lambda: starts(marks, spec), what="the job to start")
        worker.kill()

        assert job.holder() == first.id
        for _ in range(3):
            again = job.dispatch()
            assert (again.disposition, again.id) == (Disposition.REUSED, first.id)
        assert queue_length(spec) == 0  # nothing new was published

        start_worker(spec)
        eventually(lambda: first.id in finished(marks, spec), 60, "the redelivered run")
        eventually(lambda: job.holder() is None, what="the key to be released")
    assert [(job_id, run) for job_id, _, run, _ in starts(marks, spec)] == [
        (first.id, 1),
        (first.id, 2),
    ]
    assert finished(marks, spec) == [first.id]


def test_lost_job_of_a_killed_worker_frees_its_key_when_the_lease_ends(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """No acks_late: a killed worker's job is lost; its key lapses; then a new job is created."""
    spec = make_spec(lease_s=SHORT_LEASE_S)
    worker = start_worker(spec)
    with one_key(spec, "lost") as job:
        first = job.dispatch(hold_s=120)
        eventually(lambda: starts(marks, spec), what="the job to start")
        worker.kill()

        assert job.holder() == first.id
        eventually(lambda: job.holder() is None, 4 * SHORT_LEASE_S, "the lease to end")
        second = job.dispatch()
        assert second.disposition is Disposition.CREATED
        assert second.id != first.id
    assert finished(marks, spec) == []


def test_a_killed_pool_child_frees_its_jobs_key_at_once(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """No acks_late: the main process reports WorkerLostError and frees the key, no lease wait."""
    spec = make_spec(lease_s=LONG_LEASE_S)
    worker = start_worker(spec)
    with one_key(spec, "child") as job:
        first = job.dispatch(hold_s=120)
        [(job_id, pid, _, _)] = eventually(lambda: starts(marks, spec), what="the job")
        assert job_id == first.id
        assert pid != worker.process.pid
        os.kill(pid, signal.SIGKILL)

        # Far sooner than the lease: only the main process's release can do this.
        eventually(lambda: job.holder() is None, LONG_LEASE_S / 3, "the key to be released")
        assert "WorkerLostError" in worker.log()
        assert worker.alive()
        second = job.dispatch()
        assert second.disposition is Disposition.CREATED
        eventually(lambda: second.id in finished(marks, spec), what="the next job to run")
    assert finished(marks, spec) == [second.id]


def test_acks_late_job_of_a_killed_pool_child_keeps_its_key_and_runs_again(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """acks_late: a killed child's job is requeued and rerun; its key is held until it ends."""
    spec = make_spec(acks_late=True, lease_s=LONG_LEASE_S)
    worker = start_worker(spec)
    with one_key(spec, "requeued") as job:
        # Hangs on its first run (until its child is killed), takes a moment when run again.
        first = job.dispatch(first_hold_s=120, hold_s=SHORT_LEASE_S)
        [(_, pid, _, _)] = eventually(lambda: starts(marks, spec), what="the job to start")
        os.kill(pid, signal.SIGKILL)

        eventually(lambda: len(starts(marks, spec)) == 2, what="the job to run again")
        assert job.holder() == first.id, "the loss of the child must not release the key"
        again = job.dispatch()
        assert (again.disposition, again.id) == (Disposition.REUSED, first.id)
        eventually(lambda: first.id in finished(marks, spec), what="the second run to end")
        eventually(lambda: job.holder() is None, what="the key to be released")
        assert worker.alive()
    assert [(job_id, run) for job_id, _, run, _ in starts(marks, spec)] == [
        (first.id, 1),
        (first.id, 2),
    ]


def test_window_keyed_job_of_a_killed_pool_child_is_retried_under_its_own_key(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """retry_on_worker_lost: the worker's re-send of a job whose only key is a window key
    is the job going on, published, never a conflict with its own window key."""
    spec = make_spec(
        lease_s=LONG_LEASE_S,
        settings={
            "task_retry_on_worker_lost": True,
            # Celery re-sends a lost job with this countdown: a request the window
            # key's fingerprint would call different.
            "task_annotations": {WINDOWED: {"default_retry_delay": 0.5}},
        },
    )
    worker = start_worker(spec)
    with producer(spec) as app:
        job = task_of(app, WINDOWED)

        def dispatch() -> Any:
            return job.apply_async(kwargs={"order": 7, "first_hold_s": 120})

        first = dispatch()
        assert first.disposition is Disposition.CREATED
        [(_, pid, _, _)] = eventually(lambda: starts(marks, spec), what="the job to start")
        os.kill(pid, signal.SIGKILL)

        eventually(lambda: first.id in finished(marks, spec), what="the re-sent job to run")
        assert "UniquenessConflict" not in worker.log()
        again = dispatch()
        assert (again.disposition, again.id) == (Disposition.REUSED, first.id)
        assert worker.alive()
    assert [(job_id, run) for job_id, _, run, _ in starts(marks, spec)] == [
        (first.id, 1),
        (first.id, 2),
    ]
