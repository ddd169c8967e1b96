"""The actors of a randomized run: the app (tasks, worker hooks) and the producer processes.

Every actor appends what it does to a history file of its own (one JSON object
per line, written with one ``write`` to a file opened for appending, so a
process killed in the middle loses at most its last line):

* producers: every dispatch, with what it asked for and what it got;
* task bodies (pool children): the start and end of every run;
* workers' main processes: every release of a job's key that reached the
  store, every message dropped unrun, and each moment they owed the store
  nothing any more;
* producers too record that last moment (their undos of lost decisions).

The app module a worker imports is two lines written by the orchestrator: it
reads the run's :class:`Spec` from ``CHAOS_SPEC`` and calls :func:`build`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from billiard.exceptions import TimeLimitExceeded
from celery import Celery, Task, signals
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded

#: Modes a job body plays, and how often a producer picks each.
MODES = {
    "ok": 40,
    "fail": 6,
    "retry": 8,
    "requeue": 6,
    "ignore": 4,
    "reject": 4,
    "soft_limit": 3,
    "hard_limit": 3,
    "replace": 6,
}
SCOPES = ("queued", "active", "exists")
#: The share of active/exists dispatches of chaos.job whose job follows its duplicates
#: (``unique_on_duplicate``), and the share of those that debounce, with these delays.
FOLLOWING = 0.4
DEBOUNCING = 0.1
DEBOUNCE_S = 0.15
DEBOUNCE_MAX_S = 0.4
#: The uniqueness options a producer passes on to a dispatch.
DISPATCH_OPTIONS = (
    "unique_while",
    "unique_key",
    "unique_prefix",
    "unique_on_duplicate",
    "unique_debounce",
    "unique_debounce_max",
)


def following(meta: dict[str, Any]) -> dict[str, Any]:
    """The fields a dispatch item of a job that follows its duplicates records."""
    return {name: meta[name] for name in ("policy", "nonce") if name in meta}


SOFT_LIMIT_S = 0.3
HARD_LIMIT_S = 0.8


@dataclass(frozen=True)
class Spec:
    """Everything an actor needs, as plain values (JSON in the worker's environment)."""

    history: str
    broker_url: str
    store_url: str
    marks_url: str
    namespace: str
    queue: str
    lease_s: float
    retention_s: float
    window_s: float
    keys: int = 8
    window_keys: int = 4
    #: The store's URL scheme is swapped for this one in workers and producers
    #: (a deliberately broken store, to prove the checker catches it).
    store_override: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    #: Workers reach the broker here instead (the broker behind the store's proxy
    #: is then impaired for producers only).
    worker_broker_url: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Spec:
        return cls(**json.loads(text))


class Recorder:
    """Appends events to this process's history file (reopened after a fork)."""

    def __init__(self, directory: str, name: str) -> None:
        self.directory, self.name = Path(directory), name
        self._fd: int | None = None
        self._pid = 0
        self._lock = threading.Lock()
        # A pool child forked while another thread of the worker wrote would
        # inherit the lock held, for good.
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        line = (json.dumps({"e": event, **fields}) + "\n").encode()
        with self._lock:
            if self._fd is None or self._pid != os.getpid():
                self._pid = os.getpid()
                path = self.directory / f"{self.name}-{self._pid}.jsonl"
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(self._fd, line)


def now() -> int:
    return time.monotonic_ns()


_marks: dict[tuple[int, str], Any] = {}


def marks(url: str) -> Any:
    import redis

    slot = (os.getpid(), url)
    if slot not in _marks:
        _marks[slot] = redis.Redis.from_url(url)
    return _marks[slot]


def watch_settling(record: Recorder, proc: str) -> None:
    """Record each moment this process stops owing the store anything (a daemon thread)."""
    from celery_unique.stores import cleanup

    def loop() -> None:
        owed = False
        while True:
            pending = cleanup.pending()
            if owed and not pending:
                record("settled", proc=proc, t=now())
            owed = bool(pending)
            time.sleep(0.01)

    threading.Thread(target=loop, name="chaos-settling", daemon=True).start()


@contextlib.contextmanager
def soft_limit_deferred() -> Iterator[None]:
    """Hold back the soft time limit (billiard's SIGUSR1 in the pool child) while
    the history is written: it strikes right after, never between a record and
    the state it records."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def build(spec: Spec, *, role: str) -> Celery:
    """The app, for a worker (``role="worker"``) or a producer."""
    from celery_unique import UniqueTask
    from celery_unique import signals as unique_signals
    from celery_unique.keys.keyspace import split_storage_key
    from celery_unique.worker.fates import Replaced

    if spec.store_override:
        from celery_unique import stores

        stores.STORES[spec.store_override.split(":", 1)[0]] = spec.store_override.split(":", 1)[1]
    record = Recorder(spec.history, role)
    app = Celery(f"chaos-{spec.namespace}", set_as_current=False)
    app.conf.update(
        broker_url=(spec.worker_broker_url or spec.broker_url)
        if role == "worker"
        else spec.broker_url,
        task_default_queue=spec.queue,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": 6,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 3,
            # RabbitMQ: a publish counts once the broker confirmed it. Without
            # confirms, a message written as the broker stops is lost unseen, and
            # its key held for a job that never runs (the library's docs ask
            # for confirms).
            "confirm_publish": True,
        },
        result_expires=spec.retention_s,
        unique_backend=spec.store_url
        if not spec.store_override
        else spec.store_url.replace("redis://", spec.store_override.split(":", 1)[0] + "://", 1),
        unique_namespace=spec.namespace,
        unique_lease=spec.lease_s,
        worker_hijack_root_logger=False,
        **spec.settings,
    )

    #: This pool child's run of each job whose body began, until Celery reports its end.
    runs_here: dict[str, int] = {}
    #: The run whose task_postrun came last (an internal error may follow it).
    ended_here: dict[str, int] = {}

    #: When each run of this pool child went to the store before its body (task_prerun).
    asked: dict[str, int] = {}

    def body(task: Any, key: str | None, mode: str, hold_ms: int, nonce: str | None = None) -> None:
        """Record the run, play the mode, record how it ended."""
        job = task.request.id
        limits = {"limit_s": HARD_LIMIT_S} if mode in ("soft_limit", "hard_limit") else {}
        follows = {"nonce": nonce, "asked": asked.pop(job, None)} if nonce else {}
        with soft_limit_deferred():
            run = int(marks(spec.marks_url).incr(f"{spec.namespace}:run:{job}"))
            record(
                "start", job=job, run=run, key=key, pid=os.getpid(), t=now(), **limits, **follows
            )
            runs_here[job] = run
        outcome = "ok"
        try:
            time.sleep(hold_ms / 1000)
            if mode == "fail":
                if task.request.retries < 1:
                    raise task.retry(countdown=0.05, max_retries=1)
                raise ValueError("failed for good")
            if mode == "retry" and task.request.retries < 1:
                raise task.retry(countdown=0.05)
            if mode == "requeue" and run == 1:
                raise Reject("requeued", requeue=True)
            if mode == "reject":
                raise Reject("dropped", requeue=False)
            if mode == "ignore":
                raise Ignore()
            if mode in ("soft_limit", "hard_limit") and run == 1:
                try:
                    time.sleep(HARD_LIMIT_S * 3)
                except SoftTimeLimitExceeded:
                    if mode == "soft_limit":
                        raise
                    time.sleep(HARD_LIMIT_S * 3)  # on to the hard limit, which kills it
            if mode == "replace" and run == 1:
                raise task.replace(tail.s(key=key, mode="ok", hold_ms=hold_ms))
        except Retry:
            outcome = "retry"
            raise
        except Replaced:
            outcome = "replace"
            raise
        except Ignore:
            outcome = "ignore"
            raise
        except Reject as rejected:
            outcome = "requeue" if rejected.requeue else "reject"
            raise
        except SoftTimeLimitExceeded:
            outcome = "soft_limit"
            raise
        except BaseException:
            outcome = "fail"
            raise
        finally:
            with soft_limit_deferred():
                record("end", job=job, run=run, outcome=outcome, t=now())
                task.request.chaos_outcome = outcome

    limits = {"soft_time_limit": SOFT_LIMIT_S, "time_limit": HARD_LIMIT_S}
    _FAILED = ("fail", "soft_limit")

    @app.task(
        name="chaos.job",
        bind=True,
        base=UniqueTask,
        unique_key=lambda job: job.key,
        unique_prefix=False,
        unique_overridable=True,
        **limits,
    )
    def job(self: Any, key: str, mode: str = "ok", hold_ms: int = 100, nonce: str = "") -> None:
        body(self, key, mode, hold_ms, nonce)

    @app.task(name="chaos.given", bind=True, base=UniqueTask, **limits)
    def given(self: Any, key: str, mode: str = "ok", hold_ms: int = 100, nonce: str = "") -> None:
        body(self, key, mode, hold_ms)

    @app.task(
        name="chaos.order",
        bind=True,
        base=UniqueTask,
        unique_window_key=lambda job: job.wkey,
        unique_window=spec.window_s,
        **limits,
    )
    def order(self: Any, wkey: str, req: str, mode: str = "ok", hold_ms: int = 100) -> None:
        body(self, None, mode, hold_ms)

    @app.task(name="chaos.tail", bind=True, base=Task)
    def tail(self: Any, key: str | None, mode: str = "ok", hold_ms: int = 100) -> None:
        body(self, key, mode, hold_ms)

    if role == "worker":

        def released(job_id: str = "", storage_key: str = "", reason: Any = None, **_: Any) -> None:
            key = split_storage_key(storage_key)[3]
            record(
                "released",
                job=job_id,
                key=key,
                reason=str(getattr(reason, "value", reason)),
                t=now(),
            )

        def revoked(request: Any = None, **_: Any) -> None:
            if request is not None:
                record("dropped", job=request.id, t=now())

        def received(request: Any = None, **_: Any) -> None:
            if request is not None:
                record("received", job=request.id, t=now())

        def main_started(**_: Any) -> None:
            watch_settling(record, f"worker-{os.getpid()}")

        def failed(task_id: str = "", exception: Any = None, **_: Any) -> None:
            # Sent by the main process when a run's hard time limit fires: the
            # message is acknowledged then (a pool child killed meanwhile is not
            # retried, although the pool may only hear of its death afterwards).
            if isinstance(exception, TimeLimitExceeded):
                record("timed_out", job=task_id, t=now())

        def followed(job_id: str = "", rerun_of: str | None = None, **_: Any) -> None:
            if rerun_of is not None:
                record("followed", job=job_id, of=rerun_of, t=now())

        def prerun(task_id: str = "", **_: Any) -> None:
            asked[task_id] = now()

        unique_signals.job_created.connect(followed, weak=False, dispatch_uid="chaos.followed")
        signals.task_prerun.connect(prerun, weak=False, dispatch_uid="chaos.asked")
        unique_signals.key_released.connect(released, weak=False, dispatch_uid="chaos.released")
        signals.task_revoked.connect(revoked, weak=False, dispatch_uid="chaos.revoked")
        signals.task_received.connect(received, weak=False, dispatch_uid="chaos.received")
        signals.worker_init.connect(main_started, weak=False, dispatch_uid="chaos.settling")
        signals.task_failure.connect(failed, weak=False, dispatch_uid="chaos.timed_out")

        def after_run(task_id: str = "", task: Any = None, state: str = "", **_: Any) -> None:
            # A run that ended before its body started (a store that hung when the
            # pool asked it to mark the key, until the soft time limit).
            if task is None:
                return
            run = runs_here.pop(task_id, None)
            ended_here.clear()
            if run is not None:
                ended_here[task_id] = run
            if run is None:
                record("unrun", job=task_id, state=state, t=now())
            elif state == "FAILURE" and getattr(task.request, "chaos_outcome", None) not in _FAILED:
                # The soft time limit struck after the body's record (or before
                # it, on the way into it): the run failed, for good.
                record("end", job=task_id, run=run, outcome="fail", t=now())

        signals.task_postrun.connect(after_run, weak=False, dispatch_uid="chaos.unrun")

        def internal_error(task_id: str = "", **_: Any) -> None:
            # The soft time limit struck in Celery's own code, after the body
            # (raising Reject, say): the run failed, whatever the body asked for
            # (Celery acknowledges a failure: a requeue asked for is not made).
            # task_postrun may have come first.
            run = runs_here.pop(task_id, None) or ended_here.pop(task_id, None)
            if run is not None:
                record("end", job=task_id, run=run, outcome="fail", t=now())
            else:
                record("unrun", job=task_id, state="FAILURE", t=now())

        signals.task_internal_error.connect(
            internal_error, weak=False, dispatch_uid="chaos.internal_error"
        )
    app.finalize()
    return app


# -- producers ---------------------------------------------------------------------------


def produce(spec: Spec, index: int, seed: int, until: float, done_queue: Any) -> None:
    """One producer process: dispatch at random until ``until`` (a ``time.time()``)."""
    from celery_unique import UniquenessError, dispatch_many, operations
    from celery_unique import config as unique_config
    from celery_unique.stores import cleanup

    proc = f"p{index}"
    # Conflicts and reuses are the point here: keep their log lines out of the way.
    logging.getLogger("celery_unique").setLevel(logging.ERROR)
    record = Recorder(spec.history, f"producer-{index}")
    watch_settling(record, proc)
    app = build(spec, role="producer")
    draw = random.Random(seed * 1009 + index)
    modes, weights = list(MODES), list(MODES.values())
    tasks = app.tasks
    count = 0

    def item_for(
        task: Any, jid: str, key: str | None, scope: str | None, **extra: Any
    ) -> dict[str, Any]:
        return {"jid": jid, "task": task.name, "key": key, "scope": scope, **extra}

    def outcome(item: dict[str, Any], result: Any) -> dict[str, Any]:
        if isinstance(result, UniquenessError):
            return {**item, **error_fields(result)}
        out = result.disposition.value
        match = result.duplicate_match.value if result.duplicate_match else None
        effect = (
            "rerun" if result.rerun_requested else "replaced" if result.arguments_replaced else None
        )
        return {**item, "out": out, "job": result.id, "match": match, "effect": effect}

    def error_fields(error: Exception) -> dict[str, Any]:
        if not isinstance(error, UniquenessError):
            # The broker failed the publish (its keys were rolled back). It may
            # have been delivered all the same (a lost reply): then it runs unkeyed.
            return {"out": "error", "job": None, "code": "publish_failed", "detail": repr(error)}
        code = error.code
        if code in ("uniqueness_conflict",):
            return {"out": "conflict", "job": error.conflicting_job_id, "code": code}  # type: ignore[attr-defined]
        return {
            "out": "error",
            "job": None,
            "code": code,
            "maybe_applied": bool(getattr(error, "maybe_applied", False)),
        }

    def active(task_name: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        key = f"k{draw.randrange(spec.keys)}"
        scope = draw.choice(SCOPES)
        mode = draw.choices(modes, weights)[0]
        args = {
            "key": key,
            "mode": mode,
            "hold_ms": draw.randrange(20, 300),
            "nonce": uuid.uuid4().hex[:6],
        }
        task = tasks[task_name]
        options: dict[str, Any] = {"unique_while": scope}
        if task_name == "chaos.given":
            options.update(unique_key=key, unique_prefix=False)
        follows: dict[str, Any] = {}
        policy = draw.random() if task_name == "chaos.job" and scope != "queued" else 1.0
        if policy < FOLLOWING:
            options.update(unique_on_duplicate="debounce" if policy < DEBOUNCING else "latest")
            if policy < DEBOUNCING:
                options.update(unique_debounce=DEBOUNCE_S, unique_debounce_max=DEBOUNCE_MAX_S)
            follows = {"policy": options["unique_on_duplicate"], "nonce": args["nonce"]}
        return task, args, {"key": key, "scope": scope, **options, **follows}

    def operator_release(key: str) -> None:
        """Release ``key`` as an operator does (``celery unique release``): its job goes on,
        beside the next one; a key whose job owes its duplicates something is kept."""
        t0 = now()
        try:
            info = operations.resolve(app, key, kind="active")
        except UniquenessError:  # the store is down: no release this time
            return
        if info is None:
            return
        released: bool | None
        try:
            released, spared = (
                operations.release(app, info.storage_key, job_id=info.job_id),
                False,
            )
        except operations.OwedToDuplicates:
            released, spared = False, True
        except UniquenessError:
            # No answer: the release may have been made all the same (its reply lost),
            # and the job then goes on beside the next one.
            released, spared = None, False
        record(
            "operator_release",
            proc=proc,
            key=key,
            job=info.job_id,
            t0=t0,
            t1=now(),
            released=released,
            spared=spared,
        )

    def window() -> tuple[Any, dict[str, Any], dict[str, Any]]:
        wkey = f"w{draw.randrange(spec.window_keys)}"
        req = draw.choice("AB")
        # The same request is the same arguments: derived from (window key, request).
        rng = random.Random(f"{wkey}{req}")
        args = {
            "wkey": wkey,
            "req": req,
            "mode": rng.choice(["ok", "ok", "retry", "fail"]),
            "hold_ms": rng.randrange(20, 200),
        }
        return (
            tasks["chaos.order"],
            args,
            {"wkey": wkey, "req": req, "window_ms": int(spec.window_s * 1000)},
        )

    try:
        while time.time() < until:
            roll = draw.random()
            t0 = now()
            if roll < 0.12:
                parts = [
                    active(draw.choice(["chaos.job", "chaos.given"]))
                    for _ in range(draw.randrange(2, 6))
                ]
                # In-batch duplicates: some items repeat an earlier item's key.
                signatures, items = [], []
                for task, args, meta in parts:
                    jid = uuid.uuid4().hex
                    options = {k: v for k, v in meta.items() if k in DISPATCH_OPTIONS}
                    signatures.append(task.s(**args).set(task_id=jid, **options))
                    items.append(item_for(task, jid, meta["key"], meta["scope"], **following(meta)))
                keep_going = draw.random() < 0.5
                try:
                    results = dispatch_many(signatures, continue_on_conflict=keep_going)
                    done = [
                        outcome(item, result) for item, result in zip(items, results, strict=True)
                    ]
                except Exception as error:
                    done = [{**item, **error_fields(error)} for item in items]
                record("dispatch", proc=proc, t0=t0, t1=now(), batch=True, items=done)
            elif roll < 0.30:
                task, args, meta = window()
                jid = uuid.uuid4().hex
                item = item_for(task, jid, None, None, **meta)
                try:
                    done = outcome(item, task.apply_async(kwargs=args, task_id=jid))
                except Exception as error:
                    done = {**item, **error_fields(error)}
                record("dispatch", proc=proc, t0=t0, t1=now(), batch=False, items=[done])
            elif roll < 0.31:
                # Revoke a job, waiting or running.
                jobs = marks(spec.marks_url).lrange(f"{spec.namespace}:created", -20, -1)
                if jobs:
                    victim = draw.choice(jobs).decode()
                    try:
                        app.control.revoke(victim, terminate=draw.random() < 0.5)
                    except Exception:  # the broker is down: no revoke this time
                        continue
                    record("revoke", proc=proc, job=victim, t=t0)
            elif roll < 0.315:
                operator_release(f"k{draw.randrange(spec.keys)}")
            else:
                task, args, meta = active(draw.choice(["chaos.job", "chaos.job", "chaos.given"]))
                jid = uuid.uuid4().hex
                options = {k: v for k, v in meta.items() if k in DISPATCH_OPTIONS}
                item = item_for(task, jid, meta["key"], meta["scope"], **following(meta))
                try:
                    done = outcome(item, task.apply_async(kwargs=args, task_id=jid, **options))
                except Exception as error:
                    done = {**item, **error_fields(error)}
                record("dispatch", proc=proc, t0=t0, t1=now(), batch=False, items=[done])
                if done["out"] == "created":
                    marks(spec.marks_url).rpush(f"{spec.namespace}:created", done["job"])
            count += 1
            time.sleep(draw.uniform(0, 0.03))
        cleanup.flush(30)
        record("settled", proc=proc, t=now())
    finally:
        done_queue.put((index, count))
        unique_config.reset(app)
        app.close()
