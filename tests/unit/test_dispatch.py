"""The dispatch path on the memory store: receipts, key sources, rules and errors."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery

from celery_unique import (
    BackendUnavailable,
    Disposition,
    DuplicateMatch,
    InvalidKey,
    KeyMismatch,
    KeySelectorFailed,
    UniquenessRequired,
    UniqueTask,
    UnsupportedCombination,
)
from celery_unique.config import runtime
from celery_unique.dispatch.headers import HEADER
from tests.unit.conftest import queued_job_ids


def store_keys(app: Celery) -> list[str]:
    return [held.key for held in runtime(app).store.scan()]


def test_task_without_keys_publishes_with_a_receipt(app: Celery, published: list[Any]) -> None:
    """A UniqueTask with no key is a plain task whose result still carries the receipt."""

    @app.task(shared=False, base=UniqueTask)
    def plain(x: int) -> int:
        return x

    result = plain.delay(1)
    assert (result.disposition, result.duplicate, result.duplicate_match, result.policy_drift) == (
        Disposition.CREATED,
        False,
        None,
        False,
    )
    assert len(published) == 1
    assert HEADER not in published[0]


def test_literal_key_reuses_the_first_job(app: Celery, published: list[Any]) -> None:
    """While the key is held, a second dispatch returns the first job and publishes nothing."""

    @app.task(shared=False, base=UniqueTask, unique_key="stats")
    def recalc() -> None:
        return None

    first, second = recalc.delay(), recalc.delay()
    assert second.id == first.id
    assert (second.disposition, second.duplicate, second.duplicate_match) == (
        Disposition.REUSED,
        True,
        DuplicateMatch.ACTIVE,
    )
    assert len(published) == 1
    assert published[0][HEADER]["s"] == "queued"


def test_selector_sees_bound_arguments_by_item_and_attribute(app: Celery) -> None:
    """Positional and keyword calls bind to the same view; defaults are applied."""
    seen: list[Any] = []

    def select(job: Any) -> str:
        seen.append((job.tenant_id, job["tenant_id"], job.scope, dict(job)))
        return f"tenant:{job.tenant_id}"

    @app.task(shared=False, base=UniqueTask, unique_key=select)
    def recalc(tenant_id: int, scope: str = "all") -> None:
        return None

    first = recalc.delay(7)
    assert recalc.delay(tenant_id=7).id == first.id
    assert recalc.delay(8).id != first.id
    assert seen[0] == (7, 7, "all", {"tenant_id": 7, "scope": "all"})


def test_selector_view_is_read_only(app: Celery) -> None:
    """A selector cannot change the arguments it looks at."""

    def meddle(job: Any) -> str:
        job.tenant_id = 9
        return "k"

    @app.task(shared=False, base=UniqueTask, unique_key=meddle)
    def recalc(tenant_id: int) -> None:
        return None

    with pytest.raises(KeySelectorFailed) as caught:
        recalc.delay(7)
    assert isinstance(caught.value.__cause__, AttributeError)


def test_bound_task_view_leaves_self_out(app: Celery) -> None:
    """For bind=True tasks, the view holds the arguments, not the task itself."""
    views: list[dict[str, Any]] = []

    @app.task(
        shared=False,
        base=UniqueTask,
        bind=True,
        unique_key=lambda job: views.append(dict(job)) or "k",
    )
    def bound(self: Any, x: int, *rest: int, **extra: Any) -> None:
        return None

    bound.delay(1, 2, 3, flag=True)
    assert views == [{"x": 1, "rest": [2, 3], "flag": True}]


def test_arguments_that_do_not_bind_fail_before_anything_is_written(
    app: Celery, published: list[Any]
) -> None:
    """A TypeError for bad arguments comes before the store or broker is touched."""

    @app.task(shared=False, base=UniqueTask, unique_key="k")
    def job(x: int) -> None:
        return None

    with pytest.raises(TypeError):
        job.delay(1, 2)
    assert store_keys(app) == []
    assert published == []


def test_selector_returning_none_is_uniqueness_required(app: Celery) -> None:
    """A declared key is required: a selector answering None fails the dispatch."""

    @app.task(shared=False, base=UniqueTask, unique_key=lambda job: None)
    def job() -> None:
        return None

    with pytest.raises(UniquenessRequired) as caught:
        job.delay()
    assert caught.value.code == "uniqueness_required"


def test_selector_raising_is_key_selector_failed_with_cause(app: Celery) -> None:
    """A selector's own exception is kept as the cause."""

    @app.task(shared=False, base=UniqueTask, unique_key=lambda job: job.missing)
    def job() -> None:
        return None

    with pytest.raises(KeySelectorFailed) as caught:
        job.delay()
    assert caught.value.code == "key_selector_failed"
    assert isinstance(caught.value.__cause__, AttributeError)


@pytest.mark.parametrize("bad", ["", "x" * 513, "a\x00b", "lone\udc00", 7, ["k"]])
def test_invalid_dispatch_keys_touch_nothing(app: Celery, published: list[Any], bad: Any) -> None:
    """An invalid key (given or selected) fails with invalid_key; nothing stored or published."""

    @app.task(shared=False, base=UniqueTask)
    def given() -> None:
        return None

    @app.task(shared=False, base=UniqueTask, unique_key=lambda job: bad)
    def selected() -> None:
        return None

    with pytest.raises(InvalidKey):
        given.apply_async(unique_key=bad)
    with pytest.raises(InvalidKey):
        selected.delay()
    assert store_keys(app) == []
    assert published == []


def test_declared_key_always_applies(app: Celery) -> None:
    """A dispatch may repeat the declared key, but not replace it, unless overridable."""

    @app.task(shared=False, base=UniqueTask, unique_key=lambda job: f"u:{job.user}")
    def strict(user: int) -> None:
        return None

    @app.task(
        shared=False,
        base=UniqueTask,
        unique_key=lambda job: f"u:{job.user}",
        unique_overridable=True,
    )
    def relaxed(user: int) -> None:
        return None

    first = strict.apply_async((1,), unique_key="u:1")
    assert strict.delay(1).id == first.id
    with pytest.raises(KeyMismatch) as caught:
        strict.apply_async((1,), unique_key="other")
    assert caught.value.code == "uniqueness_key_mismatch"
    with pytest.raises(KeyMismatch):
        strict.apply_async((1,), unique_key="u:1", unique_while="active")
    with pytest.raises(KeyMismatch):
        strict.apply_async((1,), unique_key="u:1", unique_prefix=False)

    base = relaxed.delay(1)
    replaced = relaxed.apply_async((1,), unique_key="other")
    assert replaced.id != base.id
    assert relaxed.apply_async((2,), unique_key="other").id == replaced.id


def test_keys_given_per_dispatch_and_through_signatures(app: Celery) -> None:
    """A task without a declared key takes one per dispatch, from apply_async or .set()."""

    @app.task(shared=False, base=UniqueTask)
    def job(x: int) -> None:
        return None

    first = job.apply_async((1,), unique_key="k", unique_while="active")
    assert job.s(2).set(unique_key="k").apply_async().id == first.id
    assert job.delay(3).id != first.id


def test_keys_are_scoped_to_the_task_unless_unprefixed(app: Celery) -> None:
    """The same key on two task types never collides, unless both opt out of the prefix."""

    @app.task(shared=False, base=UniqueTask, unique_key="shared")
    def one() -> None:
        return None

    @app.task(shared=False, base=UniqueTask, unique_key="shared")
    def two() -> None:
        return None

    @app.task(shared=False, base=UniqueTask, unique_key="shared", unique_prefix=False)
    def three() -> None:
        return None

    @app.task(shared=False, base=UniqueTask, unique_key="shared", unique_prefix=False)
    def four() -> None:
        return None

    assert one.delay().id != two.delay().id
    assert three.delay().id == four.delay().id


def test_chord_member_is_refused_before_anything_is_written(
    app: Celery, published: list[Any]
) -> None:
    """A unique chord header member could hang the chord: refused, nothing written."""

    @app.task(shared=False, base=UniqueTask, unique_key="k")
    def member() -> None:
        return None

    with pytest.raises(UnsupportedCombination):
        member.apply_async(chord=member.s())
    assert store_keys(app) == []
    assert published == []


def test_failed_publish_rolls_the_key_back(app: Celery) -> None:
    """When the broker cannot be reached after the key was reserved, the key is freed."""
    app.conf.broker_url = "amqp://guest:guest@127.0.0.1:1//"
    app.conf.broker_connection_timeout = 0.5
    app.conf.broker_connection_max_retries = 0

    @app.task(shared=False, base=UniqueTask, unique_key="k")
    def job() -> None:
        return None

    with pytest.raises(Exception) as caught:
        job.apply_async(retry=False)
    assert not isinstance(caught.value, BackendUnavailable)
    assert store_keys(app) == []


@pytest.mark.parametrize(
    ("first", "retried"),
    [({}, {"countdown": 0}), ({"countdown": 0}, {}), ("now", "now")],
    ids=["no-countdown-then-zero", "zero-then-no-countdown", "same-eta-now"],
)
def test_a_client_retry_starting_now_again_is_the_same_request(
    app: Celery, published: list[Any], first: Any, retried: Any
) -> None:
    """A client that retries a dispatch, spelling "start now" another way or passing the
    same ``eta`` again once it has passed, gets its first job back, not a conflict."""
    now = datetime.now(timezone.utc)
    first, retried = ({"eta": now} if o == "now" else o for o in (first, retried))

    @app.task(shared=False, base=UniqueTask, unique_window_key="order-1", unique_window=60)
    def charge(amount: int) -> None:
        return None

    job = charge.apply_async((10,), **first)
    again = charge.apply_async((10,), **retried)
    assert (again.id, again.disposition, again.duplicate_match) == (
        job.id,
        Disposition.REUSED,
        DuplicateMatch.WINDOW,
    )
    assert len(published) == 1


@pytest.mark.parametrize("way", ["apply_async", "signature", "send_task", "held_recently"])
def test_a_publish_interrupted_by_a_base_exception_frees_the_key(
    app: Celery,
    interruption: type[BaseException],
    interrupt_publish: Callable[[int], list[str]],
    way: str,
) -> None:
    """A Ctrl-C or gevent's ``Timeout`` stopping the publish, on every way a job leaves,
    frees the key: the job was never sent, the next dispatch creates one."""

    @app.task(shared=False, base=UniqueTask, unique_key="k")
    def job() -> None:
        return None

    nth = 1
    if way == "held_recently":
        # A key this process found held is asked for before the message is built.
        first = job.delay()
        assert job.delay().disposition is Disposition.REUSED
        runtime(app).store.delete(store_keys(app)[0])
        nth = 2
    attempted = interrupt_publish(nth)
    send = {"signature": job.s().delay, "send_task": lambda: app.send_task(job.name)}
    with pytest.raises(interruption):
        send.get(way, job.delay)()
    assert len(attempted) == nth
    assert store_keys(app) == []
    assert attempted[-1] not in queued_job_ids(app)
    again = job.delay()
    assert again.disposition is Disposition.CREATED
    if way == "held_recently":
        assert again.id != first.id


def test_unreachable_store_fails_closed(app: Celery, published: list[Any]) -> None:
    """By default an unreachable store is backend_unavailable and nothing is published."""
    app.conf.unique_backend = "redis://127.0.0.1:1/0"

    @app.task(shared=False, base=UniqueTask, unique_key="k")
    def job() -> None:
        return None

    with pytest.raises(BackendUnavailable) as caught:
        job.delay()
    assert caught.value.code == "backend_unavailable"
    assert published == []


def test_unreachable_store_fails_open_with_one_warning(
    app: Celery, published: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """With unique_fail_open the job is published without uniqueness; one warning per outage."""
    app.conf.unique_backend = "redis://127.0.0.1:1/0"
    app.conf.unique_fail_open = True

    @app.task(shared=False, base=UniqueTask, unique_key="k")
    def job() -> None:
        return None

    with caplog.at_level(logging.WARNING, logger="celery_unique"):
        results = [job.delay() for _ in range(3)]
    assert len({r.id for r in results}) == 3
    assert all(r.disposition is Disposition.CREATED for r in results)
    assert len(published) == 3
    assert HEADER not in published[0]
    assert len([r for r in caplog.records if "fail-open" in r.getMessage()]) == 1


def test_missing_store_setting_names_it(published: list[Any]) -> None:
    """Without unique_backend and without a Redis broker the first dispatch says what to set."""
    from celery_unique import ImproperlyConfigured

    bare = Celery("bare", broker="memory://", set_as_current=False)

    @bare.task(shared=False, base=UniqueTask, unique_key="k")
    def job() -> None:
        return None

    with pytest.raises(ImproperlyConfigured, match="unique_backend"):
        job.delay()
    assert published == []


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((1,), {}, {"a": 1, "b": 2, "c": 3}),
        ((1,), {"c": 5}, {"a": 1, "b": 2, "c": 5}),
        ((), {"a": 1, "b": 1}, {"a": 1, "b": 1, "c": 3}),
        ((1, 2, 3), {}, {"a": 1, "b": 2, "c": 3}),
    ],
)
def test_binding_applies_defaults_and_names(args: Any, kwargs: Any, expected: Any) -> None:
    """Positional and keyword arguments bind by name, with defaults filled in."""
    from celery_unique.keys.arguments import Binder

    def run(a: int, b: int = 2, c: int = 3) -> None:
        return None

    assert Binder(run, drop_first=False).bind(args, kwargs) == expected


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1, 2, 3, 4), {}), ((1,), {"a": 2}), ((), {}), ((1,), {"zz": 1}), ((), {"b": 1})],
)
def test_binding_mismatches_raise_type_error(args: Any, kwargs: Any) -> None:
    """Too many, doubled, missing or unknown arguments raise TypeError as Python would."""
    from celery_unique.keys.arguments import Binder

    def run(a: int, b: int = 2, c: int = 3) -> None:
        return None

    with pytest.raises(TypeError):
        Binder(run, drop_first=False).bind(args, kwargs)


def test_a_release_ends_only_the_hold_of_its_own_dispatch(
    app: Celery, published: list[Any]
) -> None:
    """``queued`` with a caller's task_id: the end of the first run (its header's release)
    leaves the key the same id took again meanwhile; a third dispatch is REUSED."""
    from celery_unique.dispatch.apply import release_at

    @app.task(shared=False, base=UniqueTask, unique_key="refresh", unique_while="queued")
    def refresh() -> None:
        return None

    store = runtime(app).store

    def release(header: Any, *, finished: bool) -> None:
        hold = release_at("fixed", header, finished=finished)
        assert hold is not None
        store.release_many([hold])

    assert refresh.apply_async(task_id="fixed").disposition is Disposition.CREATED
    first = published[-1][HEADER]
    release(first, finished=False)  # it starts
    assert refresh.apply_async(task_id="fixed").disposition is Disposition.CREATED
    second = published[-1][HEADER]
    assert first["g"] != second["g"]
    release(first, finished=True)  # it ends
    assert refresh.apply_async(task_id="fixed").disposition is Disposition.REUSED
    release(second, finished=False)
    assert store_keys(app) == []


def test_only_a_job_id_the_dispatch_brings_gets_a_generation(
    app: Celery, published: list[Any]
) -> None:
    """An id made for the dispatch is its own: no other dispatch shares it, so its header
    (and the key it creates) carries no generation. A caller's task_id, or a
    signature's frozen one, may come again: those get one, each its own."""

    @app.task(shared=False, base=UniqueTask, unique_key=lambda job: f"n:{job.n}")
    def refresh(n: int) -> None:
        return None

    made = refresh.delay(1)
    assert "g" not in published[-1][HEADER]
    refresh.apply_async((2,), task_id="chosen")
    chosen = published[-1][HEADER]["g"]
    signature = refresh.s(3)
    signature.freeze()
    signature.apply_async()
    assert published[-1][HEADER]["g"] not in ("", chosen)
    assert made.disposition is Disposition.CREATED


def test_a_dispatch_that_follows_its_duplicates_gets_a_generation_whatever_its_id(
    app: Celery, published: list[Any]
) -> None:
    """A latest/debounce dispatch's id may come to hold its key another way (the run a
    running job owes its duplicates is named after one of them), so undoing its own
    decision needs to know which hold it wrote: it gets a generation, made id or not."""

    @app.task(
        shared=False,
        base=UniqueTask,
        unique_key=lambda job: f"n:{job.n}",
        unique_while="active",
        unique_on_duplicate="latest",
    )
    def refresh(n: int) -> None:
        return None

    refresh.delay(1)
    first = published[-1][HEADER]["g"]
    refresh.delay(2)
    assert published[-1][HEADER]["g"] not in ("", first)
