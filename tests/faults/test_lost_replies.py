"""A decision whose reply is lost holds no key for long: it is undone as soon as the store answers.

The producer reaches the store through a loopback fault proxy
(``tests.faultproxy``) that loses the reply of the decide script after the
server ran it: dropped, reset, or held back by a paused network. The
dispatch raises ``backend_unavailable`` (nothing is published); the key the
script wrote points at a job that does not exist; the library undoes it in
the background (``CLIENT KILL`` of the connection that carried the request,
then a rollback by job id), and the next dispatch creates a job within
seconds instead of being handed the phantom for the whole lease.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_unique import BackendUnavailable, Disposition, dispatch_many
from celery_unique.keys import keyspace
from celery_unique.stores import cleanup
from tests.faultproxy import FaultProxy
from tests.processes import RedisServer

from ._apps import JOB, Spec
from .conftest import eventually, open_store, producer, queue_length, task_of

pytestmark = [pytest.mark.slow, pytest.mark.alone]

#: The store client's socket timeout: how long a dispatch waits for a lost reply.
TIMEOUT_S = 1.0
#: How soon after the store answers again the phantom must be gone.
UNDONE_WITHIN_S = 5.0


@pytest.fixture
def spec(make_spec: Callable[..., Spec], proxy: FaultProxy) -> Spec:
    """Store reached through the proxy, with a short socket timeout; broker and marks direct."""
    return make_spec(store_url=f"{proxy.url(0)}?socket_timeout={TIMEOUT_S}")


def storage_key(spec: Spec, key: str) -> str:
    return keyspace.storage_key(spec.namespace, keyspace.ACTIVE, JOB, key)


def warm(task: Any, key: str) -> None:
    """One dispatch to open the producer's connection (its handshake has replies too)."""
    assert task.apply_async(unique_key=f"warm-{key}", unique_while="active").disposition is (
        Disposition.CREATED
    )


@pytest.mark.parametrize("fault", ["drop", "reset", "pause"])
def test_a_lost_decision_is_undone_and_the_next_dispatch_creates(
    fault: str, spec: Spec, proxy: FaultProxy, services: RedisServer
) -> None:
    """Reply dropped, reset or held past the timeout: backend_unavailable, then the key is freed."""
    key = f"lost-{fault}"
    with producer(spec) as app, open_store(services.url(0)) as store:
        task = task_of(app)
        warm(task, key)
        published = queue_length(spec)
        if fault == "drop":
            proxy.drop_replies(1)
        elif fault == "reset":
            proxy.reset_on_reply(1)
        else:
            proxy.pause()
        with pytest.raises(BackendUnavailable) as lost:
            task.apply_async(unique_key=key, unique_while="active")
        assert lost.value.maybe_applied
        if fault == "pause":
            time.sleep(0.5)  # the undo cannot get through either
            proxy.resume()
        answered = time.monotonic()
        eventually(
            lambda: store.get(storage_key(spec, key)) is None,
            UNDONE_WITHIN_S,
            "the lost decision to be undone",
        )
        undone_after = time.monotonic() - answered
        # It stays undone: the undo is over (it cut off the connection that carried the
        # lost request first), so the late request, if any, can no longer land.
        assert cleanup.flush(UNDONE_WITHIN_S)
        assert store.get(storage_key(spec, key)) is None
        again = task.apply_async(unique_key=key, unique_while="active")
        assert again.disposition is Disposition.CREATED
        assert queue_length(spec) == published + 1, "the failed dispatch published nothing"
    print(f"\n{fault}: undone {undone_after:.2f} s after the store answered again")


def test_fail_open_publishes_and_still_undoes_the_lost_decision(
    make_spec: Callable[..., Spec], proxy: FaultProxy, services: RedisServer
) -> None:
    """Fail-open: the job goes out without uniqueness; what the lost request wrote is undone."""
    spec = make_spec(store_url=f"{proxy.url(0)}?socket_timeout={TIMEOUT_S}", fail_open=True)
    with producer(spec) as app, open_store(services.url(0)) as store:
        task = task_of(app)
        warm(task, "open")
        published = queue_length(spec)
        proxy.drop_replies(1)
        sent = task.apply_async(unique_key="open", unique_while="active")
        assert sent.disposition is Disposition.CREATED
        assert queue_length(spec) == published + 1
        eventually(lambda: store.get(storage_key(spec, "open")) is None, UNDONE_WITHIN_S)


def test_a_lost_batch_decision_is_undone_whole(
    spec: Spec, proxy: FaultProxy, services: RedisServer
) -> None:
    """dispatch_many's one script call lost: every key it wrote is freed again."""
    with producer(spec) as app, open_store(services.url(0)) as store:
        task = task_of(app)
        warm(task, "batch")
        keys = [f"batch-{n}" for n in range(50)]
        proxy.drop_replies(1)
        with pytest.raises(BackendUnavailable):
            dispatch_many([task.s().set(unique_key=key, unique_while="active") for key in keys])
        eventually(
            lambda: all(store.get(storage_key(spec, key)) is None for key in keys),
            UNDONE_WITHIN_S,
            "every key of the lost batch to be freed",
        )
