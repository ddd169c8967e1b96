"""Store and broker on one Redis server: a created dispatch is one script call in all.

The producer reaches that server through a loopback proxy that logs every
command and can lose replies, so these tests see what goes over the wire.
The messages the script enqueues are compared byte for byte with what
kombu's own Redis transport writes for the same dispatch, over a few
thousand randomized dispatches (queues, exchanges, routing keys, priorities,
headers, ETAs, expiry); the version matrix runs this on every supported kombu.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any

import gevent
import pytest
import redis
from celery import signals
from kombu import Exchange, Producer, Queue

from celery_unique import (
    BackendUnavailable,
    Disposition,
    ImproperlyConfigured,
    dispatch_many,
)
from celery_unique import config as unique_config
from celery_unique.stores import cleanup
from tests.faultproxy import FaultProxy
from tests.processes import RedisServer

from ._apps import Spec
from .conftest import eventually, job_key, producer, task_of

pytestmark = pytest.mark.slow

#: Commands a client may send while it opens a connection.
SETUP = {"HELLO", "CLIENT", "SELECT", "AUTH", "PING", "INFO"}


def broker_of(services: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(services.url(1))


def sent_by(proxy: FaultProxy, dispatch: Callable[[], Any]) -> tuple[Any, list[str]]:
    before = len(proxy.command_log())
    result = dispatch()
    return result, [name for name in proxy.command_log()[before:] if name not in SETUP]


def owes_nothing() -> None:
    """Whatever this process owed the store in the background (the undo of a decision
    whose reply was lost, every repeat of it; a rollback) has been sent."""
    assert cleanup.flush(UNDONE_WITHIN_S), "writes still owed to the store"


#: Longer than every repeat of a lost decision's undo takes.
UNDONE_WITHIN_S = sum(cleanup.UNDO_REPEATS_S) + 10.0


def warm(task: Any) -> None:
    # Opens the store's and the broker's connections (their handshakes are commands too).
    for n in range(2):
        task.apply_async(unique_key=f"warm-{n}", unique_while="active")


def test_a_created_dispatch_is_one_script_call_and_a_duplicate_builds_no_message(
    spec: Spec, proxy: FaultProxy, services: RedisServer
) -> None:
    broker = broker_of(services)
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        queued = broker.llen(spec.queue)
        created, commands = sent_by(proxy, lambda: task.apply_async(unique_key="one"))
        assert created.disposition is Disposition.CREATED
        assert commands == ["EVALSHA"], "the decision carried the message: no LPUSH of its own"
        assert broker.llen(spec.queue) == queued + 1
        message = json.loads(broker.lindex(spec.queue, 0))
        assert message["headers"]["id"] == created.id
        reused, commands = sent_by(proxy, lambda: task.apply_async(unique_key="one"))
        assert reused.disposition is Disposition.REUSED
        assert reused.id == created.id
        assert commands == ["EVALSHA"]
        assert broker.llen(spec.queue) == queued + 1, "a duplicate enqueues nothing"
        # A key found held is asked about before any message is built, and a
        # fresh key goes back to the one-call path.
        again, commands = sent_by(proxy, lambda: task.apply_async(unique_key="one"))
        assert again.disposition is Disposition.REUSED
        assert commands == ["EVALSHA"]
        fresh, commands = sent_by(proxy, lambda: task.apply_async(unique_key="two"))
        assert fresh.disposition is Disposition.CREATED
        assert commands == ["EVALSHA"]


def test_a_key_found_held_that_was_freed_is_created_by_asking_first(
    spec: Spec, proxy: FaultProxy, services: RedisServer
) -> None:
    broker = broker_of(services)
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        first = task.apply_async(unique_key="freed")
        assert task.apply_async(unique_key="freed").disposition is Disposition.REUSED
        redis.Redis.from_url(services.url(0)).delete(job_key(spec, "freed"))
        queued = broker.llen(spec.queue)
        created, commands = sent_by(proxy, lambda: task.apply_async(unique_key="freed"))
        assert created.disposition is Disposition.CREATED
        assert created.id != first.id
        assert commands == ["EVALSHA", "LPUSH"], "asked first (held recently), then published"
        assert broker.llen(spec.queue) == queued + 1


def new_messages(broker: redis.Redis, queue: str, before: int) -> list[dict[str, Any]]:
    """The messages pushed since the queue held ``before``, oldest first."""
    raw = broker.lrange(queue, 0, -1)
    return [json.loads(m) for m in reversed(raw[: len(raw) - before])]


#: The keys' holders (db 0) and the queue (``ARGV[1]`` of db ``ARGV[2]``) read in one step:
#: a script held back by a fault may still run at any moment, and must not run between
#: the reads.
SNAPSHOT = """
local held = {}
for i, key in ipairs(KEYS) do held[i] = redis.call("GET", key) or "" end
redis.call("SELECT", ARGV[2])
return {held, redis.call("LRANGE", ARGV[1], 0, -1)}
"""


def holders_and_messages(
    services: RedisServer, stored: list[str], queue: str, before: int
) -> tuple[list[str], list[dict[str, Any]]]:
    """The jobs holding ``stored`` (held ones only) and the messages pushed since the queue
    held ``before``, oldest first, as they were at one moment."""
    client = redis.Redis.from_url(services.url(0))
    try:
        held, raw = client.eval(SNAPSHOT, len(stored), *stored, queue, 1)
    finally:
        client.close()
    holders = [value.split(b"\x1f")[2].decode() for value in held if value]
    return holders, [json.loads(m) for m in reversed(raw[: len(raw) - before])]


def dispatch(task: Any, keys: list[str]) -> Any:
    """One dispatch for one key, a ``dispatch_many`` batch for more."""
    if len(keys) == 1:
        return task.apply_async(unique_key=keys[0], unique_while="active")
    return dispatch_many([task.s().set(unique_key=k, unique_while="active") for k in keys])


@pytest.mark.parametrize("size", [1, 20])
@pytest.mark.parametrize("fault", ["drop", "reset", "pause"])
def test_a_lost_reply_never_parts_a_key_from_its_message(
    fault: str, size: int, spec: Spec, proxy: FaultProxy, services: RedisServer
) -> None:
    """The script ran or it did not: every key and its message exist together, or none
    does (one dispatch, or a ``dispatch_many`` batch)."""
    broker = broker_of(services)
    keys = [f"lost{n}" for n in range(size)]
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        queued = broker.llen(spec.queue)
        {"drop": lambda: proxy.drop_replies(1), "reset": lambda: proxy.reset_on_reply(1),
         "pause": proxy.pause}[fault]()  # fmt: skip
        with pytest.raises(BackendUnavailable) as lost:
            dispatch(task, keys)
        assert lost.value.maybe_applied
        if fault == "pause":
            proxy.resume()
        owes_nothing()  # an undo of the lost decision, had one been owed, was sent
        # The paused request may still reach the server as this reads: read in one step.
        stored = [job_key(spec, k) for k in keys]
        holders, messages = holders_and_messages(services, stored, spec.queue, queued)
        assert holders == [m["headers"]["id"] for m in messages]
        assert len(messages) in (0, size)
        if messages:
            # The job exists: the caller's retry is handed it.
            again = task.apply_async(unique_key=keys[0], unique_while="active")
            assert again.disposition is Disposition.REUSED
            assert again.id == messages[0]["headers"]["id"]
        print(f"\n{fault}: script {'ran' if messages else 'did not run'}")


def test_a_drop_of_the_reply_after_the_script_ran_keeps_key_and_message(
    spec: Spec, proxy: FaultProxy, services: RedisServer
) -> None:
    """The case a separate store undoes: here the job exists and must keep its key."""
    broker, store = broker_of(services), redis.Redis.from_url(services.url(0))
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        queued = broker.llen(spec.queue)
        proxy.drop_replies(1)
        with pytest.raises(BackendUnavailable):
            task.apply_async(unique_key="kept", unique_while="active")
        owes_nothing()
        assert store.get(job_key(spec, "kept")) is not None, "the enqueued job lost its key"
        assert broker.llen(spec.queue) == queued + 1


class Wire:
    """What one dispatch wrote to the broker's database: list name -> new messages."""

    def __init__(self, client: redis.Redis, queues: list[Queue], steps: int) -> None:
        self.client = client
        # Every list a message can land in: each queue and its priority sub-queues.
        self.lists = [
            f"{queue.name}\x06\x16{step}" if step else queue.name
            for queue in queues
            for step in range(steps)
        ]

    def take(self) -> dict[bytes, list[bytes]]:
        with self.client.pipeline(transaction=True) as pipe:
            for name in self.lists:
                pipe.lrange(name, 0, -1)
            pipe.delete(*self.lists)
            *found, _ = pipe.execute()
        return {name.encode(): got for name, got in zip(self.lists, found, strict=True) if got}


def without_tag(raw: bytes) -> bytes:
    """The message with what differs from one publish to the next blanked: kombu's
    delivery tag (a UUID4 per publish), the time to live Celery works out from
    ``expires`` and the clock (milliseconds left), and the dispatch's generation (a
    token per dispatch, in the key header)."""
    message = json.loads(raw)
    properties = message["properties"]
    generation = (message["headers"].get("celery_unique") or {}).get("g")
    for varies in (properties["delivery_tag"], properties.get("expiration")):
        if varies is not None:
            needle = f'"{varies}"'.encode()
            raw = raw.replace(needle, b'"' + b"0" * (len(needle) - 2) + b'"')
    if generation is not None:
        # A counter in hex after a prefix: its length varies from one dispatch to the next.
        raw = raw.replace(f'"g": "{generation}"'.encode(), b'"g": "generation"')
    return raw


@dataclass
class Routed:
    """An app whose queues are reached by name, through a direct exchange, and with
    priorities: what one dispatch writes to them, and the colocated path to turn off."""

    app: Any
    task: Any
    rt: Any
    queues: list[Queue]
    wire: Wire
    store: redis.Redis
    colocation: Any

    def written(self, dispatch: Callable[[], Any]) -> tuple[dict[bytes, list[bytes]], ...]:
        """What ``dispatch()`` writes on the one-script path, then asking the store first."""
        written = []
        for path in (self.colocation, None):
            self.rt.colocation = path  # None: ask the store, then let kombu publish
            dispatch()
            written.append(self.wire.take())
        self.rt.colocation = self.colocation
        return tuple(written)


@contextmanager
def routed(spec: Spec, services: RedisServer) -> Iterator[Routed]:
    exchange = Exchange("routed", type="direct")
    queues = [
        Queue(spec.queue),
        Queue(f"{spec.queue}.b", exchange, routing_key="rk.b"),
        Queue(
            f"{spec.queue}.c", exchange, routing_key="rk.c", queue_arguments={"x-max-priority": 9}
        ),
    ]
    wire = Wire(broker_of(services), queues, steps=10)
    changes = {
        "task_queues": queues,
        "broker_transport_options": {"priority_steps": list(range(10))},
    }
    with producer(replace(spec, settings={**spec.settings, **changes})) as app:
        task = task_of(app)
        warm(task)
        rt = unique_config.runtime(app)
        with app.connection_for_write() as connection:
            for queue in queues:  # kombu's binding table for the routed exchange
                queue(connection.default_channel).declare()
        wire.take()
        assert rt.colocation, "store and broker share a server"
        yield Routed(
            app, task, rt, queues, wire, redis.Redis.from_url(services.url(0)), rt.colocation
        )
        client = wire.client
        strays = [
            key for key in client.scan_iter(match=f"{spec.queue}*") if client.type(key) == b"list"
        ]
        assert strays == [], "a message landed where kombu would not have put it"


def same_lists(colocated: dict[bytes, list[bytes]], kombus: dict[bytes, list[bytes]]) -> int:
    """How many messages both paths wrote, list by list, once shown to be the same."""
    assert colocated.keys() == kombus.keys(), (colocated, kombus)
    for name in colocated:
        mine = [without_tag(m) for m in colocated[name]]
        theirs = [without_tag(m) for m in kombus[name]]
        assert mine == theirs, (name, first_difference(mine, theirs))
    return sum(len(messages) for messages in colocated.values())


def test_messages_are_byte_for_byte_what_kombu_writes(spec: Spec, services: RedisServer) -> None:
    """Thousands of randomized dispatches through both paths land identically."""
    rng = random.Random(20261201)
    with routed(spec, services) as bench:
        compared = dropped = 0
        lists: set[bytes] = set()
        for n in range(2000):
            options = random_options(rng, n, bench.queues)
            args = (n, "é" * rng.randint(0, 3))

            def dispatch(n: int = n, options: dict[str, Any] = options, args: Any = args) -> None:
                bench.store.delete(job_key(spec, f"k{n}"))
                sent = bench.task.apply_async(
                    args, unique_key=f"k{n}", task_id=f"job-{n}", **options
                )
                assert sent.disposition is Disposition.CREATED

            colocated, separate = bench.written(dispatch)
            compared += same_lists(colocated, separate)
            lists |= colocated.keys()
            dropped += not colocated
        # Celery routes an explicit exchange with the queue's name as routing key, which
        # no binding matches: kombu drops those messages on both paths alike.
        assert compared + dropped == 2000
        assert compared > 1500, (compared, dropped)
        assert len(lists) >= 20, "queues, exchanges and priority sub-queues all covered"


def first_difference(mine: list[bytes], kombus: list[bytes]) -> tuple[bytes, bytes]:
    for a, b in zip(mine, kombus, strict=False):
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if at is not None or len(a) != len(b):
            at = min(len(a), len(b)) if at is None else at
            return a[max(0, at - 60) : at + 60], b[max(0, at - 60) : at + 60]
    return b"", b""


def random_options(rng: random.Random, n: int, queues: list[Queue]) -> dict[str, Any]:
    now = datetime(2030, 1, 1, tzinfo=timezone.utc)
    options: dict[str, Any] = {}
    queue = rng.choice(queues)
    how = rng.randrange(3)
    if how == 0:
        options["queue"] = queue.name
    elif how == 1 and queue.routing_key:
        options.update(exchange="routed", routing_key=queue.routing_key)
    if rng.random() < 0.6:
        options["priority"] = rng.randint(0, 9)
    if rng.random() < 0.4:
        options["headers"] = {f"h{rng.randrange(5)}": rng.choice(["x", 1, None, [1, "ü"]])}
    if rng.random() < 0.3:
        options["eta"] = now + timedelta(seconds=rng.randint(1, 10_000))
    if rng.random() < 0.3:
        options["expires"] = now + timedelta(days=rng.randint(1, 30))
    if rng.random() < 0.2:
        options["shadow"] = f"shadow-{n % 7}"
    return options


def test_the_path_is_taken_only_where_it_is_exact(
    make_spec: Callable[..., Spec],
    proxy: FaultProxy,
    services: RedisServer,
    redis_server: Callable[..., RedisServer],
) -> None:
    """Off by setting, beside a foreign before_task_publish receiver, for a queue kombu
    expires, and a connection to another server (another redis-server on the same host):
    asked first. (A fanout exchange: tests/faults/test_colocated_routing.py.)"""
    broker = broker_of(services)
    expiring = "expiring"
    changes = {"task_queues": [Queue(expiring, expires=600.0)]}

    def spec_with(**settings: Any) -> Spec:
        return make_spec(
            broker_url=proxy.url(1), store_url=proxy.url(0), settings={**changes, **settings}
        )

    def creates_in(task: Any, publish: str | None, key: str, **options: Any) -> None:
        """A first dispatch declares the queue; the second is measured."""
        task.apply_async(unique_key=f"{key}-declare", **options)
        created, commands = sent_by(proxy, lambda: task.apply_async(unique_key=key, **options))
        assert created.disposition is Disposition.CREATED
        if publish is None:
            assert commands == ["EVALSHA"], commands
        else:
            # Asked first (kombu may read its routing table before), then published.
            assert commands.count("EVALSHA") == 1, commands
            assert publish in commands[commands.index("EVALSHA") :], commands

    with producer(spec_with(unique_colocated=False)) as app:
        task = task_of(app)
        warm(task)
        creates_in(task, "LPUSH", "off")
        assert not unique_config.runtime(app).colocation

    with producer(spec_with()) as app:
        task = task_of(app)
        warm(task)
        creates_in(task, None, "on")
        creates_in(task, "LPUSH", "x-expires", queue=expiring)
        seen: list[str] = []

        def foreign(sender: Any = None, headers: Any = None, **_: Any) -> None:
            seen.append(headers["id"])

        signals.before_task_publish.connect(foreign, weak=False, dispatch_uid="test.foreign")
        try:
            creates_in(task, "LPUSH", "foreign")
            assert task.apply_async(unique_key="foreign").disposition is Disposition.REUSED
            assert len(seen) == 2, "the signal fired for a dispatch that published nothing"
        finally:
            signals.before_task_publish.disconnect(dispatch_uid="test.foreign")
        # Same host, another port: another server, which the store's script cannot reach.
        elsewhere = redis_server()
        other = app.connection_for_write(elsewhere.url(1))
        queued = broker.llen(app.conf.task_default_queue)
        with other:
            created, commands = sent_by(
                proxy, lambda: task.apply_async(unique_key="given", connection=other)
            )
        assert created.disposition is Disposition.CREATED
        assert commands == ["EVALSHA"]  # the decision; kombu published to the other server
        assert broker.llen(app.conf.task_default_queue) == queued
        assert [
            json.loads(message)["headers"]["id"]
            for message in redis.Redis.from_url(elsewhere.url(1)).lrange(
                app.conf.task_default_queue, 0, -1
            )
        ] == [created.id]


def test_a_broker_on_another_server_of_the_same_host_is_asked_first(
    make_spec: Callable[..., Spec],
    proxy: FaultProxy,
    services: RedisServer,
    redis_server: Callable[..., RedisServer],
) -> None:
    """Store on one redis-server, the app's broker on another of the same host (another
    port): no shared server, so every dispatch and batch asks the store, which gets
    decisions only, and the messages land on the broker's server."""
    elsewhere = redis_server()
    spec = make_spec(broker_url=elsewhere.url(1), store_url=proxy.url(0))
    store, other = broker_of(services), redis.Redis.from_url(elsewhere.url(1))
    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        queued = other.llen(spec.queue)
        created, commands = sent_by(proxy, lambda: task.apply_async(unique_key="one"))
        assert created.disposition is Disposition.CREATED
        batch, batch_commands = sent_by(
            proxy, lambda: dispatch_many([task.s().set(unique_key=k) for k in ("two", "three")])
        )
        assert [r.disposition for r in batch] == [Disposition.CREATED] * 2
        colocation = unique_config.runtime(app).colocation
    assert (commands, batch_commands) == (["EVALSHA"], ["EVALSHA"]), "decisions only"
    assert store.llen(spec.queue) == 0, "a message was pushed to the store's server"
    assert [m["headers"]["id"] for m in new_messages(other, spec.queue, queued)] == [
        created.id,
        *(r.id for r in batch),
    ]
    assert colocation is None


def test_a_worker_runs_what_the_script_enqueued(
    spec: Spec, start_worker: Callable[..., Any], services: RedisServer
) -> None:
    """A real prefork worker consumes the message and frees the key at the end."""
    store = redis.Redis.from_url(services.url(0))
    with producer(spec) as app:
        task = task_of(app)
        created = task.apply_async(unique_key="ran", unique_while="active")
        assert created.disposition is Disposition.CREATED
        assert store.get(job_key(spec, "ran")) is not None
        start_worker(spec)
        eventually(lambda: store.get(job_key(spec, "ran")) is None, 30.0, "the job to run and end")


def test_unique_colocated_refuses_other_values(spec: Spec) -> None:
    with (
        producer(replace(spec, settings={"unique_colocated": "maybe"})) as app,
        pytest.raises(ImproperlyConfigured, match="unique_colocated"),
    ):
        unique_config.runtime(app)


@pytest.mark.parametrize(
    "failure", [RuntimeError, KeyboardInterrupt, gevent.Timeout], ids=lambda f: f.__name__
)
def test_a_failure_after_the_message_was_enqueued_keeps_its_key(
    spec: Spec,
    services: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    failure: type[BaseException],
) -> None:
    """kombu's publish raises once the message is in the queue (an error, a Ctrl-C,
    gevent's ``Timeout``): the job exists, so its key stays, and the caller gets what was
    raised (a store asked first rolls its key back: there, nothing was sent)."""
    broker, store = broker_of(services), redis.Redis.from_url(services.url(0))
    publish = Producer.publish
    raised = failure()

    def publish_then_fail(self: Producer, *args: Any, **kwargs: Any) -> Any:
        publish(self, *args, **kwargs)
        raise raised

    with producer(spec) as app:
        task = task_of(app)
        warm(task)
        queued = broker.llen(spec.queue)
        monkeypatch.setattr(Producer, "publish", publish_then_fail)
        with pytest.raises(failure) as caught:
            task.apply_async(unique_key="after", unique_while="active")
        monkeypatch.undo()
        assert caught.value is raised
        assert broker.llen(spec.queue) == queued + 1
        held = store.get(job_key(spec, "after"))
        assert held is not None, "the enqueued job's key was rolled back"
        message = json.loads(broker.lindex(spec.queue, 0))
        assert message["headers"]["id"].encode() in held
