"""A guided tour of celery-unique that needs no services: ``python -m celery_unique.demo``.

Everything runs in this process on the embedded defaults: the SQLite store in
a temporary file, kombu's in-memory broker and one worker in a thread (solo
pool, so it runs one job at a time). The tour dispatches real tasks and prints
what each dispatch returned and what the store held just before it:

1. active keys in each scope (``queued``, ``active``, ``exists``): a job, then
   duplicates while it waits, while it runs and after it finished;
2. a key derived from some paths of the payload (``Payload(only=[...])``);
3. a window key: the same request, a different request, a retry-policy change;
4. invalid keys, refused before anything is written or published.

:func:`main` returns a :class:`Report` with every dispatch as data. The demo
also checks each outcome against the documented behaviour and exits with
status 1, naming the scene, if the library did something else.

This module is not imported by ``celery_unique`` itself.
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from celery import Celery, Task, current_app, signals
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult
from celery.utils import uuid

from celery_unique import Payload, UniquenessError, UniqueTask, config, keyspace
from celery_unique.stores.base import HeldKey, KeyKind, Scope, Store

#: How long the demo waits for any one thing to happen before it gives up.
TIMEOUT_S = 10.0
SCOPES = ("queued", "active", "exists")
RETENTION = timedelta(seconds=60)
WINDOW = timedelta(hours=24)

#: What the documentation says each step returns ("REUSED J1": the first job).
EXPECTED = {
    "queued": ["CREATED J1", "REUSED J1", "CREATED J2", "CREATED J3"],
    "active": ["CREATED J1", "REUSED J1", "REUSED J1", "CREATED J2"],
    "exists": ["CREATED J1", "REUSED J1", "REUSED J1", "REUSED J1"],
    "payload": ["CREATED J1", "REUSED J1", "CREATED J2"],
    "window": [
        "CREATED J1",
        "REUSED J1",
        "uniqueness_conflict J1",
        "REUSED J1",
        "CREATED J2",
    ],
}


class DemoError(RuntimeError):
    """Something the demo waited for did not happen in time."""


@dataclass(frozen=True)
class Row:
    """One dispatch and what came of it."""

    #: What the dispatch was, or the moment it was sent at.
    step: str
    #: ``CREATED``, ``REUSED`` or an error code.
    outcome: str
    #: ``J1``, ``J2`` ... in the order the scene met the jobs; for errors, the
    #: job the error names (``conflicting_job_id``), if any.
    job: str | None
    job_id: str | None
    #: ``active``, ``window`` or ``None`` (the receipt's ``duplicate_match``).
    match: str | None = None
    policy_drift: bool = False
    #: What the store held for the key just before this dispatch.
    key_before: str = ""
    #: Free text: the key, or the error's message.
    detail: str = ""

    @property
    def summary(self) -> str:
        """``"REUSED J1"``: the outcome and the job, as :data:`EXPECTED` lists them."""
        return f"{self.outcome} {self.job}" if self.job else self.outcome


@dataclass(frozen=True)
class Refusal:
    """An invalid dispatch: the error it raised and what it changed (nothing)."""

    given: str
    code: str
    message: str
    keys_written: int
    messages_published: int


@dataclass
class Report:
    """Every dispatch the demo made, by scene, and what did not go as documented."""

    scopes: dict[str, list[Row]] = field(default_factory=dict)
    #: For each scope, the moment its first job's key was seen free (or ``None``).
    freed: dict[str, str | None] = field(default_factory=dict)
    payload: list[Row] = field(default_factory=list)
    #: Per payload dispatch: the store holds the key computed by hand with
    #: ``Payload.key`` for the job the dispatch returned.
    payload_keys_held: list[bool] = field(default_factory=list)
    window: list[Row] = field(default_factory=list)
    invalid: list[Refusal] = field(default_factory=list)
    #: Lines the library logged at WARNING or above (logger ``celery_unique``).
    warnings: list[str] = field(default_factory=list)
    surprises: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.surprises


# -- the stage: a worker whose jobs the demo can hold and watch --------------------------


class Stage:
    """Holds chosen jobs at their start and tells when a job started or finished.

    The tasks call :meth:`checkpoint` first thing; a job whose id was passed to
    :meth:`hold` waits there until :meth:`let_go`. Starts and ends are seen
    through Celery's ``task_prerun``/``task_postrun`` signals; the worker
    releases keys a moment later (once the message is acknowledged), which
    the waits watch in the store.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gates: dict[str, threading.Event] = {}
        self._started: dict[str, threading.Event] = {}
        self._finished: dict[str, threading.Event] = {}

    def _event(self, table: dict[str, threading.Event], job_id: str) -> threading.Event:
        with self._lock:
            return table.setdefault(job_id, threading.Event())

    def hold(self, job_id: str) -> None:
        self._event(self._gates, job_id)

    def let_go(self, job_id: str) -> None:
        self._event(self._gates, job_id).set()

    def checkpoint(self, job_id: str) -> None:
        with self._lock:
            gate = self._gates.get(job_id)
        if gate is not None and not gate.wait(TIMEOUT_S):
            raise DemoError(f"job {job_id} was held for more than {TIMEOUT_S} s")

    def _on_prerun(self, task_id: str | None = None, **_: Any) -> None:
        if task_id:
            self._event(self._started, task_id).set()

    def _on_postrun(self, task_id: str | None = None, **_: Any) -> None:
        if task_id:
            self._event(self._finished, task_id).set()

    def wait_started(self, job_id: str, store: Store | None = None) -> None:
        """Wait until the job started (and, with ``store``, its ``queued`` key was released)."""
        self._wait(self._started, job_id, "start")
        if store is not None:
            self._settle(
                store, lambda held: held.job_id == job_id and held.scope is Scope.QUEUED, job_id
            )

    def wait_finished(self, job_ids: Sequence[str], store: Store | None = None) -> None:
        """Wait until the jobs ran to their end and the worker released what they held.

        The worker releases a job's keys once its message is acknowledged, a
        moment after the job's last signal: with ``store``, wait for that too.
        """
        for job_id in job_ids:
            self._wait(self._finished, job_id, "finish")
        if store is not None:
            self._settle(
                store,
                lambda held: (
                    held.job_id in job_ids and held.kind is KeyKind.ACTIVE and not held.finished
                ),
                ", ".join(job_ids),
            )

    @staticmethod
    def _settle(store: Store, held_still: Callable[[HeldKey], bool], jobs: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while any(held_still(held) for held in store.scan()):
            if time.monotonic() > deadline:
                raise DemoError(f"the keys of {jobs} were not released")
            time.sleep(0.005)

    def _wait(self, table: dict[str, threading.Event], job_id: str, what: str) -> None:
        if not self._event(table, job_id).wait(TIMEOUT_S):
            raise DemoError(f"job {job_id} did not {what} within {TIMEOUT_S} s")

    @contextmanager
    def watching(self) -> Iterator[None]:
        uid = f"celery_unique.demo.{id(self)}"
        signals.task_prerun.connect(self._on_prerun, weak=False, dispatch_uid=uid + ".pre")
        signals.task_postrun.connect(self._on_postrun, weak=False, dispatch_uid=uid + ".post")
        try:
            yield
        finally:
            for gate in list(self._gates.values()):
                gate.set()  # never leave the worker stuck
            signals.task_prerun.disconnect(dispatch_uid=uid + ".pre")
            signals.task_postrun.disconnect(dispatch_uid=uid + ".post")


class Labels:
    """Short names for job ids, in the order a scene meets them: J1, J2, ..."""

    def __init__(self) -> None:
        self._names: dict[str, str] = {}

    def __call__(self, job_id: str | None) -> str | None:
        if job_id is None:
            return None
        return self._names.setdefault(job_id, f"J{len(self._names) + 1}")

    @property
    def ids(self) -> list[str]:
        return list(self._names)


# -- the app and its tasks ---------------------------------------------------------------


@dataclass
class Demo:
    """The app, its tasks, the stage and the running tally."""

    app: Celery
    stage: Stage
    tasks: dict[str, UniqueTask]
    #: A plain task that keeps the worker busy (see :meth:`worker_busy`).
    occupy: Task[Any, Any]
    published: list[str] = field(default_factory=list)

    @property
    def store(self) -> Store:
        return config.runtime(self.app).store

    def store_keys(self) -> int:
        return sum(1 for _ in self.store.scan())

    def held(self, task: UniqueTask, key: str, *, window: bool = False) -> HeldKey | None:
        kind = keyspace.WINDOW if window else keyspace.ACTIVE
        namespace = config.runtime(self.app).namespace
        return config.runtime(self.app).store.get(
            keyspace.storage_key(namespace, kind, task.name, key)
        )

    @contextmanager
    def worker_busy(self) -> Iterator[None]:
        """Keep the (single) worker busy with another job, so new jobs wait in the queue."""
        job_id = uuid()
        self.stage.hold(job_id)
        self.occupy.apply_async(task_id=job_id)
        self.stage.wait_started(job_id)
        try:
            yield
        finally:
            self.stage.let_go(job_id)


def build_app(store_url: str, stage: Stage) -> Demo:
    """An app on the in-memory broker with the given store, and the demo's tasks."""
    app = Celery("demo", broker="memory://localhost/", set_as_current=False)
    app.conf.update(
        unique_backend=store_url,
        broker_connection_retry_on_startup=False,
        # kombu's in-memory transport polls; the default 1 s would make the tour slow.
        broker_transport_options={"polling_interval": 0.01},
        worker_hijack_root_logger=False,
    )
    tasks: dict[str, UniqueTask] = {}

    def recalculate(self: Task[Any, Any], tenant_id: int) -> str:
        stage.checkpoint(self.request.id or "")
        return f"stats of tenant {tenant_id}"

    for scope in SCOPES:
        tasks[scope] = app.task(
            name=f"demo.recalculate_{scope}",
            base=UniqueTask,
            bind=True,
            shared=False,
            unique_key=lambda job: f"tenant:{job.tenant_id}",
            unique_while=scope,
            unique_retention=RETENTION,
        )(recalculate)

    @app.task(
        name="demo.send_digest",
        base=UniqueTask,
        bind=True,
        shared=False,
        unique_key=Payload(only=[".user_id", ".template"]),
    )
    def send_digest(self: Task[Any, Any], user_id: int, template: str, requested_at: str) -> None:
        stage.checkpoint(self.request.id or "")

    @app.task(
        name="demo.place_order",
        base=UniqueTask,
        bind=True,
        shared=False,
        unique_window_key=lambda job: job.request_id,
        unique_window=WINDOW,
    )
    def place_order(self: Task[Any, Any], order_id: str, amount: int, request_id: str) -> None:
        stage.checkpoint(self.request.id or "")

    @app.task(name="demo.export", base=UniqueTask, shared=False)
    def export(tenant_id: int) -> None:
        return None

    @app.task(
        name="demo.notify",
        base=UniqueTask,
        shared=False,
        unique_key=lambda job: f"user:{job.user_name}",
    )
    def notify(user_name: str) -> None:
        return None

    @app.task(name="demo.occupy", bind=True, shared=False)
    def occupy(self: Task[Any, Any]) -> None:
        stage.checkpoint(self.request.id or "")

    tasks.update(payload=send_digest, window=place_order, export=export, notify=notify)
    app.finalize()
    return Demo(app=app, stage=stage, tasks=tasks, occupy=occupy)


# -- the scenes --------------------------------------------------------------------------


def _ceil_duration(ms: int | None) -> str:
    """A remaining time rounded up, so that a fresh 60 s reads "60 s", not "59 s"."""
    if ms is None:
        return "no expiry"
    seconds = math.ceil(ms / 1000)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{math.ceil(seconds / 60)} min"
    return f"{math.ceil(seconds / 3600)} h"


def describe(held: HeldKey | None, labels: Labels) -> str:
    """The store's view of a key, in words: ``free``, ``held by J1``, ..."""
    if held is None:
        return "free"
    who = labels(held.job_id)
    if held.kind.value == "window":
        return f"points at {who}, {_ceil_duration(held.expires_in_ms)} left"
    if held.finished:
        return f"held by {who} (finished; kept {_ceil_duration(held.expires_in_ms)} more)"
    return f"held by {who}"


def dispatched(step: str, result: AsyncResult[Any], labels: Labels, before: str) -> Row:
    match = result.duplicate_match  # type: ignore[attr-defined]
    return Row(
        step=step,
        outcome=result.disposition.name,  # type: ignore[attr-defined]
        job=labels(result.id),
        job_id=result.id,
        match=None if match is None else match.value,
        policy_drift=result.policy_drift,  # type: ignore[attr-defined]
        key_before=before,
    )


def refused(step: str, error: UniquenessError, labels: Labels, before: str) -> Row:
    job_id: str | None = getattr(error, "conflicting_job_id", None)
    return Row(
        step=step,
        outcome=error.code,
        job=labels(job_id),
        job_id=job_id,
        key_before=before,
        detail=str(error),
    )


def scope_scene(demo: Demo, scope: str) -> tuple[list[Row], str | None]:
    """One job and three duplicates: while it waits, while it runs, after it finished."""
    task, labels, rows = demo.tasks[scope], Labels(), []

    def send(step: str) -> AsyncResult[Any]:
        before = describe(demo.held(task, "tenant:7"), labels)
        result = task.delay(7)
        rows.append(dispatched(step, result, labels, before))
        return result

    with demo.worker_busy():
        first = send("first dispatch (worker busy)")
        demo.stage.hold(first.id)  # it cannot start before the worker is free
        send("J1 waits in the queue")
    demo.stage.wait_started(first.id, demo.store)
    send("J1 is running")
    demo.stage.let_go(first.id)
    demo.stage.wait_finished(labels.ids, demo.store)
    send("J1 has finished")
    demo.stage.wait_finished(labels.ids, demo.store)

    freed = {"J1 is running": "when J1 started", "J1 has finished": "when J1 finished"}
    moment = next((row.step for row in rows[1:] if row.key_before == "free"), None)
    return rows, freed.get(moment) if moment else None


def payload_scene(demo: Demo, report: Report) -> None:
    """A key derived from two paths of the payload; other arguments do not count."""
    task, labels = demo.tasks["payload"], Labels()
    spec = Payload(only=[".user_id", ".template"])
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("send_digest(42, 'weekly', '09:00')", (42, "weekly", "09:00"), {}),
        (
            "send_digest(42, template='weekly', requested_at='09:05')",
            (42,),
            {"template": "weekly", "requested_at": "09:05"},
        ),
        ("send_digest(42, 'monthly', '09:05')", (42, "monthly", "09:05"), {}),
    ]
    with demo.worker_busy():
        for step, args, kwargs in calls:
            # The same computation the dispatch does, by hand: the payload is the
            # arguments by parameter name.
            names = ("user_id", "template", "requested_at")
            payload = dict(zip(names, args, strict=False), **kwargs)
            digest = spec.key(payload)
            before = describe(demo.held(task, digest), labels)
            result = task.apply_async(args, kwargs)
            row = dispatched(step, result, labels, before)
            held = demo.held(task, digest)
            report.payload.append(replace(row, detail=f"{task.name}:{digest}"))
            report.payload_keys_held.append(held is not None and held.job_id == result.id)
    demo.stage.wait_finished(labels.ids, demo.store)


def window_scene(demo: Demo, report: Report) -> None:
    """An idempotency window: replays reuse the job long after it finished."""
    task, labels = demo.tasks["window"], Labels()

    def send(step: str, amount: int, request_id: str = "R1", **options: Any) -> None:
        before = describe(demo.held(task, request_id, window=True), labels)
        try:
            result = task.apply_async(("A-1", amount), {"request_id": request_id}, **options)
        except UniquenessError as error:
            report.window.append(refused(step, error, labels, before))
            return
        row = dispatched(step, result, labels, before)
        report.window.append(row)
        if row.outcome == "CREATED":
            demo.stage.wait_finished([result.id], demo.store)

    send("place_order('A-1', 30, request_id='R1')", 30)
    send("the same, after J1 finished", 30)
    send("R1 again, but amount=45", 45)
    send("the same as 1, time_limit=30", 30, time_limit=30, soft_time_limit=20)
    send("a new request_id='R2'", 30, request_id="R2")


def invalid_scene(demo: Demo, report: Report) -> None:
    """Keys that break the key rules: refused before the store or the broker is touched."""
    export, notify = demo.tasks["export"], demo.tasks["notify"]
    attempts: list[tuple[str, Callable[[], object]]] = [
        ("unique_key=''", lambda: export.apply_async((7,), unique_key="")),
        ("unique_key='x' * 513", lambda: export.apply_async((7,), unique_key="x" * 513)),
        ("unique_key='tenant\\t7'", lambda: export.apply_async((7,), unique_key="tenant\t7")),
        ("unique_key='\\ud800'", lambda: export.apply_async((7,), unique_key="\ud800")),
        ("unique_key=7", lambda: export.apply_async((7,), unique_key=7)),
        ("selector -> 'user:ann\\nbob'", lambda: notify.delay("ann\nbob")),
    ]
    for given, attempt in attempts:
        keys, messages = demo.store_keys(), len(demo.published)
        try:
            attempt()
        except UniquenessError as error:
            code, message = error.code, str(error)
        else:
            code, message = "accepted", "the dispatch was accepted"
        report.invalid.append(
            Refusal(
                given=given,
                code=code,
                message=message,
                keys_written=demo.store_keys() - keys,
                messages_published=len(demo.published) - messages,
            )
        )


# -- checking and printing ---------------------------------------------------------------


def check(report: Report) -> None:
    """Compare every outcome with the documented behaviour; record what differs."""
    scenes = {**report.scopes, "payload": report.payload, "window": report.window}
    for scene, rows in scenes.items():
        got = [row.summary for row in rows]
        if got != EXPECTED[scene]:
            report.surprises.append(f"{scene}: got {got}, documented {EXPECTED[scene]}")
    drift = [row.policy_drift for row in report.window]
    if drift != [False, False, False, True, False]:
        report.surprises.append(f"window: policy_drift was {drift}; documented only on step 4")
    if not all(report.payload_keys_held):
        report.surprises.append(
            f"payload: the store held the key computed with Payload.key: {report.payload_keys_held}"
        )
    for refusal in report.invalid:
        if (refusal.code, refusal.keys_written, refusal.messages_published) != (
            "invalid_key",
            0,
            0,
        ):
            report.surprises.append(f"invalid key {refusal.given}: {refusal}")


def table(out: TextIO, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    for line in (header, *rows):
        cells = [cell.ljust(width) for cell, width in zip(line, widths, strict=True)]
        print("    " + "  ".join(cells).rstrip(), file=out)


def dispatch_table(
    out: TextIO, rows: Sequence[Row], column: str, cell: Callable[[Row], str], *, drift: bool
) -> None:
    """The dispatches of one scene, then which job id each label stands for."""
    header = ["#", "dispatch", column, "result", "job", "match"]
    lines = [
        [str(n), row.step, cell(row), row.outcome, row.job or "-", row.match or "-"]
        for n, row in enumerate(rows, 1)
    ]
    if drift:
        header.append("policy_drift")
        for line, row in zip(lines, rows, strict=True):
            line.append("yes" if row.policy_drift else "-")
    table(out, header, lines)
    jobs = dict.fromkeys((row.job, row.job_id) for row in rows if row.job and row.job_id)
    for label, job_id in jobs:
        print(f"    {label} = {job_id}", file=out)


def _store_before(row: Row) -> str:
    return row.key_before


def _short_key(row: Row) -> str:
    name, _, digest = row.detail.rpartition(":")
    return f"{name}:{digest[:12]}..."


_SCOPE_TEXT = {
    "queued": "held from dispatch until a worker starts the job",
    "active": "held from dispatch until the job finishes",
    "exists": "held until the job finishes, then unique_retention "
    f"({int(RETENTION.total_seconds())} s) more",
}


def render(report: Report, store_url: str, out: TextIO) -> None:
    def say(*lines: str) -> None:
        for line in lines:
            print(line, file=out)

    say(
        "celery-unique demo",
        f"  store:  {store_url} (SQLite, a temporary file)",
        "  broker: memory:// (in this process); worker: one thread, solo pool",
        "",
        "1. Active keys: while the key is held, a duplicate returns the job holding it",
        "   @app.task(base=UniqueTask, unique_key=lambda job: f'tenant:{job.tenant_id}',",
        "             unique_while=SCOPE)   -- every dispatch is recalculate.delay(7)",
    )
    for scope, rows in report.scopes.items():
        say("", f"  unique_while={scope!r}: {_SCOPE_TEXT[scope]}")
        dispatch_table(out, rows, "store before it", _store_before, drift=False)
        freed = report.freed[scope]
        say(
            f"    -> J1's key was freed {freed}"
            if freed
            else "    -> J1's key outlived J1: it is kept for unique_retention after J1 finished"
        )
    say(
        "",
        "2. A key derived from the payload: unique_key=Payload(only=['.user_id', '.template'])",
        "   requested_at is outside those paths: changing it does not make a new job",
    )
    dispatch_table(out, report.payload, "key", _short_key, drift=False)
    held = "holds" if all(report.payload_keys_held) else "does NOT hold"
    say(f"    the store {held} each key as Payload(...).key(payload) computes it by hand")
    say(
        "",
        "3. A window key: unique_window_key=lambda job: job.request_id,"
        " unique_window=timedelta(hours=24)",
    )
    dispatch_table(out, report.window, "store before it", _store_before, drift=True)
    say(
        *(
            f"    {row.outcome}: conflicting_job_id = {row.job_id} ({row.job})"
            for row in report.window
            if row.detail
        )
    )
    say("", "4. Invalid keys: refused before the store or the broker is touched")
    table(
        out,
        ["dispatch", "error code", "keys written", "messages published"],
        [[r.given, r.code, str(r.keys_written), str(r.messages_published)] for r in report.invalid],
    )
    if report.warnings:
        say("", "Log lines of celery_unique at WARNING (one per conflict):")
        say(*(f"    {line}" for line in report.warnings))
    if report.surprises:
        say("", "NOT AS DOCUMENTED:", *(f"    {line}" for line in report.surprises))
    else:
        say("", "Every outcome above is the documented one.")
    say(f"Done in {report.seconds:.1f} s.")


# -- running it --------------------------------------------------------------------------


class _Collect(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


@contextmanager
def collected_warnings(lines: list[str]) -> Iterator[None]:
    """Gather celery_unique's warnings for the report instead of mixing them into the tables."""
    logger = logging.getLogger("celery_unique")
    handler, propagate = _Collect(lines), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


@contextmanager
def counting_publishes(demo: Demo) -> Iterator[None]:
    def record(headers: dict[str, Any] | None = None, **_: Any) -> None:
        demo.published.append(str((headers or {}).get("id")))

    uid = f"celery_unique.demo.publish.{id(demo)}"
    signals.before_task_publish.connect(record, weak=False, dispatch_uid=uid)
    try:
        yield
    finally:
        signals.before_task_publish.disconnect(dispatch_uid=uid)


@contextmanager
def current_app_kept() -> Iterator[None]:
    """Undo the embedded worker making the demo's app this process's current and default app."""
    # current_app is a proxy; the stubs type it as the app itself.
    previous: Celery = current_app._get_current_object()  # type: ignore[attr-defined]
    try:
        yield
    finally:
        previous.set_current()
        previous.set_default()


@contextmanager
def logging_left_alone() -> Iterator[None]:
    """Keep the embedded worker from configuring the root logger of this process."""

    def leave(**_: Any) -> None:
        return None

    uid = "celery_unique.demo.logging"
    signals.setup_logging.connect(leave, weak=False, dispatch_uid=uid)
    try:
        yield
    finally:
        signals.setup_logging.disconnect(dispatch_uid=uid)


def run(store_url: str) -> Report:
    """Run every scene against ``store_url``; return what happened."""
    started = time.monotonic()
    report, stage = Report(), Stage()
    demo = build_app(store_url, stage)
    try:
        with (
            collected_warnings(report.warnings),
            counting_publishes(demo),
            stage.watching(),
            logging_left_alone(),
            current_app_kept(),
            start_worker(demo.app, pool="solo", perform_ping_check=False, loglevel="WARNING"),
        ):
            for scope in SCOPES:
                report.scopes[scope], report.freed[scope] = scope_scene(demo, scope)
            payload_scene(demo, report)
            window_scene(demo, report)
            invalid_scene(demo, report)
    finally:
        config.reset(demo.app)  # closes the store
    report.seconds = time.monotonic() - started
    check(report)
    return report


def main(out: TextIO | None = None) -> Report:
    """Run the tour on a fresh SQLite file, print it, and return the report."""
    out = out or sys.stdout
    workdir = Path(tempfile.mkdtemp(prefix="celery-unique-demo-"))
    store_url = f"sqlite:///{workdir / 'unique.db'}"
    try:
        report = run(store_url)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    render(report, store_url, out)
    return report


if __name__ == "__main__":
    sys.exit(0 if main().ok else 1)
