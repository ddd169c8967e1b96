"""The small rules of the dispatch path (dispatch/apply.py), each on its own.

What a dispatch sends (pydantic models dumped unless pickled), which dispatch
is a replacement by another task, what a replacement's header carries, a
retry's lease, and the store's one decision. Fakes stand for the task, the
runtime and the store: each rule reads only what they give.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, group
from celery._state import _task_stack

from celery_unique import DuplicateMatch, UniqueTask
from celery_unique.config import runtime
from celery_unique.dispatch import apply, resend
from celery_unique.dispatch.headers import HEADER
from celery_unique.exceptions import (
    BackendUnavailable,
    CallbacksNotAttached,
    CompositionConflict,
    GroupMemberReused,
    UniquenessConflict,
)
from celery_unique.signals import uniqueness_conflict
from celery_unique.stores.base import Claim, Decision, Effect, Hold, Release, Verdict
from tests.unit.fakes import CREATED, AnsweringStore, FakeRuntime

# What Celery sends


def dumping_task() -> Any:
    return SimpleNamespace(_dump_pydantic_arguments=lambda args, kwargs: (["dumped"], {"k": 1}))


@pytest.mark.parametrize("serializer", [None, "json", "yaml", "msgpack"])
def test_pydantic_arguments_are_worked_out_as_dumped(serializer: str | None) -> None:
    options = {} if serializer is None else {"serializer": serializer}
    assert apply.as_sent(dumping_task(), [1], {}, options) == (["dumped"], {"k": 1})


def test_pickled_arguments_and_plain_tasks_are_sent_as_given() -> None:
    assert apply.as_sent(dumping_task(), [1], {"a": 2}, {"serializer": "pickle"}) == (
        [1],
        {"a": 2},
    )
    assert apply.as_sent(SimpleNamespace(), [1], {}, {}) == ([1], {})


# replace() by another task


def task_in(name: str, running: str | None, job_id: str = "job-1", eager: bool = False) -> Any:
    """Task ``name`` dispatched inside the run of ``running`` (job ``job_id``), if any."""
    current = (
        None
        if running is None
        else SimpleNamespace(name=running, request=SimpleNamespace(id=job_id, is_eager=eager))
    )
    return SimpleNamespace(name=name, app=SimpleNamespace(current_worker_task=current))


def test_a_replacement_is_another_task_sent_under_the_running_job_id() -> None:
    assert apply._replaces_another_task(task_in("task-b", "task-a"), "job-1")
    assert apply._replaces_another_task(task_in("task-a", "task-b"), "job-1")
    # Ids and names compare by value (a message's id is not the caller's object).
    assert apply._replaces_another_task(task_in("task-b", "task-a"), "".join(["job-", "1"]))


@pytest.mark.parametrize(
    ("task", "task_id"),
    [
        (task_in("task-b", None), "job-1"),  # not inside a run
        (task_in("task-b", "task-a"), "job-0"),  # another id, sorting before
        (task_in("task-b", "task-a"), "job-2"),  # another id, sorting after
        (task_in("task-a", "task-a"), "job-1"),  # the same task: a retry, not a replacement
        (task_in("task-b", "task-b"), "job-1"),  # the same name sorting after another's
        (task_in("".join(["task-", "a"]), "task-a"), "job-1"),  # names compare by value
        (task_in("task-b", "task-a", eager=True), "job-1"),  # an eager run replaces nothing
    ],
)
def test_anything_else_is_not_a_replacement(task: Any, task_id: str) -> None:
    assert not apply._replaces_another_task(task, task_id)


def test_a_replacement_by_a_keyed_task_carries_its_own_active_key_beside_the_jobs() -> None:
    carried = {"v": 1, "a": "ns:a:job", "w": "ns:w:job"}
    own = {"v": 1, "p": "x", "a": "ns:a:other", "s": "active", "r": 60, "t": "task-b", "g": "1"}
    header = apply._carrying_own(carried, SimpleNamespace(header=own))  # type: ignore[arg-type]
    assert header == {**carried, "x": {"v": 1, "a": "ns:a:other", "s": "active", "r": 60}}
    assert "x" not in carried  # the job's own header is left as it was


def test_a_replacement_without_an_active_key_carries_the_jobs_keys_only() -> None:
    carried = {"v": 1, "a": "ns:a:job"}
    header = apply._carrying_own(carried, SimpleNamespace(header={"v": 1, "w": "ns:w:x"}))  # type: ignore[arg-type]
    assert header == carried
    assert header is not carried


# A retry's lease


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    fake = FakeRuntime()
    monkeypatch.setattr(apply, "runtime", lambda app: fake)
    return fake


def test_a_retry_extends_its_keys_lease_by_its_countdown(rt: FakeRuntime) -> None:
    apply._extend_lease(None, "job-1", {"a": "ns:a:k"}, {"countdown": 10})  # type: ignore[arg-type]
    assert rt.store.renewed == [([Hold("job-1", "ns:a:k")], 70_000)]


def test_nothing_to_extend_without_an_active_key_or_a_lease(rt: FakeRuntime) -> None:
    apply._extend_lease(None, "job-1", {"w": "ns:w:k"}, {"countdown": 10})  # type: ignore[arg-type]
    rt.lease_ms = None
    apply._extend_lease(None, "job-1", {"a": "ns:a:k"}, {"countdown": 10})  # type: ignore[arg-type]
    assert rt.store.renewed == []


def test_a_lease_that_cannot_be_extended_is_logged_not_raised(
    rt: FakeRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    rt.store.error = BackendUnavailable("down")
    with caplog.at_level(logging.WARNING, logger="celery_unique"):
        apply._extend_lease(None, "job-1", {"a": "ns:a:k"}, {})  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records] == [
        "could not extend the lease of 'ns:a:k' for a retry"
    ]
    assert caplog.records[0].exc_info, "the store's error is logged with it"


# The store's one decision


def test_a_dispatch_takes_its_own_decision_of_the_stores_list() -> None:
    other = Decision(Verdict.REUSED_ACTIVE, "other")
    fake = FakeRuntime(AnsweringStore(answers=[CREATED, other]))
    assert apply.decide_one(fake, Claim("job", "task")) is CREATED  # type: ignore[arg-type]


def test_an_outage_fails_a_dispatch_unless_fail_open() -> None:
    closed = FakeRuntime(AnsweringStore(error=BackendUnavailable("down")))
    with pytest.raises(BackendUnavailable):
        apply.decide_one(closed, Claim("job", "task"))  # type: ignore[arg-type]
    assert closed.outage is False
    opened = FakeRuntime(AnsweringStore(error=BackendUnavailable("down")), fail_open=True)
    assert apply.decide_one(opened, Claim("job", "task")) is None  # type: ignore[arg-type]
    assert opened.outage is True
    opened.store.error = None
    assert apply.decide_one(opened, Claim("job", "task")) is CREATED  # type: ignore[arg-type]
    assert opened.outage is False


# What a job's scope releases, and when


def test_a_queued_key_goes_as_its_job_starts_or_ends() -> None:
    header = {"a": "ns:a:k", "s": "queued", "g": "gen1"}
    for finished in (False, True):
        assert apply.release_at("job", header, finished=finished) == Release(  # type: ignore[arg-type]
            "job", "ns:a:k", 0, generation="gen1"
        )


def test_an_active_key_goes_as_its_job_ends() -> None:
    header = {"a": "ns:a:k", "s": "active", "g": "gen1"}
    assert apply.release_at("job", header, finished=False) is None  # type: ignore[arg-type]
    assert apply.release_at("job", header, finished=True) == Release(  # type: ignore[arg-type]
        "job", "ns:a:k", 0, generation="gen1"
    )


def test_an_exists_key_is_kept_for_its_retention_as_its_job_ends() -> None:
    header = {"a": "ns:a:k", "s": "exists", "r": 60_000}
    assert apply.release_at("job", header, finished=False) is None  # type: ignore[arg-type]
    assert apply.release_at("job", header, finished=True) == Release(  # type: ignore[arg-type]
        "job", "ns:a:k", 60_000, generation=None
    )


def test_a_job_without_an_active_key_releases_nothing() -> None:
    assert apply.release_at("job", {"w": "ns:w:k", "s": "queued"}, finished=True) is None  # type: ignore[arg-type]


@dataclass
class ReleasingStore:
    changed: bool = True
    error: Exception | None = None
    released: list[Release] = field(default_factory=list)

    def release_many(self, holds: list[Release]) -> list[bool]:
        if self.error is not None:
            raise self.error
        self.released += holds
        return [self.changed]


@pytest.fixture
def emitted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Any, bool]]:
    seen: list[tuple[str, str, Any, bool]] = []

    def emit(app: Any, job_id: str, key: str, *, reason: Any, kept: bool) -> None:
        seen.append((job_id, key, reason, kept))

    monkeypatch.setattr(apply.signals, "emit_released", emit)
    return seen


def test_an_eager_run_releases_here_and_signals_what_changed(
    emitted: list[tuple[str, str, Any, bool]],
) -> None:
    store = ReleasingStore()
    fake = FakeRuntime(store)  # type: ignore[arg-type]
    apply.release_now(None, fake, "job", {"a": "k", "s": "queued"}, finished=False)  # type: ignore[arg-type]
    apply.release_now(None, fake, "job", {"a": "k", "s": "exists", "r": 5}, finished=True)  # type: ignore[arg-type]
    assert store.released == [Release("job", "k", 0), Release("job", "k", 5)]
    assert emitted == [
        ("job", "k", apply.signals.ReleaseReason.STARTED, False),
        ("job", "k", apply.signals.ReleaseReason.FINISHED, True),
    ]
    store.changed = False  # another job's key by now: nothing released, nothing said
    apply.release_now(None, fake, "job", {"a": "k", "s": "active"}, finished=True)  # type: ignore[arg-type]
    assert len(emitted) == 2


def test_a_release_the_store_did_not_take_is_owed_within_the_lease(
    monkeypatch: pytest.MonkeyPatch, emitted: list[tuple[str, str, Any, bool]]
) -> None:
    owed: list[tuple[Release, float | None]] = []
    monkeypatch.setattr(
        apply.cleanup,
        "release",
        lambda store, hold, *, within_s, on_released: owed.append((hold, within_s)),
    )
    fake = FakeRuntime(ReleasingStore(error=BackendUnavailable("down")))  # type: ignore[arg-type]
    apply.release_now(None, fake, "job", {"a": "k", "s": "active"}, finished=True)  # type: ignore[arg-type]
    fake.lease_ms = None
    apply.release_now(None, fake, "job", {"a": "k", "s": "active"}, finished=True)  # type: ignore[arg-type]
    assert owed == [(Release("job", "k", 0), 60.0), (Release("job", "k", 0), None)]
    assert emitted == []


def test_a_failed_rollback_is_owed_and_never_masks_the_publish_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    owed: list[list[Claim]] = []
    monkeypatch.setattr(apply.cleanup, "roll_back", lambda store, claims: owed.append(claims))

    @dataclass
    class Refusing:
        def rollback(self, claim: Claim) -> None:
            raise BackendUnavailable("down")

    claim = Claim("job", "task")
    with caplog.at_level(logging.WARNING, logger="celery_unique"):
        apply.rollback(FakeRuntime(Refusing()), claim)  # type: ignore[arg-type]
    assert owed == [[claim]]
    [logged] = caplog.records
    assert logged.getMessage().startswith("could not roll back the keys of job job")
    assert logged.exc_info, "the store's error is logged with it"


# Verdicts and receipts


@pytest.fixture
def unique_task(app: Celery) -> Any:
    @app.task(base=UniqueTask, name="apply.job", unique_key="k", shared=False)
    def job() -> None:
        pass

    return job


def planned(window_key: str | None = None, active_key: str | None = "apply.job:k") -> Any:
    return SimpleNamespace(
        claim=Claim("asked", "apply.job"),
        active_key=active_key,
        window_key=window_key,
        countdown_s=None,
    )


@pytest.fixture
def conflicts() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def receive(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    uniqueness_conflict.connect(receive, weak=False, dispatch_uid="test_dispatch_apply")
    yield seen
    uniqueness_conflict.disconnect(dispatch_uid="test_dispatch_apply")


def test_a_window_conflict_is_an_error_naming_the_job_and_is_signalled(
    unique_task: Any, conflicts: list[dict[str, Any]]
) -> None:
    decision = Decision(Verdict.CONFLICT, "first", conflicting_job_ids=("first",))
    error = apply.verdict_error(unique_task, planned("apply.job:w"), decision)
    assert isinstance(error, UniquenessConflict)
    assert error.conflicting_job_id == "first"
    assert "window key 'apply.job:w' of apply.job is already used by job first" in str(error)
    assert [c["job_id"] for c in conflicts] == ["asked"]


def test_a_composition_conflict_names_the_window_job_first_and_the_key_holder_last(
    unique_task: Any, conflicts: list[dict[str, Any]]
) -> None:
    ids = ("window-job", "between", "holder")
    decision = Decision(Verdict.COMPOSITION_CONFLICT, "window-job", conflicting_job_ids=ids)
    error = apply.verdict_error(unique_task, planned("apply.job:w"), decision)
    assert isinstance(error, CompositionConflict)
    assert str(error) == (
        "window key 'apply.job:w' points at job window-job but active key 'apply.job:k' is "
        "held by job holder"
    )
    assert error.conflicting_job_ids == ids
    assert len(conflicts) == 1


def test_a_verdict_that_publishes_or_reuses_is_no_error_and_no_conflict(
    unique_task: Any, conflicts: list[dict[str, Any]]
) -> None:
    for verdict in (Verdict.CREATED, Verdict.REUSED_ACTIVE, Verdict.REUSED_WINDOW):
        assert apply.verdict_error(unique_task, planned(), Decision(verdict, "job")) is None
    assert conflicts == []


def test_a_reused_receipt_says_which_key_matched_and_what_the_duplicate_changed(
    unique_task: Any,
) -> None:
    by_window = apply.reused(
        unique_task,
        planned("apply.job:w"),
        Decision(Verdict.REUSED_WINDOW, "held"),
        callbacks=True,
        eager=False,
    )
    assert by_window.duplicate_match is DuplicateMatch.WINDOW
    assert by_window.id == "held"
    assert not by_window.callbacks_dropped  # a window match is the same request, callbacks too
    assert not by_window.rerun_requested
    owed = Decision(Verdict.REUSED_ACTIVE, "held", effect=Effect.RERUN_REQUESTED)
    with pytest.warns(CallbacksNotAttached, match="active key 'apply.job:k'"):
        by_key = apply.reused(unique_task, planned(), owed, callbacks=True, eager=False)
    assert by_key.duplicate_match is DuplicateMatch.ACTIVE
    assert by_key.callbacks_dropped
    assert by_key.rerun_requested
    assert not by_key.arguments_replaced


def test_a_created_receipt_tells_the_planned_start(unique_task: Any) -> None:
    at_ms = 1_700_000_000_000
    decided = Decision(Verdict.CREATED, "job", starts_at_ms=at_ms)
    receipt = apply.created_receipt(unique_task.AsyncResult("job"), planned(), decided)
    assert receipt.postponed_to == datetime.fromtimestamp(at_ms / 1000, timezone.utc)
    assert (
        apply.created_receipt(unique_task.AsyncResult("j2"), planned(), None).postponed_to is None
    )
    # Published without a decision (fail-open): the countdown it was sent with.
    debounced = planned()
    debounced.countdown_s = 30.0
    before = datetime.now(timezone.utc)
    receipt = apply.created_receipt(unique_task.AsyncResult("j3"), debounced, None)
    after = datetime.now(timezone.utc)
    assert receipt.postponed_to is not None
    assert before + timedelta(seconds=30) <= receipt.postponed_to <= after + timedelta(seconds=30)


def test_a_dropped_callback_is_blamed_on_the_callers_dispatch(unique_task: Any) -> None:
    """The warning points at the line that dispatched the duplicate, not into the library."""
    unique_task.apply_async()
    with pytest.warns(CallbacksNotAttached) as caught:
        unique_task.apply_async(link=unique_task.si())
    assert [warning.filename for warning in caught] == [__file__]


def test_a_reused_group_member_is_blamed_on_the_callers_dispatch(unique_task: Any) -> None:
    unique_task.apply_async()
    with pytest.warns(GroupMemberReused) as caught:
        group(unique_task.si(), unique_task.si()).apply_async()
    assert {warning.filename for warning in caught} == {__file__}


def test_a_header_read_from_a_message_releases_by_its_scope() -> None:
    """A worker's header is decoded from the message: its scope is equal to, never the same
    object as, the library's own."""
    for scope, on_start, on_end in (
        ("queued", Release("job", "k", 0), Release("job", "k", 0)),
        ("active", None, Release("job", "k", 0)),
        ("exists", None, Release("job", "k", 60_000)),
    ):
        header = json.loads(json.dumps({"a": "k", "s": scope, "r": 60_000}))
        assert apply.release_at("job", header, finished=False) == on_start, scope
        assert apply.release_at("job", header, finished=True) == on_end, scope


@pytest.mark.parametrize("scope", ["zzz", "later-scope", None])
def test_a_scope_this_version_does_not_know_holds_the_key_until_its_job_ends(
    scope: str | None,
) -> None:
    """A newer producer's scope (or none) is read as ``active``: the key is neither freed
    as the job starts nor kept after it."""
    header = {"a": "k", "s": scope, "r": 60_000}
    assert apply.release_at("job", header, finished=False) is None  # type: ignore[arg-type]
    assert apply.release_at("job", header, finished=True) == Release("job", "k", 0)  # type: ignore[arg-type]


def test_an_exists_key_kept_for_good_is_signalled_as_kept(
    emitted: list[tuple[str, str, Any, bool]],
) -> None:
    """With ``result_expires`` off, an ``exists`` key has no retention: it is kept for good."""
    fake = FakeRuntime(ReleasingStore())  # type: ignore[arg-type]
    apply.release_now(None, fake, "job", {"a": "k", "s": "exists"}, finished=True)  # type: ignore[arg-type]
    assert fake.store.released == [Release("job", "k", None)]
    assert emitted == [("job", "k", apply.signals.ReleaseReason.FINISHED, True)]


# A job sent again under its own id: a retry, a lost child's retry, a replacement


@pytest.fixture
def keyed(app: Celery) -> Any:
    @app.task(base=UniqueTask, name="apply.keyed", unique_key="k", shared=False)
    def keyed() -> None:
        pass

    return keyed


def holders(app: Celery) -> dict[str, tuple[str, int | None]]:
    """Each held key of the app's store: its job and how long until it expires."""
    return {held.key: (held.job_id, held.expires_in_ms) for held in runtime(app).store.scan()}


LEASE_MS = 3_600_000  # the default unique_lease


def test_a_job_sent_again_is_published_with_its_header_and_a_lease_for_its_countdown(
    app: Celery, keyed: Any, published: list[dict[str, Any]]
) -> None:
    first = keyed.apply_async()
    [key] = holders(app)
    header = published[0][HEADER]
    with resend.resending(first.id, header):
        again = keyed.apply_async(task_id=first.id, countdown=600)
    assert again.id == first.id
    assert [sent["id"] for sent in published] == [first.id, first.id], "never its own duplicate"
    assert published[1][HEADER] == header
    holder, expires_in_ms = holders(app)[key]
    assert holder == first.id
    assert expires_in_ms is not None
    assert expires_in_ms > LEASE_MS, "the countdown is covered"


def test_a_job_sent_again_where_a_worker_renews_its_lease_asks_for_no_longer_one(
    app: Celery, keyed: Any, published: list[dict[str, Any]]
) -> None:
    first = keyed.apply_async()
    with resend.resending(first.id, published[0][HEADER]), resend.lease_covers_it():
        keyed.apply_async(task_id=first.id, countdown=600)
    [(holder, expires_in_ms)] = holders(app).values()
    assert len(published) == 2
    assert (holder, expires_in_ms is not None and expires_in_ms <= LEASE_MS) == (first.id, True)


def test_a_job_without_a_header_sent_again_is_published_as_it_was(
    app: Celery, keyed: Any, published: list[dict[str, Any]]
) -> None:
    """A job published before its task was unique holds no key: sent again, it holds none."""
    with resend.resending("old-job", None):
        again = keyed.apply_async(task_id="old-job", countdown=600)
    assert again.id == "old-job"
    assert [(sent["id"], HEADER in sent) for sent in published] == [("old-job", False)]
    assert holders(app) == {}


@contextmanager
def running(task: Any, job_id: str, header: dict[str, Any] | None) -> Iterator[None]:
    """``task`` runs job ``job_id`` in a worker, its message carrying ``header``."""
    request: dict[str, Any] = {"id": job_id, "is_eager": False, "called_directly": False}
    if header is not None:
        request[HEADER] = header
    task.push_request(**request)
    _task_stack.push(task)
    try:
        yield
    finally:
        _task_stack.pop()
        task.pop_request()


@pytest.fixture
def replacing(app: Celery) -> Any:
    @app.task(base=UniqueTask, name="apply.replaced", unique_key="r", shared=False)
    def replaced() -> None:
        pass

    return replaced


def test_a_replacement_with_its_own_key_is_decided_under_the_jobs_id_and_carries_both(
    app: Celery, keyed: Any, replacing: Any, published: list[dict[str, Any]]
) -> None:
    job = replacing.apply_async()
    job_header = published[0][HEADER]
    with running(replacing, job.id, job_header):
        replacement = keyed.apply_async(task_id=job.id)
    assert replacement.id == job.id
    assert {holder for holder, _ in holders(app).values()} == {job.id}
    assert len(holders(app)) == 2, "the job's key and the replacement's own"
    sent = published[1][HEADER]
    assert (sent["a"], sent["x"]["a"]) == (job_header["a"], holders_key(app, "k"))


def holders_key(app: Celery, key: str) -> str:
    # A task's keys are named after it, a separator, then the key itself.
    [stored] = [held for held in holders(app) if held.endswith(f"\x1f{key}")]
    return stored


def test_a_replacement_whose_key_the_job_holds_is_sent_with_the_jobs_header(
    app: Celery, keyed: Any, published: list[dict[str, Any]]
) -> None:
    @app.task(
        base=UniqueTask, name="apply.same_key", unique_key="k", unique_prefix=False, shared=False
    )
    def same_key() -> None:
        pass

    @app.task(
        base=UniqueTask,
        name="apply.other_same_key",
        unique_key="k",
        unique_prefix=False,
        shared=False,
    )
    def keyed_shared() -> None:
        pass

    job = same_key.apply_async()
    job_header = published[0][HEADER]
    with running(same_key, job.id, job_header):
        replacement = keyed_shared.apply_async(task_id=job.id)
    assert replacement.id == job.id
    assert published[1][HEADER] == job_header, "carried on, not asked for again"
    assert [holder for holder, _ in holders(app).values()] == [job.id]


def test_a_replacement_of_a_job_without_keys_is_decided_as_a_job_of_its_own(
    app: Celery, keyed: Any, published: list[dict[str, Any]]
) -> None:
    @app.task(name="apply.plain", shared=False)
    def plain() -> None:
        pass

    with running(plain, "plain-job", None):
        replacement = keyed.apply_async(task_id="plain-job")
    assert replacement.id == "plain-job"
    assert [holder for holder, _ in holders(app).values()] == ["plain-job"]
    assert published[0][HEADER]["a"] == holders_key(app, "k")
    assert "x" not in published[0][HEADER]


def test_a_replacement_of_a_job_with_a_window_key_only_holds_its_own_key_as_its_own(
    app: Celery, keyed: Any, published: list[dict[str, Any]]
) -> None:
    @app.task(
        base=UniqueTask,
        name="apply.windowed",
        unique_window_key="w",
        unique_window=60,
        shared=False,
    )
    def windowed() -> None:
        pass

    job = windowed.apply_async()
    job_header = published[0][HEADER]
    assert "a" not in job_header
    with running(windowed, job.id, job_header):
        keyed.apply_async(task_id=job.id)
    sent = published[1][HEADER]
    assert "x" not in sent, "no active key of the job's to carry beside its own"
    assert sent["a"] == holders_key(app, "k")


def test_a_duplicate_dropping_only_an_error_callback_is_warned_about(
    keyed: Any,
) -> None:
    keyed.apply_async()
    with pytest.warns(CallbacksNotAttached):
        keyed.apply_async(link_error=keyed.si())


def test_a_duplicate_of_a_key_found_held_is_refused_before_its_message_is_routed(
    app: Celery, keyed: Any
) -> None:
    """The store is asked while Celery routes and builds the message; a key this process
    found held is most likely held still, and its answer is read first."""
    routed: list[str] = []

    def route(name: str, *args: Any, **kwargs: Any) -> None:
        routed.append(name)

    app.conf.task_routes = (route,)
    first = keyed.apply_async()
    assert len(routed) == 1
    assert keyed.apply_async().id == first.id
    assert len(routed) == 2, "the first duplicate is routed while the store answers"
    assert keyed.apply_async().id == first.id
    assert len(routed) == 2, "a key found held is asked about before routing"


@pytest.mark.parametrize(("scope", "held_while_running"), [("queued", False), ("active", True)])
def test_a_job_run_here_holds_its_key_while_it_runs_as_its_scope_says(
    app: Celery, scope: str, held_while_running: bool
) -> None:
    seen: list[bool] = []

    @app.task(
        base=UniqueTask,
        name=f"apply.here.{scope}",
        unique_key="k",
        unique_while=scope,
        shared=False,
    )
    def here() -> None:
        seen.append(bool(holders(app)))

    here.apply()
    assert seen == [held_while_running]
    assert holders(app) == {}, "freed as it ended"


class Untouchable:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the store was used: {name}")


def test_a_job_run_here_without_a_decision_releases_nothing() -> None:
    """Run without a decision (fail-open), a job holds no key to release."""
    noted: list[Any] = []
    fake = SimpleNamespace(store=Untouchable(), eager_runs=SimpleNamespace(note=noted.append))
    assert apply.run_eagerly(None, fake, "job", None, lambda: "ran") == "ran"  # type: ignore[arg-type]
    assert noted == ["ran"]
