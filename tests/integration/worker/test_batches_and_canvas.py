"""dispatch_many and canvas on real Redis/RabbitMQ with a real worker."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group
from celery.worker import WorkController

from celery_unique import (
    CallbacksNotAttached,
    Disposition,
    GroupMemberReused,
    UniquenessConflict,
    UniqueTask,
    UnsupportedCombination,
    dispatch_many,
)
from celery_unique.config import runtime
from celery_unique.keys.keyspace import namespace_prefix
from celery_unique.stores.redis import RedisStore

from .conftest import NAMESPACE, active_key, eventually


def define_tasks(app: Celery, redis_url: str) -> tuple[Any, Any]:
    """A keyed task that counts its runs, and a windowed order task."""
    counter = redis.Redis.from_url(redis_url)

    @app.task(
        base=UniqueTask,
        name="canvas.count",
        unique_key=lambda job: f"n:{job.n}",
        unique_while="active",
    )
    def count(n: int) -> int:
        counter.incr(f"runs:{n}")
        return n

    @app.task(
        base=UniqueTask,
        name="canvas.order",
        unique_window_key=lambda job: job.rid,
        unique_window=60,
    )
    def order(rid: str, amount: int) -> int:
        return amount

    return count, order


def queue_length(app: Celery, broker: str) -> int:
    """Messages waiting in the app's default queue on the broker."""
    with app.connection_for_write() as connection:
        _, waiting, _ = connection.default_channel.queue_declare(
            app.conf.task_default_queue, passive=True
        )
        return int(waiting)


def test_failed_batch_writes_and_publishes_nothing(
    celery_app: Celery, store: RedisStore, redis_client: Any, redis_url: str, broker: str
) -> None:
    """A conflicting item fails the batch: no key in the store, no message on the broker."""
    count, order = define_tasks(celery_app, redis_url)
    first = order.delay("r1", 10)
    before = queue_length(celery_app, broker)
    keys_before = sorted(h.key for h in store.scan(prefix=namespace_prefix(NAMESPACE)))

    with pytest.raises(UniquenessConflict) as caught:
        dispatch_many([count.s(1), count.s(2), order.s("r1", 11)])
    assert caught.value.index == 2
    assert caught.value.conflicting_job_id == first.id
    assert sorted(h.key for h in store.scan(prefix=namespace_prefix(NAMESPACE))) == keys_before
    assert queue_length(celery_app, broker) == before
    with celery_app.connection_for_write() as connection:
        connection.default_channel.queue_purge(celery_app.conf.task_default_queue)


def test_thousand_item_batch_is_at_most_two_store_round_trips(
    celery_app: Celery,
    store: RedisStore,
    redis_client: Any,
    redis_url: str,
    broker: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1,000 items are decided in one script call (two if the script must be loaded first)."""
    count, _ = define_tasks(celery_app, redis_url)
    app_store = runtime(celery_app).store
    assert isinstance(app_store, RedisStore)
    commands: list[bytes] = []
    pool = app_store.client.connection_pool
    connection_class = pool.connection_class
    send = connection_class.send_packed_command
    store_db = pool.connection_kwargs.get("db", 0)

    def counted(connection: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        # Pooled or the store's own per-thread connection alike; the broker's
        # connections (another database, same class) are not the store's.
        if connection.db == store_db:
            packed = command if isinstance(command, bytes) else b"".join(command)
            commands.append(packed.split(b"\r\n")[2])  # the command's name
        return send(connection, command, *args, **kwargs)

    # A connection's handshake (HELLO, CLIENT SETINFO, SELECT) is not a round
    # trip of the batch: connect first.
    count.s(-1).apply_async()
    monkeypatch.setattr(connection_class, "send_packed_command", counted)
    results = dispatch_many([count.s(i % 500) for i in range(1000)])
    assert 1 <= len(commands) <= 2, commands
    assert set(commands) <= {b"EVALSHA", b"EVAL"}, commands
    assert sum(r.disposition is Disposition.CREATED for r in results) == 500
    assert all(results[i + 500].id == results[i].id for i in range(500))
    with celery_app.connection_for_write() as connection:
        connection.default_channel.queue_purge(celery_app.conf.task_default_queue)


def test_group_members_deduplicate_one_by_one(
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    redis_client: Any,
    redis_url: str,
) -> None:
    """Group members with the same key collapse onto one job, and the caller is warned."""
    count, _ = define_tasks(celery_app, redis_url)
    celery_worker.reload()

    with pytest.warns(GroupMemberReused):
        group(count.s(7), count.s(7), count.s(8)).apply_async()
    eventually(lambda: redis_client.get("runs:8") == b"1", what="member 8 to run")
    eventually(lambda: redis_client.get("runs:7") == b"1", what="member 7 to run")
    eventually(lambda: store.get(active_key(count.name, "n:7")) is None, what="release")
    assert redis_client.get("runs:7") == b"1"


def test_chord_with_a_unique_header_member_is_refused(
    celery_app: Celery, store: RedisStore, redis_client: Any, redis_url: str
) -> None:
    """A unique chord header member could hang the chord: refused before anything is written."""
    count, _ = define_tasks(celery_app, redis_url)
    with pytest.raises(UnsupportedCombination):
        chord([count.s(1), count.s(2)])(count.si(3))
    assert list(store.scan(prefix=namespace_prefix(NAMESPACE))) == []


def test_reused_first_step_of_a_chain_warns(
    celery_app: Celery, store: RedisStore, redis_client: Any, redis_url: str, broker: str
) -> None:
    """A chain whose first step is reused would lose its remaining steps: never silent."""
    count, _ = define_tasks(celery_app, redis_url)
    count.delay(5)
    waiting = queue_length(celery_app, broker)
    with pytest.warns(CallbacksNotAttached):
        chain(count.s(5), count.si(6)).apply_async()
    assert queue_length(celery_app, broker) == waiting
    with celery_app.connection_for_write() as connection:
        connection.default_channel.queue_purge(celery_app.conf.task_default_queue)


def test_task_chaining_to_itself_hands_its_key_on(
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    redis_client: Any,
    redis_url: str,
) -> None:
    """Each step of a self-chain with one key runs: the running step passes the key on."""
    counter = redis.Redis.from_url(redis_url)

    @celery_app.task(
        base=UniqueTask, name="canvas.step", unique_key="pipeline", unique_while="active"
    )
    def step(n: int) -> int:
        counter.incr("steps")
        return n

    celery_worker.reload()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CallbacksNotAttached)
        result = chain(step.si(1), step.si(2), step.si(3)).apply_async()
    assert result.get(timeout=20) == 3
    assert redis_client.get("steps") == b"3"
    eventually(lambda: store.get(active_key(step.name, "pipeline")) is None, what="release")


def define_plain_add(app: Celery) -> Any:
    """A plain task for chord headers and bodies."""

    @app.task(name="canvas.add")
    def add(*numbers: int) -> int:
        return sum(n if isinstance(n, int) else sum(n) for n in numbers)

    return add


def test_chord_with_a_unique_body_is_refused_before_anything_is_sent(
    celery_app: Celery, store: RedisStore, redis_client: Any, redis_url: str, broker: str
) -> None:
    """A unique chord body would be reused, never sent under the chord's id, if its key were
    held when the header ends: the chord is refused before its header leaves."""
    count, _ = define_tasks(celery_app, redis_url)
    add = define_plain_add(celery_app)
    holder = count.apply_async((3,), countdown=60)
    assert holder.disposition is Disposition.CREATED
    waiting = queue_length(celery_app, broker)
    keys = sorted(h.key for h in store.scan(prefix=namespace_prefix(NAMESPACE)))

    bodies = [count.si(3), chain(add.s(), count.si(4)), add.s().set(unique_key="sum")]
    for body in bodies:
        with pytest.raises(UnsupportedCombination) as refused:
            chord([add.s(1), add.s(2)])(body)
        assert refused.value.code == "unsupported_combination"
        assert "body of a chord" in str(refused.value)
    assert queue_length(celery_app, broker) == waiting
    assert sorted(h.key for h in store.scan(prefix=namespace_prefix(NAMESPACE))) == keys
    with celery_app.connection_for_write() as connection:
        connection.default_channel.queue_purge(celery_app.conf.task_default_queue)


def test_chord_with_a_plain_body_still_finishes(
    celery_app: Celery, celery_worker: WorkController, redis_url: str
) -> None:
    """The refusal is of unique bodies only: a chord of plain tasks finishes on a real worker
    with the Redis result backend."""
    add = define_plain_add(celery_app)
    celery_worker.reload()
    assert chord([add.s(1), add.s(2)])(add.s()).get(timeout=20) == 3
