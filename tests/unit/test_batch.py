"""dispatch_many on the memory store: order, all-or-nothing, continue_on_conflict."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery

from celery_unique import (
    CallbacksNotAttached,
    Disposition,
    DuplicateMatch,
    InvalidKey,
    UniquenessConflict,
    UniqueTask,
    UnsupportedCombination,
    dispatch_many,
)
from celery_unique import config as unique_config
from celery_unique.config import runtime
from celery_unique.dispatch.headers import HEADER
from celery_unique.testing import held_keys
from tests.unit.conftest import queued_job_ids


@pytest.fixture
def order(app: Celery) -> Any:
    """A task with a one-minute window keyed by a request id, its amount in the fingerprint."""

    @app.task(
        shared=False, base=UniqueTask, unique_window_key=lambda job: job.rid, unique_window=60
    )
    def order(rid: str, amount: int) -> None:
        return None

    return order


@pytest.fixture
def job(app: Celery) -> Any:
    """A task keyed by its argument, with a one-hour window keyed by a request id."""

    @app.task(shared=False, base=UniqueTask, unique_key=lambda job: f"k:{job.x}")
    def job(x: int, note: str = "") -> None:
        return None

    return job


def test_items_behave_as_sequential_dispatches(app: Celery, job: Any, published: list[Any]) -> None:
    """A later item matching an earlier one reuses the earlier item's new job."""
    results = dispatch_many([job.s(1), job.s(2), job.s(1), job.s(x=2)])
    assert [r.disposition for r in results] == [
        Disposition.CREATED,
        Disposition.CREATED,
        Disposition.REUSED,
        Disposition.REUSED,
    ]
    assert results[2].id == results[0].id
    assert results[3].id == results[1].id
    assert results[3].duplicate_match is DuplicateMatch.ACTIVE
    assert len(published) == 2


def test_invalid_item_fails_the_batch_before_anything_is_written(
    app: Celery, job: Any, published: list[Any]
) -> None:
    """Bad input anywhere raises with the item's index; nothing written or published."""
    with pytest.raises(InvalidKey) as caught:
        dispatch_many([job.s(1), job.s(2).set(unique_key=""), job.s(3)])
    assert caught.value.index == 1
    assert held_keys(app) == []
    assert published == []


def test_conflict_fails_the_whole_batch(app: Celery, order: Any, published: list[Any]) -> None:
    """A window conflict in one item means no item is written or published."""
    first = order.delay("r1", 10)
    published.clear()
    with pytest.raises(UniquenessConflict) as caught:
        dispatch_many([order.s("r2", 5), order.s("r1", 99)])
    assert caught.value.index == 1
    assert caught.value.conflicting_job_id == first.id
    assert [k.job_id for k in held_keys(app)] == [first.id]
    assert published == []


def test_continue_on_conflict_keeps_errors_in_their_slots(
    app: Celery, job: Any, published: list[Any]
) -> None:
    """With continue_on_conflict a failed item's slot holds its error; the rest proceed."""
    results = dispatch_many(
        [job.s(1), job.s(2).set(unique_key="x\x00"), job.s(3)], continue_on_conflict=True
    )
    assert results[0].disposition is Disposition.CREATED
    assert isinstance(results[1], InvalidKey)
    assert results[1].index == 1
    assert results[2].disposition is Disposition.CREATED
    assert len(published) == 2


def test_plain_tasks_ride_along_but_refuse_uniqueness_options(app: Celery) -> None:
    """Plain tasks publish as usual in a batch; giving them uniqueness options is refused."""

    @app.task(shared=False)
    def plain(x: int) -> None:
        return None

    assert dispatch_many([plain.s(1)])[0].disposition is Disposition.CREATED
    with pytest.raises(UnsupportedCombination):
        dispatch_many([plain.s(1).set(unique_key="k")])


def test_batch_uses_one_store_round_trip(app: Celery, job: Any) -> None:
    """The whole batch's decisions are one call to the store."""
    from celery_unique.config import runtime

    store = runtime(app).store
    calls: list[int] = []
    original = store.decide

    def counting(claims: Any, **kwargs: Any) -> Any:
        calls.append(len(claims))
        return original(claims, **kwargs)

    store.decide = counting  # type: ignore[method-assign]
    dispatch_many([job.s(i) for i in range(100)])
    assert calls == [100]


def test_failed_batch_publish_rolls_every_key_back(app: Celery, job: Any) -> None:
    """When the broker is unreachable the batch raises and no key stays held.

    It fails as its first message connects, before anything left: every key is rolled
    back. A batch that fails part-way, its first messages out, is played on RabbitMQ
    (``tests/integration/test_batch_publish.py``)."""
    app.conf.broker_url = "amqp://guest:guest@127.0.0.1:1//"
    app.conf.broker_connection_timeout = 0.5
    app.conf.broker_connection_max_retries = 0
    with pytest.raises(Exception) as caught:
        dispatch_many([job.s(1).set(retry=False), job.s(2).set(retry=False)])
    assert not isinstance(caught.value, UniquenessConflict)
    assert held_keys(app) == []


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_batch_publish_interrupted_holds_only_the_keys_of_jobs_sent(
    app: Celery,
    job: Any,
    interruption: type[BaseException],
    interrupt_publish: Callable[[int], list[str]],
    nth: int,
) -> None:
    """A Ctrl-C or gevent's ``Timeout`` stopping the batch at any item: a key stays held
    only for a job whose message reached the broker."""
    attempted = interrupt_publish(nth)
    with pytest.raises(interruption):
        dispatch_many([job.s(1), job.s(2), job.s(3)])
    assert len(attempted) == nth
    sent = queued_job_ids(app) & set(attempted)
    assert {held.job_id for held in runtime(app).store.scan()} == sent


def test_batch_fails_open_with_one_warning_per_outage(
    app: Celery, job: Any, published: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """With unique_fail_open a batch is published without uniqueness, warned about once."""
    import logging

    app.conf.unique_backend = "redis://127.0.0.1:1/0"
    app.conf.unique_fail_open = True
    with caplog.at_level(logging.WARNING, logger="celery_unique"):
        first = dispatch_many([job.s(1), job.s(1)])
        second = dispatch_many([job.s(1)])
    assert len({r.id for r in first + second}) == 3
    assert len(published) == 3
    assert len([r for r in caplog.records if "fail-open" in r.getMessage()]) == 1


@pytest.mark.parametrize("item", ["job", {}], ids=["not-a-signature", "no-task"])
def test_an_item_that_is_no_task_signature_is_refused(app: Celery, job: Any, item: Any) -> None:
    with pytest.raises(TypeError, match="dispatch_many takes task signatures"):
        dispatch_many([job.s(1), item])


def test_a_task_unknown_here_is_refused_uniqueness_options_and_else_raises_as_celery_would(
    app: Celery, published: list[Any]
) -> None:
    """Its options cannot be read without its declaration; without options, Celery's own
    KeyError for an unregistered task."""
    with pytest.raises(UnsupportedCombination, match="not registered in this process"):
        dispatch_many([app.signature("elsewhere.job", options={"unique_key": "k"})])
    with pytest.raises(KeyError):
        dispatch_many([app.signature("elsewhere.job")])
    assert published == []


def test_only_an_item_that_brings_its_job_id_gets_a_generation(
    app: Celery, job: Any, published: list[Any]
) -> None:
    """As for one dispatch: a caller's task_id may come again, an id made here may not."""
    dispatch_many([job.s(1).set(task_id="chosen"), job.s(2)])
    chosen, made = (headers[HEADER] for headers in published)
    assert chosen["g"]
    assert "g" not in made


def test_a_batch_across_stores_fails_open_only_for_the_store_that_is_down(
    app: Celery, job: Any, published: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The items of a store that is down go out without uniqueness (no key header, as a
    single dispatch would); the other store still decides its own items."""
    down = Celery("down", broker="memory://", set_as_current=False)
    down.conf.update(unique_backend="redis://127.0.0.1:1/0", unique_fail_open=True)
    down.conf.broker_connection_retry = False
    down.finalize()

    @down.task(shared=False, base=UniqueTask, unique_key=lambda other: f"o:{other.x}")
    def other(x: int) -> None:
        return None

    try:
        with caplog.at_level("WARNING", logger="celery_unique"):
            results = dispatch_many([other.s(1), other.s(1), job.s(1), job.s(1)])
    finally:
        unique_config.reset(down)
    assert [r.disposition for r in results] == [
        Disposition.CREATED,
        Disposition.CREATED,
        Disposition.CREATED,
        Disposition.REUSED,
    ]
    assert results[3].id == results[2].id
    assert [HEADER in headers for headers in published] == [False, False, True]
    assert [k.job_id for k in held_keys(app)] == [results[2].id]


def test_a_conflict_after_a_plain_item_still_fails_the_batch(
    app: Celery, order: Any, published: list[Any]
) -> None:
    @app.task(shared=False)
    def plain(x: int) -> None:
        return None

    order.delay("r1", 10)
    published.clear()
    with pytest.raises(UniquenessConflict) as caught:
        dispatch_many([plain.s(1), order.s("r1", 99)])
    assert caught.value.index == 1
    assert published == []


def test_items_after_a_conflict_are_published_when_told_to_go_on(
    app: Celery, job: Any, order: Any, published: list[Any]
) -> None:
    order.delay("r1", 10)
    published.clear()
    results = dispatch_many(
        [order.s("r1", 99), order.s("r2", 5), job.s(3)], continue_on_conflict=True
    )
    assert isinstance(results[0], UniquenessConflict)
    assert [r.disposition for r in results[1:]] == [Disposition.CREATED, Disposition.CREATED]
    assert [headers["id"] for headers in published] == [r.id for r in results[1:]]


def test_a_debounced_item_is_published_to_start_after_its_debounce(
    app: Celery, published: list[Any]
) -> None:
    @app.task(
        shared=False,
        base=UniqueTask,
        unique_key=lambda job: f"s:{job.x}",
        unique_while="active",
        unique_on_duplicate="debounce",
        unique_debounce=30,
    )
    def settle(x: int) -> None:
        return None

    @app.task(shared=False, base=UniqueTask, unique_key=lambda job: f"p:{job.x}")
    def prompt(x: int) -> None:
        return None

    before = datetime.now(timezone.utc)
    created, now = dispatch_many([settle.s(1), prompt.s(1)])
    assert created.disposition is Disposition.CREATED
    eta = datetime.fromisoformat(published[0]["eta"])
    assert before + timedelta(seconds=29) < eta < before + timedelta(seconds=60)
    assert published[1]["eta"] is None
    assert now.disposition is Disposition.CREATED


@pytest.mark.parametrize("callback", ["link", "link_error"])
def test_a_duplicate_whose_callback_is_not_attached_says_so(
    app: Celery, job: Any, callback: str
) -> None:
    """A duplicate reusing an active job does not bring its callback to it: a warning, and
    the receipt tells it."""

    @app.task(shared=False)
    def notify() -> None:
        return None

    holder = job.delay(1)
    with pytest.warns(CallbacksNotAttached, match=holder.id):
        (reused,) = dispatch_many([job.s(1).set(**{callback: notify.s()})])
    assert reused.id == holder.id
    assert reused.callbacks_dropped


def test_an_interrupted_batch_with_a_plain_item_rolls_back_and_raises_the_interruption(
    app: Celery,
    job: Any,
    interruption: type[BaseException],
    interrupt_publish: Callable[[int], list[str]],
) -> None:
    @app.task(shared=False)
    def plain(x: int) -> None:
        return None

    interrupt_publish(1)
    with pytest.raises(interruption):
        dispatch_many([job.s(1), plain.s(2), job.s(3)])
    assert held_keys(app) == []


def test_an_interrupted_batch_keeps_the_key_of_a_job_it_reused(
    app: Celery,
    job: Any,
    interruption: type[BaseException],
    interrupt_publish: Callable[[int], list[str]],
) -> None:
    """An item handed its own id's existing job wrote nothing: rolling back the batch
    leaves that job's window key held."""

    @app.task(
        shared=False, base=UniqueTask, unique_window_key=lambda job: job.rid, unique_window=60
    )
    def order(rid: str) -> None:
        return None

    order.apply_async(("r1",), task_id="order-1")
    interrupt_publish(2)
    with pytest.raises(interruption):
        dispatch_many([job.s(1), order.s("r1").set(task_id="order-1")])
    assert [k.job_id for k in held_keys(app)] == ["order-1"]
