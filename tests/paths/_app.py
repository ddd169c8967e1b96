"""The path matrix's app: a task per delivery path, built alike by the test and the worker.

Every task body records each run in the *marks* Redis database: when it
started and ended (``time.monotonic_ns()``, one clock for every process of
the machine), in which process, which run of its job it was. A run that is
killed has a start and no end. Unique tasks declare their key (the ``key``
argument), as users do; each dispatch picks the scope and
``unique_prefix=False``, so the probe task can ask for a cell's key after the
cell's job is over.

The worker's app module is two lines written by the test: it reads the spec
from ``PATHS_SPEC`` and calls :func:`build`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from celery import Celery, Task, chain, signals
from celery.exceptions import Ignore, Reject
from kombu import Exchange, Queue

PREFIX = "paths"
#: How long a body that should be cut short (killed, revoked, timed out) sleeps.
HANG_S = 20.0
#: How long every other body takes: long enough to be seen running.
WORK_S = 0.3
#: How long a slow body takes: long enough for a copy of another job to come meanwhile.
SLOW_S = 2.0
#: Tasks whose pool child, after Celery's trace of a run that went on (retried,
#: replaced), is slow to report it to the worker: past the run's soft time limit.
REPORTED_LATE = (
    "paths.retry_reported_late",
    "paths.replace_reported_late",
    "paths.reject_requeue_reported_late",
)
REPORT_LATE_S = 1.0
#: Paths also played with a window key: each gets a twin task, ``paths.window.<path>``,
#: that declares the window key (the ``key`` argument) and no active key.
WINDOWED = (
    "success",
    "failure",
    "fail_after_retry",
    "retry",
    "autoretry",
    "reject_requeue",
    "replace_unique",
    "replace_plain",
    "killed",
    "killed_requeue",
    "killed_retry",
)
#: The window of the twins (seconds): longer than any pass.
WINDOW_S = 600

_clients: dict[tuple[int, str], Any] = {}
_lock = threading.Lock()


def marks_client(url: str) -> Any:
    """This process's client on the marks database (never shared across fork)."""
    import redis

    slot = (os.getpid(), url)
    with _lock:
        if slot not in _clients:
            _clients[slot] = redis.Redis.from_url(url)
        return _clients[slot]


@contextmanager
def answering_late(store: Any, keep_ms: int, late_s: float) -> Iterator[None]:
    """In this pool child, the store's answer to a ``keep_ms`` write comes ``late_s`` after
    the write (a store slow to reply)."""
    release_many = store.release_many

    def late(releases: Any) -> Any:
        answer = release_many(releases)
        if any(release.keep_ms == keep_ms for release in releases):
            time.sleep(late_s)
        return answer

    store.release_many = late
    try:
        yield
    finally:
        del store.release_many


_traces: dict[str, Callable[..., Any]] = {}


def _reported_late(name: str, outcome: Any) -> Any:
    # The trace is over; billiard's worker loop has yet to send its outcome to
    # the worker, whose timer may send the soft time limit meanwhile (a loaded
    # machine, a large result to pickle).
    if name in REPORTED_LATE and outcome[0]:
        time.sleep(REPORT_LATE_S)
    return outcome


def fast_trace_reported_late(name: str, *args: Any, **kwargs: Any) -> Any:
    return _reported_late(name, _traces["fast"](name, *args, **kwargs))


def trace_reported_late(name: str, *args: Any, **kwargs: Any) -> Any:
    return _reported_late(name, _traces["ret"](name, *args, **kwargs))


def report_late() -> None:
    """Have the worker's pool run the traces above (module functions: a pool job
    names its function, pickled by reference)."""
    from celery.worker import request

    if not _traces:
        _traces.update(fast=request.fast_trace_task, ret=request.trace_task_ret)
        request.fast_trace_task = fast_trace_reported_late
        request.trace_task_ret = trace_reported_late


def record_accepts(marks_url: str, namespace: str) -> None:
    """Note in the marks database when the worker's main process hears that the pool took
    a job: a child killed before that has billiard give the job to another child."""
    from celery.worker.request import Request

    if getattr(Request.on_accepted, "_records", False):
        return
    accepted = Request.on_accepted

    def on_accepted(self: Any, pid: Any, time_accepted: float) -> None:
        accepted(self, pid, time_accepted)
        marks_client(marks_url).set(f"{namespace}:accepted:{self.id}", str(pid))

    on_accepted._records = True  # type: ignore[attr-defined]
    Request.on_accepted = on_accepted  # type: ignore[method-assign]


def build(spec: dict[str, Any], *, producer: bool = False) -> Celery:
    """The app of one pass of the matrix (``producer``: with the task no worker knows)."""
    from celery_unique import UniqueTask
    from celery_unique.config import runtime
    from celery_unique.stores.base import HANDING_OVER

    app = Celery(f"paths-{spec['namespace']}", set_as_current=False)
    queues = [
        Queue(name, Exchange(name), routing_key=name, queue_arguments={"x-expires": 600_000})
        for name in (spec["queue"], spec["idle_queue"])
    ]
    app.conf.update(
        broker_url=spec["broker_url"],
        task_default_queue=spec["queue"],
        task_default_exchange=spec["queue"],
        task_default_routing_key=spec["queue"],
        task_queues=queues,
        task_ignore_result=True,
        worker_prefetch_multiplier=spec.get("prefetch", 1),
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": spec.get("visibility_timeout_s", 3600)},
        result_expires=timedelta(seconds=spec["retention_s"]),
        unique_backend=spec["store_url"],
        unique_namespace=spec["namespace"],
        unique_lease=spec["lease_s"],
    )
    marks_url, ns = spec["marks_url"], spec["namespace"]

    def run_of(task: Any) -> tuple[str, int]:
        """Record the start of a run; return the job id and which run of it this is."""
        marks = marks_client(marks_url)
        job_id = task.request.id
        run = int(marks.incr(f"{ns}:n:{job_id}"))
        record = {
            "job": job_id,
            "task": task.name,
            "run": run,
            "pid": os.getpid(),
            "start": time.monotonic_ns(),
            "parent": task.request.parent_id,
        }
        with marks.pipeline(transaction=False) as pipe:
            pipe.rpush(f"{ns}:s:{job_id}", json.dumps(record))
            pipe.rpush(f"{ns}:jobs", job_id)
            pipe.execute()
        return job_id, run

    def ended(job_id: str, run: int) -> None:
        marks = marks_client(marks_url)
        marks.rpush(f"{ns}:e:{job_id}", json.dumps({"run": run, "end": time.monotonic_ns()}))

    def recording(body: Callable[[Any, int], Any]) -> Callable[[Any, str], Any]:
        def run(self: Any, key: str) -> Any:
            job_id, number = run_of(self)
            try:
                return body(self, number)
            finally:
                ended(job_id, number)

        run.__name__ = body.__name__
        return run

    def task(
        name: str, body: Callable[[Any, int], Any], base: Any = UniqueTask, **options: Any
    ) -> Any:
        if name in WINDOWED:
            # Declared too, so that a re-send under the job's id plans the window key
            # again (and must not find it "a different request").
            app.task(
                name=f"{PREFIX}.window.{name}",
                bind=True,
                shared=False,
                base=base,
                unique_window_key=lambda job: job.key,
                unique_window=WINDOW_S,
                **options,
            )(recording(body))
        if base is UniqueTask:
            # Declared, as users do: a re-send under the job's own id must not be
            # decided again (it would find its own key held). The scope and the
            # sharing across tasks (for the probe) are chosen per dispatch.
            options.update(unique_key=lambda job: job.key, unique_overridable=True)
        return app.task(name=f"{PREFIX}.{name}", bind=True, shared=False, base=base, **options)(
            recording(body)
        )

    def work(self: Any, run: int) -> None:
        time.sleep(WORK_S)

    def slow(self: Any, run: int) -> None:
        time.sleep(SLOW_S)

    def hang_first(self: Any, run: int) -> None:
        time.sleep(HANG_S if run == 1 else WORK_S)

    def fail(self: Any, run: int) -> None:
        raise ValueError("failed for good")

    def fail_after_retry(self: Any, run: int) -> None:
        if self.request.retries < 1:
            raise self.retry(countdown=WORK_S, max_retries=1)
        raise ValueError("failed for good after a retry")

    def retrying_once(countdown: float, **next_options: Any) -> Callable[[Any, int], None]:
        """A body that retries once, due ``countdown`` later, then succeeds."""

        def retry_once(self: Any, run: int) -> None:
            if self.request.retries < 1:
                raise self.retry(countdown=countdown, **next_options)
            time.sleep(WORK_S)

        return retry_once

    def autoretry_once(self: Any, run: int) -> None:
        if self.request.retries < 1:
            raise KeyError("retried by autoretry_for")
        time.sleep(WORK_S)

    def reject_requeue_once(self: Any, run: int) -> None:
        if run == 1:
            raise Reject("requeued by the test", requeue=True)
        time.sleep(WORK_S)

    def reject_drop(self: Any, run: int) -> None:
        raise Reject("dropped by the test", requeue=False)

    def ignore(self: Any, run: int) -> None:
        raise Ignore()

    tail_unique = task("tail_unique", work)
    tail_plain = task("tail_plain", work, base=Task)
    step_plain = task("step_plain", work, base=Task)

    def replace_unique(self: Any, run: int) -> Any:
        return self.replace(tail_unique.s(self.request.kwargs["key"]))

    def replace_plain(self: Any, run: int) -> Any:
        return self.replace(tail_plain.s(self.request.kwargs["key"]))

    def replace_chain(self: Any, run: int) -> Any:
        key = self.request.kwargs["key"]
        return self.replace(chain(step_plain.s(key), step_plain.si(key)))

    tail_sent_slowly = task("tail_sent_slowly", work, base=Task)

    def replace_then_cut(self: Any, run: int) -> Any:
        # Due after the hard time limit: the replacement has not started when
        # the worker learns that the replaced run was cut short.
        later = tail_sent_slowly.s(self.request.kwargs["key"]).set(countdown=SLOW_S)
        return self.replace(later)

    tail_sent_late = task("tail_sent_late", work, base=Task)

    def replace_then_limit(self: Any, run: int) -> Any:
        later = tail_sent_late.s(self.request.kwargs["key"]).set(countdown=SLOW_S)
        return self.replace(later)

    tail_marked_slowly = task("tail_marked_slowly", work, base=Task)

    def replace_marked_slowly(self: Any, run: int) -> Any:
        # The store answers the hand-over mark past the soft time limit. A queued
        # key takes no mark: there the limit strikes before replace(), and the job
        # fails alike.
        # (Long waits: a loaded machine's pool can be late with its soft time limit,
        # which cuts them short.)
        if self.request.celery_unique.get("s") == "queued":
            time.sleep(HANG_S)
        later = tail_marked_slowly.s(self.request.kwargs["key"])
        with answering_late(runtime(self.app).store, HANDING_OVER, HANG_S):
            return self.replace(later)

    tail_after_error = task("tail_after_error", work, base=Task)

    def replace_then_raise(self: Any, run: int) -> Any:
        try:
            # Due a second later (as are the next path's): the replaced run's end
            # reaches the store before the replacement starts.
            return self.replace(tail_after_error.s(self.request.kwargs["key"]).set(countdown=1))
        finally:
            raise RuntimeError("the body went on after replace(), and failed")

    tail_after_internal = task("tail_after_internal", work, base=Task)

    def replace_before_internal_error(self: Any, run: int) -> Any:
        return self.replace(tail_after_internal.s(self.request.kwargs["key"]).set(countdown=1))

    def retry_then_raise(self: Any, run: int) -> Any:
        if self.request.retries >= 1:
            return time.sleep(WORK_S)
        try:
            raise self.retry(countdown=1)
        finally:
            raise RuntimeError("the body went on after retry(), and failed")

    class FailAfterBody(logging.Filter):
        """Raises in Celery's own code after the body (where it logs how the run
        ended), as a soft time limit striking there does."""

        def filter(self, record: logging.LogRecord) -> bool:
            data = getattr(record, "data", None)
            if not isinstance(data, dict):
                data = record.args if isinstance(record.args, dict) else {}
            name, description = data.get("name"), data.get("description")
            if (name, description) == (f"{PREFIX}.replace_internal_error", "ignored") or (
                name == f"{PREFIX}.retry_internal_error" and "retry" in str(record.msg)
            ):
                raise RuntimeError("Celery's code failed after the body")
            return True

    logging.getLogger("celery.app.trace").addFilter(FailAfterBody())

    def slow_first_mark(sender: Any = None, task_id: str = "", **_: Any) -> None:
        # The store answers the first delivery's mark past its soft time limit.
        if sender is None or sender.name != f"{PREFIX}.slow_mark":
            return
        if int(marks_client(marks_url).incr(f"{ns}:marked:{task_id}")) > 1:
            return
        store = runtime(app).store
        begin_run = store.begin_run

        def late(*args: Any, **kwargs: Any) -> Any:
            store.begin_run = begin_run
            answer = begin_run(*args, **kwargs)
            time.sleep(1.0)  # past the soft time limit
            return answer

        store.begin_run = late

    signals.task_prerun.connect(slow_first_mark, weak=False)

    def hang_once_sent(sender: Any = None, **_: Any) -> None:
        # The replacement has left; the pool child now hangs until its hard time
        # limit kills it, before replace() could end the run as replaced.
        if sender == tail_sent_slowly.name or (
            sender == f"{PREFIX}.retry_hard_limit" and app.current_worker_task is not None
        ):
            time.sleep(HANG_S)
        # Past its soft time limit, which strikes as replace() ends.
        if sender == tail_sent_late.name:
            time.sleep(1.0)

    signals.after_task_publish.connect(hang_once_sent, weak=False)
    if not producer:
        report_late()
        record_accepts(marks_url, ns)

    task("success", work)
    task("failure", fail)
    task("fail_after_retry", fail_after_retry)
    task("retry", retrying_once(WORK_S))
    task("autoretry", autoretry_once, autoretry_for=(KeyError,), retry_kwargs={"countdown": WORK_S})
    task("reject_requeue", reject_requeue_once, acks_late=True)
    task("reject_drop", reject_drop, acks_late=True)
    task("ignore", ignore)
    task("replace_unique", replace_unique)
    task("replace_plain", replace_plain)
    task("replace_chain", replace_chain)
    task("replace_hard_limit", replace_then_cut, time_limit=1)
    task("replace_soft_limit", replace_then_limit, soft_time_limit=0.5)
    task("replace_slow_mark", replace_marked_slowly, soft_time_limit=0.5)
    task("replace_then_raise", replace_then_raise)
    task("replace_internal_error", replace_before_internal_error)
    task("retry_then_raise", retry_then_raise)
    # Due a second later: the ended run's writes reach the store before the attempt.
    task("retry_internal_error", retrying_once(1))
    # Due after the hard time limit, which strikes as the attempt leaves. The limit is
    # the first attempt's alone: on a busy machine the next one's start alone can take
    # a second, and a second cut would be another path.
    task("retry_hard_limit", retrying_once(SLOW_S, time_limit=HANG_S), time_limit=1)
    task("retry_reported_late", retrying_once(1), soft_time_limit=0.5)
    tail_reported_late = task("tail_reported_late", work, base=Task)

    def replace_reported_late(self: Any, run: int) -> Any:
        return self.replace(tail_reported_late.s(self.request.kwargs["key"]).set(countdown=1))

    task("replace_reported_late", replace_reported_late, soft_time_limit=0.5)
    task("reject_requeue_reported_late", reject_requeue_once, acks_late=True, soft_time_limit=0.5)
    task("revoke_waiting", work)
    task("revoke_running", hang_first)
    task("expires_eta", work)
    task("expires_queued", work)
    task("soft_limit", hang_first, soft_time_limit=0.5)
    task("slow_mark", work, soft_time_limit=0.5)
    task("hard_limit", hang_first, time_limit=1)
    task("hard_limit_late_ack", hang_first, time_limit=1, acks_late=True)
    # Each run has this limit, the second too: room for its start on a busy machine.
    task(
        "hard_limit_late_requeue",
        hang_first,
        time_limit=3,
        acks_late=True,
        acks_on_failure_or_timeout=False,
    )
    task("killed", hang_first)
    task("killed_requeue", hang_first, acks_late=True, reject_on_worker_lost=True)
    task("killed_retry", hang_first, retry_on_worker_lost=True, default_retry_delay=WORK_S)
    task("latest", work)
    task("latest_retry", retrying_once(WORK_S))
    task("latest_killed", hang_first)
    task("debounce", work)
    task("probe", work)
    task("slow", slow)
    if producer:
        # Registered here only: the worker has never heard of it.
        task("unknown", work)
    app.finalize()
    return app
