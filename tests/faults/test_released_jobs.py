"""A job whose key was freed by an operator or the reaper is never lost, and a release
ends only the hold of the dispatch it names.

An operator's release (``celery -A proj unique release``, ``operations.release``,
the Django admin) frees the key, and the next dispatch creates a new job; the
released job still runs when it is delivered, beside it. The reaper frees only
keys whose job cannot run again: a hard time limit records ``FAILURE`` and then
requeues the message of an ``acks_late`` task that does not acknowledge
failures, and that job keeps its key while it runs again. And a job dispatched
again under a caller's ``task_id`` keeps the key its dispatch took: the end of
the first job's run does not free it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from celery_unique import Disposition, operations
from tests.processes import RedisServer

from ._apps import Spec
from .conftest import Worker, eventually, finished, one_key, queue_length, starts

pytestmark = pytest.mark.slow

#: Longer than any wait of these tests: only a release can free a key before it ends.
LONG_LEASE_S = 120.0
#: When the job dispatched again under its id is due (seconds after its dispatch).
AGAIN_DUE_S = 5.0


def test_a_waiting_job_whose_key_an_operator_released_still_runs(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """Dispatch A (waiting), release its key, dispatch B: B is created, and A and B both
    run when delivered (A is not dropped as a copy of a job that ran already)."""
    spec = make_spec(lease_s=LONG_LEASE_S)
    with one_key(spec, "released") as job:
        first = job.dispatch()
        assert first.disposition is Disposition.CREATED
        assert operations.release(job.task.app, job.storage_key) is True
        second = job.dispatch()
        assert (second.disposition, job.holder()) == (Disposition.CREATED, second.id)

        start_worker(spec)
        eventually(
            lambda: {first.id, second.id} <= set(finished(marks, spec)),
            what="the released job and the new one to run",
        )
        assert sorted(run[0] for run in starts(marks, spec)) == sorted([first.id, second.id])
        eventually(lambda: job.holder() is None, what="the new job's key to be released")


def test_the_reaper_keeps_the_key_of_a_job_requeued_after_a_hard_time_limit(
    make_spec: Callable[..., Spec],
    start_worker: Callable[..., Worker],
    marks: Any,
    services: RedisServer,
) -> None:
    """The result backend says FAILURE while the message is back in the queue: the reaper
    leaves the key, a dispatch meanwhile is REUSED, and the requeued delivery runs."""
    spec = make_spec(
        acks_late=True,
        lease_s=LONG_LEASE_S,
        settings={
            "result_backend": services.url(2),
            "task_ignore_result": False,
            "task_time_limit": 3,
            "task_acks_on_failure_or_timeout": False,
        },
    )
    start_worker(spec)
    with one_key(spec, "requeued") as job:
        app = job.task.app
        first = job.dispatch(first_hold_s=60)  # cut by the hard limit on its first run
        eventually(lambda: starts(marks, spec), what="the job to start")
        # The worker stops taking messages: the requeued one waits in the queue.
        assert app.control.cancel_consumer(spec.queue, reply=True, timeout=10)
        eventually(lambda: queue_length(spec) == 1, what="the message to be requeued")
        assert operations.job_state(app, first.id) == "FAILURE"
        eventually(lambda: job.store.get(job.storage_key).run is None, what="the run to end")

        report = operations.reap(app, apply=True)
        assert report.released == []
        assert report.kept[operations.MAY_BE_REQUEUED] == 1
        again = job.dispatch()
        assert (again.disposition, again.id) == (Disposition.REUSED, first.id)

        assert app.control.add_consumer(spec.queue, reply=True, timeout=10)
        eventually(lambda: first.id in finished(marks, spec), what="the requeued run to end")
        eventually(lambda: job.holder() is None, what="the key to be released")
        assert [run[0] for run in starts(marks, spec)] == [first.id, first.id]


def test_a_queued_job_dispatched_again_under_its_id_keeps_its_key_past_the_first_run(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """``queued`` with a caller's task_id: the first run frees the key as it starts, the
    same id is dispatched again (due later), and the first run's end leaves that new
    hold alone: until the second job starts, another dispatch is REUSED."""
    spec = make_spec(lease_s=LONG_LEASE_S)
    start_worker(spec)
    fixed = f"fixed-{uuid.uuid4().hex[:8]}"
    with one_key(spec, "refresh") as job:

        def dispatch(**options: Any) -> Any:
            return job.task.apply_async(
                kwargs={"hold_s": 1}, unique_key=job.key, unique_while="queued", **options
            )

        assert dispatch(task_id=fixed).disposition is Disposition.CREATED
        eventually(lambda: starts(marks, spec), what="the first run to start")
        eventually(lambda: job.holder() is None, what="the key to be freed at the start")
        due = time.monotonic() + AGAIN_DUE_S
        assert dispatch(task_id=fixed, countdown=AGAIN_DUE_S).disposition is Disposition.CREATED
        eventually(lambda: finished(marks, spec) == [fixed], what="the first run to end")
        # The first run's release follows its end within milliseconds; the second job
        # frees the key when it starts, not before it is due.
        while time.monotonic() < due - 1:
            assert job.holder() == fixed, "the first run's end freed the second job's key"
            time.sleep(0.05)
        assert dispatch().disposition is Disposition.REUSED
        eventually(lambda: finished(marks, spec) == [fixed, fixed], what="the second run")
