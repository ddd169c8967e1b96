"""Operations on held keys (list, show, release, reap, stats), signals and metrics, unit level."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, states
from celery.events.event import get_exchange
from kombu import Queue

from celery_unique import (
    DuplicateMatch,
    ImproperlyConfigured,
    UniqueTask,
    operations,
)
from celery_unique import config as unique_config
from celery_unique import signals as unique_signals
from celery_unique.config import runtime
from celery_unique.dispatch.planning import Plan
from celery_unique.keys import keyspace
from celery_unique.stores.base import (
    ActiveClaim,
    Claim,
    Decision,
    KeyKind,
    Scope,
    Verdict,
    WindowClaim,
)

pytestmark = pytest.mark.filterwarnings("ignore::celery_unique.exceptions.CallbacksNotAttached")


def claim(app: Celery, job_id: str, key: str, scope: Scope = Scope.ACTIVE, task: str = "t") -> str:
    """Hold ``task:key`` for ``job_id`` through the store contract; return its storage key."""
    stored = keyspace.storage_key(runtime(app).namespace, keyspace.ACTIVE, task, key)
    runtime(app).store.decide(
        [Claim(job_id=job_id, task=task, active=ActiveClaim(stored, scope, None))]
    )
    return stored


def remember(app: Celery, job_id: str, key: str, task: str = "t", scope: str = "t") -> str:
    """Remember window key ``scope:key`` -> ``job_id``; return its storage key."""
    stored = keyspace.storage_key(runtime(app).namespace, keyspace.WINDOW, scope, key)
    window = WindowClaim(stored, 60_000, "f" * 32, "p" * 16)
    runtime(app).store.decide([Claim(job_id=job_id, task=task, window=window)])
    return stored


@pytest.fixture
def released() -> Iterator[list[dict[str, Any]]]:
    """Every key_released signal sent during the test."""
    seen: list[dict[str, Any]] = []

    def receive(sender: Any = None, **kwargs: Any) -> None:
        seen.append({"sender": sender, **kwargs})

    unique_signals.key_released.connect(receive, weak=False, dispatch_uid="test.released")
    yield seen
    unique_signals.key_released.disconnect(receive, dispatch_uid="test.released")


@pytest.fixture
def backend_app(app: Celery) -> Celery:
    """The unit app with an in-process result backend, for reaping."""
    app.conf["result_backend"] = "cache+memory://"
    return app


def test_list_shows_display_key_kind_scope_and_job(app: Celery) -> None:
    """A held key is listed with its display key, storage key, kind, scope, job and task."""
    stored = claim(app, "job-1", "tenant:7", task="reports.recalc")
    (info,) = operations.list_keys(app)
    assert (info.display_key, info.storage_key, info.kind, info.scope) == (
        "reports.recalc:tenant:7",
        stored,
        KeyKind.ACTIVE,
        Scope.ACTIVE,
    )
    assert (info.job_id, info.task, info.key_scope, info.finished, info.state) == (
        "job-1",
        "reports.recalc",
        "reports.recalc",
        False,
        "held",
    )
    assert info.expires_in_ms is None


def test_list_filters_by_kind_task_and_pattern(app: Celery) -> None:
    """kind, task and a glob on the display key each narrow the listing."""
    claim(app, "a1", "tenant:1", task="reports.a")
    claim(app, "b1", "tenant:2", task="reports.b")
    remember(app, "w1", "request-9", task="payments.charge", scope="payments.charge")

    def keys(**filters: Any) -> list[str]:
        return [info.display_key for info in operations.list_keys(app, **filters)]

    assert keys(kind="window") == ["payments.charge:request-9"]
    assert keys(kind=KeyKind.ACTIVE) == ["reports.a:tenant:1", "reports.b:tenant:2"]
    assert keys(task="reports.b") == ["reports.b:tenant:2"]
    assert keys(match="reports.*:tenant:[12]") == ["reports.a:tenant:1", "reports.b:tenant:2"]
    assert keys(match="*request*") == ["payments.charge:request-9"]


def test_list_pages_through_keys_in_storage_key_order(app: Celery) -> None:
    """offset/limit pages partition the full ordered listing, whatever the page size."""
    for number in range(7):
        claim(app, f"job-{number}", f"k{number}")
    everything = [info.storage_key for info in operations.list_keys(app)]
    assert everything == sorted(everything)
    assert len(everything) == 7
    pages = [
        [info.storage_key for info in operations.list_keys(app, limit=3, offset=offset)]
        for offset in (0, 3, 6)
    ]
    assert pages == [everything[0:3], everything[3:6], everything[6:]]
    assert operations.list_keys(app, limit=0) == []
    with pytest.raises(ValueError):
        operations.list_keys(app, offset=-1)


def test_list_keeps_to_the_apps_namespace(tmp_path: Path) -> None:
    """Two apps sharing one store each see only their own namespace's keys."""
    apps = []
    for name in ("alpha", "beta"):
        other = Celery(name, broker="memory://", set_as_current=False)
        other.conf.unique_backend = f"sqlite:///{tmp_path / 'keys.db'}"
        apps.append(other)
    try:
        claim(apps[0], "a", "shared")
        claim(apps[1], "b", "shared")
        assert [info.job_id for info in operations.list_keys(apps[0])] == ["a"]
        assert [info.job_id for info in operations.list_keys(apps[1])] == ["b"]
        assert operations.stats(apps[0])["keys"] == 1
    finally:
        for each in apps:
            unique_config.reset(each)


def test_show_accepts_display_bare_and_storage_spellings(app: Celery) -> None:
    """A key is found by its display key, by its storage key and by the escaped storage key."""
    stored = claim(app, "job-1", "tenant:7", task="reports.recalc")
    unscoped = claim(app, "job-2", "tenant:7", task="")
    printable = stored.replace("\x1f", "\\x1f")
    assert [i.job_id for i in operations.show(app, "reports.recalc:tenant:7")] == ["job-1"]
    assert [i.job_id for i in operations.show(app, stored)] == ["job-1"]
    assert [i.job_id for i in operations.show(app, printable)] == ["job-1"]
    assert [i.storage_key for i in operations.show(app, "tenant:7")] == [unscoped]
    assert operations.show(app, "nothing:here") == []
    elsewhere = keyspace.storage_key("another-namespace", keyspace.ACTIVE, "reports.recalc", "x")
    assert operations.candidate_storage_keys(runtime(app).namespace, elsewhere) == []


def test_spread_keys_are_listed_shown_and_released_like_the_others(app: Celery) -> None:
    """Keys spread by key or by task (unique_key_spread="key") are found by their display
    key and by their storage key, listed with the namespace's other keys, and released."""
    namespace = runtime(app).namespace
    by_key = keyspace.storage_key(
        namespace, keyspace.ACTIVE, "r.a", "k", tag=keyspace.key_tag("r.a", "k")
    )
    by_task = keyspace.storage_key(
        namespace, keyspace.ACTIVE, "r.b", "k", tag=keyspace.task_tag("r.b")
    )
    tagged = claim(app, "job-3", "k", task="r.c")
    for job_id, stored in (("job-1", by_key), ("job-2", by_task)):
        runtime(app).store.decide(
            [Claim(job_id=job_id, task="t", active=ActiveClaim(stored, Scope.ACTIVE, None))]
        )
    assert [i.job_id for i in operations.show(app, "r.a:k")] == ["job-1"]
    assert [i.job_id for i in operations.show(app, "r.b:k")] == ["job-2"]
    assert [i.job_id for i in operations.show(app, by_key)] == ["job-1"]
    assert {i.storage_key for i in operations.list_keys(app)} == {by_key, by_task, tagged}
    assert {i.storage_key for i in operations.list_keys(app, kind="active")} == {
        by_key,
        by_task,
        tagged,
    }
    assert operations.list_keys(app, kind="window") == []
    assert [i.display_key for i in operations.list_keys(app, match="r.a:*")] == ["r.a:k"]
    assert operations.release(app, "r.b:k")
    assert operations.show(app, "r.b:k") == []


def test_show_tries_every_split_of_task_names_with_colons(app: Celery) -> None:
    """A task name containing ':' is found: every ':' is tried as the task/key boundary."""
    claim(app, "job-1", "c:d", task="a:b")
    (info,) = operations.show(app, "a:b:c:d")
    assert (info.key_scope, info.display_key, info.job_id) == ("a:b", "a:b:c:d", "job-1")


def test_show_returns_both_kinds_unless_narrowed(app: Celery) -> None:
    """An active and a window key with the same display key are both shown; kind picks one."""
    claim(app, "job-a", "r1")
    remember(app, "job-w", "r1")
    assert {info.kind for info in operations.show(app, "t:r1")} == set(KeyKind)
    assert [info.job_id for info in operations.show(app, "t:r1", kind="window")] == ["job-w"]


def test_release_frees_the_key_for_the_next_dispatch(app: Celery, released: list[Any]) -> None:
    """After an operator's release the next dispatch with the key creates a new job."""

    @app.task(shared=False, base=UniqueTask, name="ops.recalc", unique_key="stats")
    def recalc() -> None:
        return None

    first = recalc.delay()
    assert operations.release(app, "ops.recalc:stats") is True
    assert operations.show(app, "ops.recalc:stats") == []
    second = recalc.delay()
    assert second.id != first.id
    assert second.duplicate is False  # type: ignore[attr-defined]
    assert released == [
        {
            "sender": app,
            "signal": unique_signals.key_released,
            "task_name": "ops.recalc",
            "job_id": first.id,
            "key": "ops.recalc:stats",
            "storage_key": keyspace.storage_key(
                runtime(app).namespace, keyspace.ACTIVE, "ops.recalc", "stats"
            ),
            "reason": unique_signals.ReleaseReason.OPERATOR,
            "kept": False,
        }
    ]


def test_release_with_job_id_is_compare_and_delete(app: Celery, released: list[Any]) -> None:
    """With a job id, a key held by another job is left alone."""
    claim(app, "job-1", "k")
    assert operations.release(app, "t:k", job_id="job-2") is False
    assert [info.job_id for info in operations.show(app, "t:k")] == ["job-1"]
    assert operations.release(app, "t:k", job_id="job-1") is True
    assert operations.show(app, "t:k") == []
    assert operations.release(app, "t:k") is False
    assert [event["job_id"] for event in released] == ["job-1"]


def test_release_refuses_an_ambiguous_key(app: Celery) -> None:
    """A key naming several held keys raises AmbiguousKey and releases nothing."""
    claim(app, "job-a", "r1")
    remember(app, "job-w", "r1")
    with pytest.raises(operations.AmbiguousKey) as raised:
        operations.release(app, "t:r1")
    assert len(raised.value.matches) == 2
    assert len(operations.show(app, "t:r1")) == 2
    assert operations.release(app, "t:r1", kind="window") is True
    assert [info.kind for info in operations.show(app, "t:r1")] == [KeyKind.ACTIVE]


@pytest.mark.parametrize("state", sorted(states.READY_STATES))
def test_reap_finds_keys_of_jobs_in_a_final_state(
    backend_app: Celery, state: str, released: list[Any]
) -> None:
    """A held key whose job is final is an orphan; the dry run reports it, apply releases it."""
    backend_app.backend.store_result("done", None, state)
    claim(backend_app, "done", "k")
    dry = operations.reap(backend_app)
    assert (dry.applied, dry.checked, [o.key.job_id for o in dry.orphans]) == (False, 1, ["done"])
    assert dry.orphans[0].state == state
    assert dry.released == []
    assert len(operations.show(backend_app, "t:k")) == 1
    assert released == []

    applied = operations.reap(backend_app, apply=True)
    assert [orphan.key.job_id for orphan in applied.released] == ["done"]
    assert operations.show(backend_app, "t:k") == []
    assert [(e["job_id"], e["reason"]) for e in released] == [
        ("done", unique_signals.ReleaseReason.REAPED)
    ]


@pytest.mark.parametrize("state", [states.PENDING, states.RECEIVED, states.STARTED, states.RETRY])
def test_reap_never_frees_a_key_whose_job_may_still_run(backend_app: Celery, state: str) -> None:
    """Jobs pending, received, started or retrying keep their keys, even with apply."""
    if state != states.PENDING:
        backend_app.backend.store_result("alive", None, state)
    claim(backend_app, "alive", "k")
    report = operations.reap(backend_app, apply=True)
    assert (report.checked, report.orphans, report.released) == (1, [], [])
    assert report.kept == {state: 1}
    assert [info.job_id for info in operations.show(backend_app, "t:k")] == ["alive"]


def test_reap_keeps_an_exists_key_for_its_retention(backend_app: Celery) -> None:
    """An orphaned 'exists' key is kept, finished, for the task's declared retention."""

    @backend_app.task(
        shared=False,
        base=UniqueTask,
        name="ops.export",
        unique_key="nightly",
        unique_while="exists",
        unique_retention=600,
    )
    def export() -> None:
        return None

    result = export.delay()
    backend_app.backend.store_result(result.id, None, states.SUCCESS)
    report = operations.reap(backend_app, apply=True)
    assert [orphan.keep_ms for orphan in report.released] == [600_000]
    (info,) = operations.show(backend_app, "ops.export:nightly")
    assert (info.job_id, info.finished) == (result.id, True)
    assert info.expires_in_ms is not None
    assert 0 < info.expires_in_ms <= 600_000
    assert export.delay().id == result.id
    assert operations.reap(backend_app, apply=True).checked == 0


def test_reap_falls_back_to_result_expires_for_unknown_tasks(backend_app: Celery) -> None:
    """For an 'exists' key of a task this app does not know, retention is result_expires."""
    backend_app.conf.result_expires = 120
    unique_config.reset(backend_app)
    backend_app.backend.store_result("gone", None, states.FAILURE)
    claim(backend_app, "gone", "k", scope=Scope.EXISTS, task="elsewhere.task")
    (orphan,) = operations.reap(backend_app).orphans
    assert orphan.keep_ms == 120_000


def test_reap_ignores_window_keys_and_finished_keys(backend_app: Celery) -> None:
    """Window keys are forgotten by time only; finished keys are already released."""
    backend_app.backend.store_result("done", None, states.SUCCESS)
    remember(backend_app, "done", "w")
    stored = claim(backend_app, "done", "k", scope=Scope.EXISTS)
    runtime(backend_app).store.release("done", stored, keep_ms=60_000)
    report = operations.reap(backend_app, apply=True)
    assert (report.checked, report.orphans) == (0, [])
    assert len(operations.list_keys(backend_app)) == 2


def test_reap_needs_a_result_backend(app: Celery) -> None:
    """Without a result backend nothing can prove a job ended: reap refuses clearly."""
    with pytest.raises(ImproperlyConfigured, match="result backend"):
        operations.reap(app)


def test_stats_counts_kinds_scopes_tasks_and_finished(app: Celery) -> None:
    """stats counts keys per kind, per scope, per task, and held vs finished."""
    claim(app, "q", "k1", scope=Scope.QUEUED, task="a")
    claim(app, "x", "k2", scope=Scope.EXISTS, task="a")
    runtime(app).store.release("y", claim(app, "y", "k3", Scope.EXISTS, task="b"), keep_ms=60_000)
    remember(app, "w", "r", task="b", scope="b")
    assert operations.stats(app) == {
        "namespace": runtime(app).namespace,
        "keys": 4,
        "kinds": {"active": 3, "window": 1},
        "scopes": {"queued": 1, "active": 0, "exists": 2},
        "held": 2,
        "finished": 1,
        "tasks": {
            "a": {"held": 2, "finished": 0, "window": 0},
            "b": {"held": 0, "finished": 1, "window": 1},
        },
    }


@pytest.mark.parametrize(
    ("ms", "text"),
    [(None, "never"), (0, "0ms"), (999, "999ms"), (61_000, "1m 1s"), (90_061_000, "1d 1h")],
)
def test_format_ms_reads_like_a_duration(ms: int | None, text: str) -> None:
    """Durations print as their two largest units, 'never' for no expiry."""
    assert operations.format_ms(ms) == text


# --- signals -----------------------------------------------------------------------------


def plan_of(job_id: str, active: str | None = "t:a", window: str | None = None) -> Plan:
    return Plan(
        claim=Claim(job_id=job_id, task="t"),
        header={"v": 1},
        active_key=active,
        window_key=window,
    )


@pytest.fixture
def task(app: Celery) -> Any:
    @app.task(shared=False, base=UniqueTask, name="sig.task")
    def sig_task() -> None:
        return None

    return sig_task


def collect(signal: Any) -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def receive(sender: Any = None, signal: Any = None, **kwargs: Any) -> None:
        seen.append({"sender": sender, **kwargs})

    signal.connect(receive, weak=False, dispatch_uid="test.collect")
    yield seen
    signal.disconnect(receive, dispatch_uid="test.collect")


@pytest.fixture
def reused_signals() -> Iterator[list[dict[str, Any]]]:
    yield from collect(unique_signals.job_reused)


@pytest.fixture
def conflicts() -> Iterator[list[dict[str, Any]]]:
    yield from collect(unique_signals.uniqueness_conflict)


@pytest.fixture
def created() -> Iterator[list[dict[str, Any]]]:
    yield from collect(unique_signals.job_created)


def test_emit_reused_sends_the_signal_and_logs_once_at_info(
    task: Any, reused_signals: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A window reuse reports the existing job, the key that matched and drift; one INFO line."""
    decision = Decision(Verdict.REUSED_WINDOW, "existing", policy_drift=True)
    with caplog.at_level(logging.INFO, logger="celery_unique"):
        unique_signals.emit_reused(task, plan_of("asked", window="t:w"), decision)
    assert reused_signals == [
        {
            "sender": task,
            "task_name": "sig.task",
            "job_id": "existing",
            "requested_job_id": "asked",
            "match": DuplicateMatch.WINDOW,
            "key": "t:w",
            "policy_drift": True,
        }
    ]
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "sig.task: reused job existing (window key 't:w') with policy drift")
    ]


@pytest.mark.parametrize(
    ("decision", "reason", "ids"),
    [
        (
            Decision(Verdict.CONFLICT, "w1", conflicting_job_ids=("w1",)),
            "uniqueness_conflict",
            ["w1"],
        ),
        (
            Decision(Verdict.COMPOSITION_CONFLICT, "w1", conflicting_job_ids=("w1", "a1")),
            "uniqueness_composition_conflict",
            ["w1", "a1"],
        ),
    ],
)
def test_emit_conflict_sends_the_signal_and_warns_once(
    task: Any,
    conflicts: list[Any],
    caplog: pytest.LogCaptureFixture,
    decision: Decision,
    reason: str,
    ids: list[str],
) -> None:
    """A conflict reports its error code and the jobs in the way; one WARNING line."""
    with caplog.at_level(logging.INFO, logger="celery_unique"):
        unique_signals.emit_conflict(task, plan_of("asked", window="t:w"), decision)
    assert conflicts == [
        {
            "sender": task,
            "task_name": "sig.task",
            "job_id": "asked",
            "reason": reason,
            "conflicting_job_ids": ids,
            "active_key": "t:a",
            "window_key": "t:w",
        }
    ]
    assert [record.levelno for record in caplog.records] == [logging.WARNING]


def test_emit_created_sends_the_signal_without_logging(
    task: Any, created: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A created job is reported to receivers but writes no log line."""
    with caplog.at_level(logging.DEBUG, logger="celery_unique"):
        unique_signals.emit_created(task, plan_of("new", window="t:w"))
    assert created == [
        {
            "sender": task,
            "task_name": "sig.task",
            "job_id": "new",
            "active_key": "t:a",
            "window_key": "t:w",
            "rerun_of": None,
        }
    ]
    assert caplog.records == []


def test_emit_released_logs_lifecycle_releases_at_debug_only(
    app: Celery, released: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A release by the job's lifecycle logs at DEBUG, an operator's at INFO."""
    stored = keyspace.storage_key("ns", keyspace.ACTIVE, "", "shared")
    with caplog.at_level(logging.DEBUG, logger="celery_unique"):
        unique_signals.emit_released(
            app, "j", stored, reason=unique_signals.ReleaseReason.FINISHED, kept=True
        )
        unique_signals.emit_released(app, "j", stored, reason=unique_signals.ReleaseReason.OPERATOR)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "released key 'shared' of job j (finished, kept for retention)"),
        (logging.INFO, "released key 'shared' of job j (operator)"),
    ]
    assert [(event["task_name"], event["key"], event["kept"]) for event in released] == [
        (None, "shared", True),
        (None, "shared", False),
    ]


def test_events_are_sent_when_the_app_sends_task_events(app: Celery, task: Any) -> None:
    """With task_send_sent_event on, a reuse is also published as a 'unique-reused' event."""
    app.conf.task_send_sent_event = True
    unique_signals.reset_events(app)
    with app.connection_for_write() as connection:
        exchange = get_exchange(connection, name=app.conf.event_exchange)
        queue = Queue("test-unique-events", exchange=exchange, routing_key="unique.#")
        bound = queue(connection.default_channel)
        bound.declare()
        unique_signals.emit_reused(task, plan_of("asked"), Decision(Verdict.REUSED_ACTIVE, "old"))
        message = bound.get(no_ack=True)
        assert message is not None
        event = message.payload
        assert bound.get(no_ack=True) is None
    assert (event["type"], event["uuid"], event["name"], event["match"], event["key"]) == (
        "unique-reused",
        "old",
        "sig.task",
        "active",
        "t:a",
    )


def test_no_events_unless_the_app_sends_task_events(app: Celery, task: Any) -> None:
    """With task events off (the default), emitting publishes nothing."""
    unique_signals.reset_events(app)
    with app.connection_for_write() as connection:
        exchange = get_exchange(connection, name=app.conf.event_exchange)
        queue = Queue("test-unique-no-events", exchange=exchange, routing_key="unique.#")
        bound = queue(connection.default_channel)
        bound.declare()
        unique_signals.emit_reused(task, plan_of("asked"), Decision(Verdict.REUSED_ACTIVE, "old"))
        unique_signals.emit_created(task, plan_of("new"))
        assert bound.get(no_ack=True) is None


# --- metrics -----------------------------------------------------------------------------


def test_metrics_count_every_signal_by_task_and_reason(app: Celery, task: Any) -> None:
    """The Prometheus counters follow the signals, labelled by task, match and reason."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from celery_unique import metrics

    registry = prometheus_client.CollectorRegistry()
    installed = metrics.install(registry=registry)
    try:
        unique_signals.emit_created(task, plan_of("new"))
        unique_signals.emit_reused(task, plan_of("a"), Decision(Verdict.REUSED_ACTIVE, "old"))
        unique_signals.emit_reused(task, plan_of("b"), Decision(Verdict.REUSED_ACTIVE, "old"))
        unique_signals.emit_conflict(
            task, plan_of("c", window="t:w"), Decision(Verdict.CONFLICT, "w1")
        )
        unique_signals.emit_released(
            app, "j", "unique:v1:{n}:a:sig.task\x1fk", reason=unique_signals.ReleaseReason.REAPED
        )
    finally:
        metrics.uninstall(installed)

    def value(name: str, **labels: str) -> float | None:
        sample: float | None = registry.get_sample_value(name, labels)
        return sample

    assert value("celery_unique_jobs_created_total", task="sig.task") == 1
    assert (
        value(
            "celery_unique_jobs_reused_total", task="sig.task", match="active", policy_drift="false"
        )
        == 2
    )
    assert (
        value("celery_unique_conflicts_total", task="sig.task", reason="uniqueness_conflict") == 1
    )
    assert value("celery_unique_keys_released_total", task="sig.task", reason="reaped") == 1
    # Uninstalled: signals no longer reach the counters.
    unique_signals.emit_created(task, plan_of("later"))
    assert value("celery_unique_jobs_created_total", task="sig.task") == 1
