"""Each scope's key is held, then freed at exactly its lifecycle point, on a real worker.

Runs on Redis and on RabbitMQ as broker (see conftest), with the store on Redis.
Jobs block on a gate in Redis so the test can look at the store while they
wait or run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery, signals
from celery.exceptions import MaxRetriesExceededError, Reject
from celery.worker import WorkController

from celery_unique import Disposition, DuplicateMatch, UniqueTask
from celery_unique.dispatch.publishing import install_gate
from celery_unique.stores import cleanup
from celery_unique.stores.redis import RedisStore
from celery_unique.worker.step import follow_fates

from .conftest import active_key, eventually

SCOPES = ["queued", "active", "exists"]
RETENTION_S = 30
#: Long enough to look at the key between a retried attempt and the next one.
RETRY_IN_S = 3.0
#: How long the first job waits in the queue: long enough for a duplicate to meet its key.
QUEUED_FOR_S = 2.0


def define_hold(app: Celery, scope: str, redis_url: str, **options: Any) -> Any:
    """A unique task keyed by ``tag`` that marks each start and waits for its gate."""
    gates = redis.Redis.from_url(redis_url)

    @app.task(
        base=UniqueTask,
        bind=True,
        name=f"lifecycle.hold.{scope}",
        unique_key=lambda job: f"tag:{job.tag}",
        unique_while=scope,
        unique_retention=RETENTION_S,
        **options,
    )
    def hold(self: Any, tag: str, outcome: str = "ok", retry_in: float = 0.1) -> str:
        attempt = self.request.retries
        gates.incr(f"started:{tag}")
        gates.set(f"running:{tag}:{attempt}", 1)
        deadline = time.monotonic() + 20
        while not gates.exists(f"go:{tag}:{attempt}") and time.monotonic() < deadline:
            time.sleep(0.02)
        if outcome == "retry":
            raise self.retry(countdown=retry_in, max_retries=1)
        if outcome == "reject":
            raise Reject("rejected by the test", requeue=False)
        if outcome == "fail":
            raise ValueError("failed for good")
        return tag

    return hold


def started(redis_client: Any, tag: str, attempt: int = 0) -> bool:
    return bool(redis_client.exists(f"running:{tag}:{attempt}"))


def go(redis_client: Any, tag: str, attempt: int = 0) -> None:
    redis_client.set(f"go:{tag}:{attempt}", 1)


def expect_final(store: RedisStore, key: str, scope: str, event: str) -> None:
    """After the job's end: an exists key is kept (finished), any other key is freed."""
    if scope == "exists":
        eventually(lambda: (h := store.get(key)) and h.finished, what=f"retention after {event}")
    else:
        eventually(lambda: store.get(key) is None, what=f"release after {event}")


def expect_held_by(store: RedisStore, key: str, job_id: str) -> None:
    held = store.get(key)
    assert held is not None, f"{key!r} should be held by {job_id}"
    assert held.job_id == job_id


@pytest.mark.parametrize("scope", SCOPES)
def test_success_releases_at_the_scope_point(
    scope: str,
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    redis_client: Any,
    redis_url: str,
) -> None:
    """queued frees at start; active at success; exists keeps the key for its retention."""
    hold = define_hold(celery_app, scope, redis_url)
    celery_worker.reload()
    key = active_key(hold.name, "tag:t1")

    # Due a moment later: a queued key is freed as its job starts, and the worker must
    # not start the job before the duplicate below has met the key.
    first = hold.apply_async(("t1",), countdown=QUEUED_FOR_S)
    assert first.disposition is Disposition.CREATED
    duplicate = hold.delay(tag="t1")
    assert (duplicate.disposition, duplicate.duplicate_match, duplicate.id) == (
        Disposition.REUSED,
        DuplicateMatch.ACTIVE,
        first.id,
    )

    eventually(lambda: started(redis_client, "t1"), what="the job to start")
    if scope == "queued":
        eventually(lambda: store.get(key) is None, what="release at start")
    else:
        expect_held_by(store, key, first.id)

    go(redis_client, "t1")
    assert first.get(timeout=15) == "t1"
    assert redis_client.get("started:t1") == b"1"
    if scope == "exists":
        held = eventually(lambda: (h := store.get(key)) and h.finished and h, what="retention")
        assert held.job_id == first.id
        assert 0 < held.expires_in_ms <= RETENTION_S * 1000
        assert hold.delay("t1").id == first.id
    else:
        eventually(lambda: store.get(key) is None, what="release at success")
        assert hold.delay("t1").id != first.id


@pytest.mark.parametrize("scope", SCOPES)
def test_retry_keeps_or_leaves_the_key_and_final_failure_releases(
    scope: str,
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    redis_client: Any,
    redis_url: str,
) -> None:
    """Between attempts active/exists keys stay held and queued keys stay free; failure releases.

    The key is looked at once the first attempt's end reached the store, while the
    retry still waits for its countdown: the retry's own run would mark the key
    again, and hide a release at the first attempt's end.
    """
    hold = define_hold(celery_app, scope, redis_url)
    celery_worker.reload()
    key = active_key(hold.name, "tag:r1")

    # Only a held key has something to lose between attempts.
    retry_in = 0.1 if scope == "queued" else RETRY_IN_S
    job = hold.delay("r1", outcome="retry", retry_in=retry_in)
    eventually(lambda: started(redis_client, "r1"), what="the first attempt")
    if scope == "queued":
        eventually(lambda: store.get(key) is None, what="release at start")
    else:
        eventually(lambda: (h := store.get(key)) and h.run, what="the first attempt's mark")
    go(redis_client, "r1", 0)
    if scope == "queued":
        eventually(lambda: started(redis_client, "r1", 1), what="the retry to run")
        assert store.get(key) is None
        assert hold.delay("r1").disposition is Disposition.CREATED
    else:
        # The first attempt's end is in the store (no run marks the key, not even the
        # hand-over mark its retry's send leaves), and every write the worker (in
        # this process) owed for it was sent.
        eventually(
            lambda: (h := store.get(key)) is None or h.run is None,
            what="the end of the first attempt's run",
        )
        assert cleanup.flush(RETRY_IN_S)
        assert not started(redis_client, "r1", 1), "the retry ran before the key was looked at"
        expect_held_by(store, key, job.id)
        assert not store.get(key).finished  # type: ignore[union-attr]
        assert hold.delay("r1").id == job.id
    eventually(lambda: started(redis_client, "r1", 1), what="the retry to run")
    go(redis_client, "r1", 1)
    with pytest.raises(MaxRetriesExceededError):
        job.get(timeout=15)
    if scope != "queued":
        expect_final(store, key, scope, "final failure")


@pytest.mark.parametrize("scope", SCOPES)
def test_revoke_before_start_releases(
    scope: str,
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    redis_client: Any,
    redis_url: str,
) -> None:
    """A job revoked while it waits for its ETA frees its key, whatever the scope.

    The worker discards it when the revoke arrives (or at the latest when the
    job would start) and the key is freed then.
    """
    hold = define_hold(celery_app, scope, redis_url)
    celery_worker.reload()
    key = active_key(hold.name, "tag:v1")

    # The worker may receive the job before apply_async returns its id: note every id.
    received: set[str] = set()

    def on_received(request: Any = None, **_: Any) -> None:
        if request is not None:
            received.add(request.id)

    signals.task_received.connect(on_received, weak=False)
    try:
        job = hold.apply_async(("v1",), countdown=4)
        expect_held_by(store, key, job.id)
        eventually(lambda: job.id in received, 10, "the worker to receive the job")

        def revoked() -> bool:
            # A revoke is a broadcast; repeating it is harmless and covers one
            # that reached the worker before its control consumer listened.
            job.revoke()
            time.sleep(0.5)
            held = store.get(key)
            return held is None if scope != "exists" else bool(held and held.finished)

        eventually(revoked, what=f"the key's end after revoke ({scope})")
    finally:
        signals.task_received.disconnect(on_received)
    assert not redis_client.exists("started:v1")


@pytest.mark.parametrize("scope", SCOPES)
def test_expired_job_releases(
    scope: str,
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    redis_client: Any,
    redis_url: str,
) -> None:
    """A job whose ``expires`` passes before it runs frees its key and never runs."""
    hold = define_hold(celery_app, scope, redis_url)
    celery_worker.reload()
    key = active_key(hold.name, "tag:e1")

    job = hold.apply_async(("e1",), countdown=1.5, expires=0.5)
    expect_held_by(store, key, job.id)
    expect_final(store, key, scope, "expiry")
    assert not redis_client.exists("started:e1")


@pytest.mark.parametrize("scope", ["active", "exists"])
def test_reject_releases(
    scope: str,
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    redis_client: Any,
    redis_url: str,
) -> None:
    """A job that rejects its message without requeue has ended: its key is freed."""
    hold = define_hold(celery_app, scope, redis_url)
    celery_worker.reload()
    key = active_key(hold.name, "tag:j1")

    job = hold.delay("j1", outcome="reject")
    eventually(lambda: started(redis_client, "j1"), what="the job to start")
    expect_held_by(store, key, job.id)
    go(redis_client, "j1")
    expect_final(store, key, scope, "reject")


def test_unknown_task_releases(
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    redis_url: str,
) -> None:
    """A job the worker does not know ends without running: its key is freed."""
    producer = Celery("producer", set_as_current=False)
    producer.conf.update(celery_app.conf)
    hold = define_hold(producer, "active", redis_url)
    key = active_key(hold.name, "tag:u1")

    job = hold.delay("u1")
    # Created: the dispatch took the key (the worker may drop the message and free
    # the key before a look at the store could see it held).
    assert job.disposition is Disposition.CREATED
    eventually(lambda: store.get(key) is None, what="release of an unknown task's key")
    assert hold.delay("u1").disposition is Disposition.CREATED


def test_an_error_after_the_replacement_left_keeps_the_key_for_it(
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    redis_client: Any,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    settled: Callable[[str], None],
) -> None:
    """A soft time limit striking as replace()'s send returns: the replacement carries the job."""
    gates = redis.Redis.from_url(redis_url)

    @celery_app.task(name="lifecycle.replacement")
    def replacement(tag: str) -> str:
        gates.set(f"running:{tag}:replacement", 1)
        deadline = time.monotonic() + 20
        while not gates.exists(f"go:{tag}:replacement") and time.monotonic() < deadline:
            time.sleep(0.02)
        return tag

    @celery_app.task(
        base=UniqueTask,
        bind=True,
        name="lifecycle.replaced",
        unique_key=lambda job: f"tag:{job.tag}",
        unique_while="active",
    )
    def replaced(self: Any, tag: str) -> None:
        # Due a second later: the replaced run's end reaches the store first.
        raise self.replace(replacement.s(tag).set(countdown=1.5))

    # A task defined after the worker started gets its fate-following request
    # class when the consumer rebuilds its strategies, which reload() skips.
    follow_fates(celery_app)
    celery_worker.reload()
    install_gate(celery_app)  # the limit strikes past the gate, as the send returns
    send = celery_app.amqp.send_task_message

    def struck_after_send(producer: Any, name: str, message: Any, **options: Any) -> Any:
        sent = send(producer, name, message, **options)
        if name == replacement.name:
            raise SoftTimeLimitExceeded()
        return sent

    monkeypatch.setattr(celery_app.amqp, "send_task_message", struck_after_send)
    key = active_key(replaced.name, "tag:r1")

    first = replaced.delay("r1")
    settled(first.id)  # the replaced run's end, and whatever it owes the store
    assert not gates.exists("running:r1:replacement")
    again = replaced.delay("r1")
    assert (again.disposition, again.id) == (Disposition.REUSED, first.id)
    eventually(lambda: gates.exists("running:r1:replacement"), what="the replacement to run")
    expect_held_by(store, key, first.id)
    gates.set("go:r1:replacement", 1)
    eventually(lambda: store.get(key) is None, what="the release at the replacement's end")
