"""Window keys (idempotency windows), end to end on a real worker and a real Redis store.

Runs on Redis and on RabbitMQ as broker (see conftest). A window key maps a
request to its job for exactly the window after the first dispatch: the same
request gets the same job back, however the job ended; a different request
with the same key is a conflict and publishes nothing. The test process is
the only producer, so a ``before_task_publish`` receiver counts every message
published; jobs that must stay running block on a gate in Redis.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery, signature
from celery.worker import WorkController

from celery_unique import (
    CompositionConflict,
    Disposition,
    DuplicateMatch,
    InvalidWindow,
    UniquenessConflict,
    UniqueTask,
)
from celery_unique.keys import keyspace
from celery_unique.stores.base import HeldKey, KeyKind
from celery_unique.stores.redis import RedisStore

from . import test_payload_keys
from .conftest import NAMESPACE, active_key, eventually
from .test_lifecycle import go, started
from .test_payload_keys import TIMEOUT_S, Runs, assert_created, keys_of

# The same fixtures as the payload tests: jobs published, and runs counted per label.
published = test_payload_keys.published
runs = test_payload_keys.runs

WINDOW_S = 60
#: The window of the no-slide test: short, so the test waits it out.
SHORT_WINDOW_S = 2
#: Reuse "just before the end": when the store says this little of the window is left (ms).
NEAR_END_MS = 500


def window_key(task_name: str, key: str) -> str:
    """The storage key of a window key scoped to ``task_name``."""
    return keyspace.storage_key(NAMESPACE, keyspace.WINDOW, task_name, key)


def wait_for_go(gates: Any, tag: str) -> None:
    """Mark ``tag`` as running and block until the test opens its gate (at most 20 s)."""
    gates.set(f"running:{tag}:0", 1)
    deadline = time.monotonic() + 20
    while not gates.exists(f"go:{tag}:0") and time.monotonic() < deadline:
        time.sleep(0.02)


def assert_reused_window(result: Any, job_id: str | None, *, drift: bool = False) -> None:
    assert (
        result.disposition,
        result.duplicate,
        result.duplicate_match,
        result.id,
        result.policy_drift,
    ) == (Disposition.REUSED, True, DuplicateMatch.WINDOW, job_id, drift)


def held_window(store: RedisStore, key: str, job_id: str) -> HeldKey:
    held = store.get(key)
    assert held is not None, f"window key {key!r} should still be held"
    assert (held.kind, held.job_id) == (KeyKind.WINDOW, job_id)
    return held


def define_order(app: Celery, runs: Runs, window: float = WINDOW_S) -> Any:
    """A task whose window key is the client's request id."""

    @app.task(
        shared=False,
        base=UniqueTask,
        name="window.order",
        unique_window_key=lambda job: job.request_id,
        unique_window=window,
    )
    def order(request_id: str, item: str, outcome: str = "ok") -> str:
        runs.mark(request_id)
        if outcome == "fail":
            raise ValueError("the order failed")
        return item

    return order


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_same_request_gets_the_finished_job_even_after_its_result_is_gone(
    outcome: str,
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    runs: Runs,
    published: list[str],
) -> None:
    """A retry inside the window returns the finished job (WINDOW), even after ``forget()``."""
    order = define_order(celery_app, runs)
    celery_worker.reload()
    request = f"req-{outcome}"
    key = window_key(order.name, request)

    first = order.delay(request, "book", outcome)
    assert_created(first)
    if outcome == "ok":
        assert first.get(timeout=TIMEOUT_S) == "book"
    else:
        with pytest.raises(ValueError, match="the order failed"):
            first.get(timeout=TIMEOUT_S)
    # The job's lifecycle signals did not release the window key.
    held = held_window(store, key, first.id)
    assert held.expires_in_ms is not None
    assert 0 < held.expires_in_ms <= WINDOW_S * 1000

    assert_reused_window(order.delay(request, "book", outcome), first.id)
    first.forget()
    assert celery_app.AsyncResult(first.id).state == "PENDING"  # the result is gone
    assert_reused_window(order.delay(request_id=request, item="book", outcome=outcome), first.id)

    assert runs.count(request) == 1
    assert published == [first.id]


def test_client_retry_presetting_the_same_task_id_is_a_reuse(
    celery_app: Celery,
    celery_worker: WorkController,
    runs: Runs,
    published: list[str],
) -> None:
    """A retry that presets the task id its first attempt used gets that job back, unpublished."""
    order = define_order(celery_app, runs)
    celery_worker.reload()
    job_id = f"order-{uuid.uuid4()}"  # e.g. derived from the request id by the client

    first = order.apply_async(("req-preset", "book"), task_id=job_id)
    assert_created(first)
    assert first.get(timeout=TIMEOUT_S) == "book"
    retry = order.apply_async(("req-preset", "book"), task_id=job_id)
    assert_reused_window(retry, job_id)
    assert published == [job_id]
    assert runs.count("req-preset") == 1


def test_window_does_not_slide(
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    runs: Runs,
    published: list[str],
) -> None:
    """A reuse just before the window ends does not extend it; after it a new job is created."""
    order = define_order(celery_app, runs, window=SHORT_WINDOW_S)
    celery_worker.reload()
    key = window_key(order.name, "req-slide")

    first = order.delay("req-slide", "book")
    assert first.get(timeout=TIMEOUT_S) == "book"

    def near_end() -> HeldKey | None:
        held = store.get(key)
        if held is None:
            pytest.fail("the window ended before the test could reuse it")
        assert held.expires_in_ms is not None
        return held if held.expires_in_ms < NEAR_END_MS else None

    held = eventually(near_end, what="the end of the window to come near")
    assert_reused_window(order.delay("req-slide", "book"), first.id)
    after = store.get(key)
    # Had the reuse extended the window, the key would live longer than before it.
    assert after is None or after.expires_in_ms <= held.expires_in_ms

    def new_job() -> Any:
        # Every dispatch until then is a reuse; were reuses to extend the window, none would end it.
        result = order.delay("req-slide", "book")
        if result.disposition is Disposition.CREATED:
            return result
        assert_reused_window(result, first.id)
        return None

    second = eventually(new_job, what="the window to end")
    assert second.id != first.id
    assert second.get(timeout=TIMEOUT_S) == "book"
    held_window(store, key, second.id)
    assert runs.count("req-slide") == 2
    assert published == [first.id, second.id]


#: One difference from the first request each: (dispatch options, argument changes).
CONFLICTING: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "payload": ({}, {"item": "pen"}),
    "queue": ({"queue": "window-elsewhere"}, {}),
    "routing_key": ({"routing_key": "window-elsewhere"}, {}),
    "priority": ({"priority": 5}, {}),
    "countdown": ({"countdown": 30}, {}),
    "eta": ({"eta": datetime.now(timezone.utc) + timedelta(hours=1)}, {}),
    "headers": ({"headers": {"tenant": "t-2"}}, {}),
    "link": ({"link": signature("window.callback")}, {}),
    "link_error": ({"link_error": signature("window.callback")}, {}),
}


@pytest.mark.parametrize("difference", CONFLICTING)
def test_different_request_is_a_conflict_and_publishes_nothing(
    difference: str,
    celery_app: Celery,
    store: RedisStore,
    runs: Runs,
    published: list[str],
) -> None:
    """Same window key, different payload/routing/priority/start/headers/callbacks: conflict."""
    order = define_order(celery_app, runs)
    key = window_key(order.name, "req-c")
    request = {"request_id": "req-c", "item": "book"}
    base = {"headers": {"tenant": "t-1"}}
    first = order.apply_async(kwargs=request, **base)
    fingerprint = held_window(store, key, first.id).fingerprint

    options, changed = CONFLICTING[difference]
    with pytest.raises(UniquenessConflict) as caught:
        order.apply_async(kwargs={**request, **changed}, **{**base, **options})
    assert caught.value.code == "uniqueness_conflict"
    assert caught.value.conflicting_job_id == first.id
    assert published == [first.id]
    assert held_window(store, key, first.id).fingerprint == fingerprint
    # The identical request is still a plain reuse.
    assert_reused_window(order.apply_async(kwargs=request, **base), first.id)


def policies() -> tuple[dict[str, Any], dict[str, Any]]:
    """Retry and time-limit settings of a first request, and a different value for each."""
    in_an_hour = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=1)
    first = {"time_limit": 100, "soft_time_limit": 90, "expires": in_an_hour, "max_retries": 3}
    drifted = {
        "time_limit": 200,
        "soft_time_limit": 80,
        "expires": in_an_hour + timedelta(hours=1),
        "max_retries": 5,
    }
    return first, drifted


def test_retry_and_time_limit_differences_are_drift_not_conflict(
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    runs: Runs,
    published: list[str],
) -> None:
    """Other time_limit/soft_time_limit/expires/max_retries: reused, policy_drift; job unchanged."""

    @celery_app.task(
        shared=False,
        base=UniqueTask,
        bind=True,
        name="window.limited",
        unique_window_key=lambda job: job.request_id,
        unique_window=WINDOW_S,
    )
    def limited(self: Any, request_id: str) -> Any:
        runs.mark(request_id)
        return {"timelimit": list(self.request.timelimit or ()), "expires": self.request.expires}

    celery_worker.reload()
    policy, drifted_policy = policies()
    jobs = {}
    for setting, value in drifted_policy.items():
        request = f"req-{setting}"
        jobs[setting] = first = limited.apply_async((request,), **policy)
        assert_created(first)
        digest = held_window(store, window_key(limited.name, request), first.id).policy
        assert_reused_window(limited.apply_async((request,), **policy), first.id)
        drifted = limited.apply_async((request,), **{**policy, setting: value})
        assert_reused_window(drifted, first.id, drift=True)
        assert held_window(store, window_key(limited.name, request), first.id).policy == digest

    for setting, first in jobs.items():
        received = first.get(timeout=TIMEOUT_S)
        assert received["timelimit"] == [policy["time_limit"], policy["soft_time_limit"]]
        assert datetime.fromisoformat(received["expires"]) == policy["expires"]
        assert runs.count(f"req-{setting}") == 1
    assert published == [job.id for job in jobs.values()]


def define_transfer(app: Celery, runs: Runs) -> Any:
    """A task with both keys: the account (active while it runs) and the request id (window)."""

    @app.task(
        shared=False,
        base=UniqueTask,
        name="window.transfer",
        unique_key=lambda job: f"account:{job.account}",
        unique_while="active",
        unique_window_key=lambda job: job.request_id,
        unique_window=WINDOW_S,
    )
    def transfer(account: str, request_id: str, amount: int) -> int:
        runs.mark(request_id)
        wait_for_go(runs.client, request_id)
        return amount

    return transfer


@pytest.fixture
def transfer(celery_app: Celery, celery_worker: WorkController, runs: Runs) -> Any:
    """The transfer task, known to the running worker."""
    task = define_transfer(celery_app, runs)
    celery_worker.reload()
    return task


def test_new_window_key_links_to_the_job_holding_the_active_key(
    transfer: Any, store: RedisStore, runs: Runs, published: list[str], redis_client: Any
) -> None:
    """A new request meeting a held active key gets its job (ACTIVE), and (WINDOW) after it ends."""
    account = active_key(transfer.name, "account:acc-1")

    first = transfer.delay("acc-1", "req-1", 10)
    assert_created(first)
    eventually(lambda: started(redis_client, "req-1"), what="the first transfer to run")
    linked = transfer.delay("acc-1", "req-2", 20)
    assert (linked.disposition, linked.duplicate_match, linked.id) == (
        Disposition.REUSED,
        DuplicateMatch.ACTIVE,
        first.id,
    )
    held_window(store, window_key(transfer.name, "req-2"), first.id)

    go(redis_client, "req-1")
    assert first.get(timeout=TIMEOUT_S) == 10
    eventually(lambda: store.get(account) is None, what="the account key to be released")
    # The client retries req-2: the window key still finds the job it was linked to.
    assert_reused_window(transfer.delay("acc-1", "req-2", 20), first.id)
    held_window(store, window_key(transfer.name, "req-2"), first.id)
    assert (runs.count("req-1"), runs.count("req-2")) == (1, 0)
    assert published == [first.id]


def test_window_and_active_key_on_different_jobs_is_a_composition_conflict(
    transfer: Any, store: RedisStore, published: list[str], redis_client: Any
) -> None:
    """A window key naming one job while another holds the active key: composition conflict."""
    account = active_key(transfer.name, "account:acc-2")

    earlier = transfer.delay("acc-2", "req-x", 1)
    go(redis_client, "req-x")
    assert earlier.get(timeout=TIMEOUT_S) == 1
    eventually(lambda: store.get(account) is None, what="the account key to be released")
    later = transfer.delay("acc-2", "req-y", 2)
    assert_created(later)
    eventually(lambda: started(redis_client, "req-y"), what="the later transfer to run")

    with pytest.raises(CompositionConflict) as caught:
        transfer.delay("acc-2", "req-x", 1)
    assert caught.value.code == "uniqueness_composition_conflict"
    assert caught.value.conflicting_job_ids == (earlier.id, later.id)
    assert published == [earlier.id, later.id]
    held_window(store, window_key(transfer.name, "req-x"), earlier.id)
    held = store.get(account)
    assert held is not None
    assert held.job_id == later.id

    go(redis_client, "req-y")
    assert later.get(timeout=TIMEOUT_S) == 2
    eventually(lambda: store.get(account) is None, what="the account key to be released")
    assert_reused_window(transfer.delay("acc-2", "req-x", 1), earlier.id)
    assert published == [earlier.id, later.id]


@pytest.mark.parametrize(
    "window",
    [
        pytest.param(0, id="zero"),
        pytest.param(-1, id="negative"),
        pytest.param(timedelta(seconds=-5), id="negative-timedelta"),
        pytest.param(0.0005, id="half-a-millisecond"),
        pytest.param(1.0001, id="fractional-ms"),
        pytest.param(timedelta(microseconds=1500), id="fractional-ms-timedelta"),
        pytest.param(timedelta(days=3650, milliseconds=1), id="over-3650-days"),
        pytest.param(3650 * 86_400 + 1, id="over-3650-days-seconds"),
        pytest.param(float("nan"), id="nan"),
        pytest.param(float("inf"), id="infinite"),
        pytest.param(True, id="bool"),
        pytest.param("60", id="str"),
        pytest.param(None, id="missing"),
    ],
)
def test_invalid_window_per_dispatch_writes_and_publishes_nothing(
    window: Any,
    celery_app: Celery,
    store: RedisStore,
    published: list[str],
) -> None:
    """A window missing, ≤ 0, not whole ms or over 3,650 days: invalid_window; nothing written."""

    @celery_app.task(shared=False, base=UniqueTask, name="window.plain")
    def plain(value: int) -> int:
        return value

    options = {} if window is None else {"unique_window": window}
    with pytest.raises(InvalidWindow) as caught:
        plain.apply_async((1,), unique_window_key="req-w", **options)
    assert caught.value.code == "invalid_window"
    assert keys_of(store, plain.name) == []
    assert published == []

    # The longest window there is (3,650 days) is accepted and stored as such.
    longest = plain.apply_async((1,), unique_window_key="req-w", unique_window=timedelta(days=3650))
    assert_created(longest)
    held = held_window(store, window_key(plain.name, "req-w"), longest.id)
    assert held.expires_in_ms is not None
    assert 0 < held.expires_in_ms <= 3650 * 86_400_000
    assert published == [longest.id]
