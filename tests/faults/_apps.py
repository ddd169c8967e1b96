"""The Celery apps of the fault tests: built alike in the test process and in worker processes.

A test describes its app as a :class:`Spec` of plain values; the worker's app
module (written into the test's temporary directory) rebuilds the same app
from the same spec, so producer and worker agree on every setting and task.

Tasks record what they do in Redis (the *marks* database) under the spec's
``marks`` prefix: how often each job ran, in which process, when it started
and ended. ``plain_app`` builds the same tasks as plain Celery tasks and never
imports celery_unique: a worker of a fleet that does not have the plugin yet.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from celery import Celery, signals
from celery.exceptions import SoftTimeLimitExceeded

#: The task that holds a key while it runs (tests 1, 2, 6).
JOB = "faults.job"
#: The soak's task: count the run and record it, quickly.
SOAK = "faults.soak"
#: ``faults.job`` with a declared window key (by order), for a re-send that plans its keys again.
WINDOWED = "faults.windowed"
#: A task with an active key of its own (by ``n``), and a keyless task that replaces
#: itself by it.
KEYED = "faults.keyed"
REPLACER = "faults.replacer"
#: A task holding the active key ``r:<n>`` that replaces itself by ``faults.keyed``.
KEYED_REPLACER = "faults.keyed_replacer"
#: A plain task with a soft time limit of 1 s that runs ``faults.keyed`` eagerly first.
OUTER = "faults.outer"
#: A task whose duplicates it follows (``unique_on_duplicate="latest"``, keyed by customer).
FOLLOW = "faults.follow"
#: A plain task ``faults.follow`` replaces itself by (``replace_by_tail``).
FOLLOW_TAIL = "faults.follow_tail"
#: The message header carrying a job's keys (``celery_unique.dispatch.headers.HEADER``,
#: spelled out: a plain app never imports the plugin).
KEY_HEADER = "celery_unique"


@dataclass(frozen=True)
class Spec:
    """Everything an app of one fault test needs, as plain JSON-able values."""

    broker_url: str
    queue: str
    store_url: str
    namespace: str
    marks_url: str
    marks: str
    #: ``unique_lease`` in seconds.
    lease_s: float = 30.0
    acks_late: bool = False
    fail_open: bool = False
    #: Extra Celery settings (JSON-able).
    settings: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Spec:
        return cls(**json.loads(text))


def celery_settings(spec: Spec) -> dict[str, Any]:
    """Celery settings shared by the producer and the worker of one test."""
    return {
        "broker_url": spec.broker_url,
        "task_default_queue": spec.queue,
        "task_default_exchange": spec.queue,
        "task_default_routing_key": spec.queue,
        "task_ignore_result": True,
        "task_acks_late": spec.acks_late,
        "task_reject_on_worker_lost": spec.acks_late,
        "worker_prefetch_multiplier": 1,
        "broker_connection_retry_on_startup": True,
        **spec.settings,
    }


_clients: dict[tuple[int, str], Any] = {}
_clients_lock = threading.Lock()


def marks_client(url: str) -> Any:
    """This process's Redis client on the marks database (never shared across fork)."""
    import redis

    slot = (os.getpid(), url)
    with _clients_lock:
        if slot not in _clients:
            _clients[slot] = redis.Redis.from_url(url)
        return _clients[slot]


def _define_tasks(app: Celery, spec: Spec, base: Any = None) -> None:
    options: dict[str, Any] = {"shared": False, "bind": True}
    if base is not None:
        options["base"] = base

    @app.task(name=JOB, **options)
    def job(
        self: Any,
        hold_s: float = 0.0,
        first_hold_s: float | None = None,
        first_linger_s: float = 0.0,
    ) -> int:
        """Count this run, record its process, hold for a while (longer on the first run).

        ``first_linger_s``: after its first run returns, the pool child lingers
        this long before it reports the result (a ``task_postrun`` receiver
        sleeps), so the job can be killed between its return and its ack.
        """
        return _run(spec, self.request, hold_s, first_hold_s)

    def linger(
        sender: Any = None, task_id: str | None = None, kwargs: Any = None, **_: Any
    ) -> None:
        marks = marks_client(spec.marks_url)
        seconds = float((kwargs or {}).get("first_linger_s") or 0)
        if seconds and int(marks.get(f"{spec.marks}:runs:{task_id}") or 0) == 1:
            marks.rpush(f"{spec.marks}:lingering", task_id or "")
            time.sleep(seconds)

    signals.task_postrun.connect(linger, sender=job, weak=False)

    @app.task(name=SOAK, **options)
    def soak(self: Any, key: str) -> None:
        """Record ``(key, job id, start ticket, end ticket)``; tickets order all runs."""
        marks = marks_client(spec.marks_url)
        start = marks.incr(f"{spec.marks}:ticket")
        end = marks.incr(f"{spec.marks}:ticket")
        with marks.pipeline(transaction=False) as pipe:
            pipe.incr(f"{spec.marks}:count:{key}")
            pipe.sadd(f"{spec.marks}:ran", self.request.id)
            pipe.rpush(f"{spec.marks}:runs", f"{key} {self.request.id} {start} {end}")
            pipe.execute()


def _run(spec: Spec, request: Any, hold_s: float, first_hold_s: float | None) -> int:
    marks = marks_client(spec.marks_url)
    job_id = request.id
    run = int(marks.incr(f"{spec.marks}:runs:{job_id}"))
    keyed = getattr(request, KEY_HEADER, None) is not None
    marks.rpush(f"{spec.marks}:started", json.dumps([job_id, os.getpid(), run, keyed]))
    time.sleep(first_hold_s if run == 1 and first_hold_s is not None else hold_s)
    marks.rpush(f"{spec.marks}:finished", job_id)
    return run


def _define_windowed(app: Celery, spec: Spec, base: Any) -> None:
    @app.task(
        name=WINDOWED,
        shared=False,
        bind=True,
        base=base,
        unique_window_key=lambda job: f"order:{job['order']}",
        unique_window=600,
    )
    def windowed(self: Any, order: int, first_hold_s: float | None = None) -> int:
        """``faults.job``'s run, keyed by ``order`` for ten minutes."""
        return _run(spec, self.request, 0.0, first_hold_s)


def _define_replacer(app: Celery, spec: Spec, base: Any) -> None:
    @app.task(
        name=KEYED,
        shared=False,
        bind=True,
        base=base,
        unique_key=lambda job: f"k:{job['n']}",
        unique_while="active",
    )
    def keyed(self: Any, n: int, hold_s: float = 0.0) -> int:
        """``faults.job``'s run, holding the active key ``k:<n>``."""
        return _run(spec, self.request, hold_s, None)

    @app.task(name=OUTER, shared=False, bind=True, soft_time_limit=1)
    def outer(self: Any, n: int) -> None:
        """Run ``faults.keyed`` here, then wait for the soft time limit; note its strike
        (``soft_limit``)."""
        keyed.apply(kwargs={"n": n})
        try:
            time.sleep(60)
        except SoftTimeLimitExceeded:
            marks_client(spec.marks_url).rpush(f"{spec.marks}:soft_limit", self.request.id)

    @app.task(name=REPLACER, shared=False, bind=True, base=base)
    def replacer(self: Any, n: int, hold_s: float = 0.0) -> Any:
        """Replaced by ``faults.keyed`` with the same arguments."""
        raise self.replace(keyed.si(n=n, hold_s=hold_s))

    @app.task(
        name=KEYED_REPLACER,
        shared=False,
        bind=True,
        base=base,
        unique_key=lambda job: f"r:{job['n']}",
        unique_while="active",
    )
    def keyed_replacer(self: Any, n: int, hold_s: float = 0.0) -> Any:
        """Holding ``r:<n>``, replaced by ``faults.keyed`` with the same arguments."""
        raise self.replace(keyed.si(n=n, hold_s=hold_s))


def unique_app(spec: Spec) -> Celery:
    """The app with the plugin: its tasks are ``UniqueTask`` s, keys given per dispatch."""
    from celery_unique import UniqueTask

    app = Celery(f"faults-{spec.namespace}", set_as_current=False)
    app.conf.update(
        celery_settings(spec),
        unique_backend=spec.store_url,
        unique_namespace=spec.namespace,
        unique_lease=spec.lease_s,
        unique_fail_open=spec.fail_open,
    )
    _define_tasks(app, spec, UniqueTask)
    _define_follower(app, spec, UniqueTask)
    _define_windowed(app, spec, UniqueTask)
    _define_replacer(app, spec, UniqueTask)
    app.finalize()
    return app


def _define_follower(app: Celery, spec: Spec, base: Any) -> None:
    @app.task(name=FOLLOW_TAIL, shared=False, bind=True)
    def follow_tail(self: Any, customer: int, version: int) -> int:
        """The replacement of a ``faults.follow`` run: records its run as that task does."""
        record = [self.request.id, version, time.monotonic_ns(), time.monotonic_ns()]
        marks_client(spec.marks_url).rpush(f"{spec.marks}:follow", json.dumps(record))
        return version

    @app.task(
        name=FOLLOW,
        shared=False,
        bind=True,
        base=base,
        unique_key=lambda job: f"customer:{job['customer']}",
        unique_while="active",
        unique_on_duplicate="latest",
        unique_overridable=True,
    )
    def follow(
        self: Any,
        customer: int,
        version: int,
        hold_s: float = 0.0,
        retry_once: bool = False,
        until_let_go: bool = False,
        successor: int | None = None,
        replace_by_tail: bool = False,
    ) -> int:
        """Note the start (``follow_started``), hold (``until_let_go``: until the test sets
        ``let_go``), then record ``[job id, version, start ns, end ns]`` of the run
        (``follow``). With ``successor``, first dispatch the next job of the customer, at
        that version (a job that re-enqueues itself), noting its disposition
        (``successors``). With ``replace_by_tail``, after the hold, the run replaces itself
        by ``faults.follow_tail`` (a plain task), which records the run."""
        start = time.monotonic_ns()
        marks = marks_client(spec.marks_url)
        marks.rpush(f"{spec.marks}:follow_started", self.request.id)
        time.sleep(hold_s)
        deadline = time.monotonic() + 120
        while until_let_go and not marks.get(f"{spec.marks}:let_go"):
            if time.monotonic() > deadline:
                raise TimeoutError("the test never let the run go")
            time.sleep(0.05)
        if retry_once and not self.request.retries:
            raise self.retry(countdown=0.1)
        if replace_by_tail:
            raise self.replace(follow_tail.si(customer=customer, version=version))
        if successor is not None:
            sent = self.apply_async(kwargs={"customer": customer, "version": successor})
            marks.rpush(f"{spec.marks}:successors", sent.disposition.value)
        record = [self.request.id, version, start, time.monotonic_ns()]
        marks.rpush(f"{spec.marks}:follow", json.dumps(record))
        return version


def plain_app(spec: Spec) -> Celery:
    """The same app and tasks without the plugin (celery_unique is never imported)."""
    app = Celery(f"faults-plain-{spec.namespace}", set_as_current=False)
    app.conf.update(celery_settings(spec))
    _define_tasks(app, spec)
    app.finalize()
    return app
