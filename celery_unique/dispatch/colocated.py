"""One round trip for a whole dispatch when the store and a Redis broker are one server.

The most common Celery deployment has its broker and its uniqueness store on
one Redis server. There, a created dispatch need not ask the store and then
publish: Celery and kombu build the message exactly as always, and where
kombu's Redis transport would ``LPUSH`` it, the store's decide script pushes
it instead, in the same atomic step that reserves its keys. Nothing about the
message changes: kombu computes the queue's name (priority sub-queue, global
key prefix) and serializes the message; only the command that carries it is
the script's. A reservation never exists without its message, nor a message
without its reservation, even when the store's reply is lost.

The path is taken only where it is exact; every other dispatch asks the store
first, as on any other deployment:

* the app's broker is kombu's Redis transport (not Sentinel) on the server
  the store uses (same host and port, or same socket; any database), reached
  the same way (TLS or not) as the same user with the same password (the
  script that pushes the message runs with the store's rights), the store is
  a plain Redis store, and ``unique_colocated`` is not ``False``;
* the producer's channel really is such a channel (``connection=`` may name
  another broker), and its publish is one ``_put`` of kombu's (not a fanout
  exchange, a batch, or a queue with ``x-expires``, whose extra commands
  kombu sends itself);
* no ``before_task_publish`` receiver but this package's own is connected:
  the message is built before the store has answered, so that signal would
  fire for a dispatch that then publishes nothing;
* the dispatch's keys were not found held recently in this process
  (:mod:`celery_unique.config.recently_held`): a duplicate asks first, and is
  answered before a message is built.

``dispatch_many`` goes further on such a server: every item's message is
built first and noted where kombu would push it, then one script decides the
whole batch and pushes the messages of the jobs it created (and of items
without uniqueness), in order. A batch that could not be exact
(:func:`suits_batch`, or a message kombu must send itself) asks the store
first and publishes in one kombu batch instead.

The same hold on a channel serves every deployment with a Redis broker: a
unique job's message that kombu does publish goes through one redis-py
client the channel keeps, where kombu would build one per command
(:func:`unique_message`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from celery import signals

if TYPE_CHECKING:
    from celery import Celery

    from celery_unique.config import Runtime
    from celery_unique.dispatch.gate import Gate

logger = logging.getLogger("celery_unique.dispatch.colocated")

#: How this package's own signal receivers are named (``dispatch_uid``): they may
#: see a dispatch that then publishes nothing.
OWN_RECEIVERS = "celery_unique."


@dataclass(frozen=True, slots=True)
class Colocation:
    """The server the store and the broker share."""

    server: tuple[Any, ...]
    #: What the startup log says of it.
    where: str


def colocation(app: Celery, rt: Runtime) -> Colocation | None:
    """The app's shared server, worked out once per app and process and logged."""
    found = rt.colocation
    if found is False:
        shared = _shared_server(app, rt)
        if isinstance(shared, str):
            logger.info("celery-unique: dispatches ask the store before publishing (%s)", shared)
            found = None
        else:
            logger.info(
                "celery-unique: store and broker share the Redis server %s; a created "
                "dispatch reserves its keys and enqueues its message in one round trip",
                shared.where,
            )
            found = shared
        rt.colocation = found
    return cast("Colocation | None", found)


def _shared_server(app: Celery, rt: Runtime) -> Colocation | str:
    """The server store and broker share, or why they do not."""
    if not rt.colocated:
        return "unique_colocated is False"
    from celery_unique.exceptions import BackendUnavailable
    from celery_unique.stores.redis import RedisStore

    try:
        store = rt.store
    except BackendUnavailable as exc:  # a cluster client asks its nodes as it is built
        return f"the store cannot be opened now ({exc})"
    server = store.server() if isinstance(store, RedisStore) else None
    if server is None:
        return "the store is not a single Redis server"
    try:
        transport = app.connection_for_write().transport
    except Exception as exc:  # an unknown transport name, a missing client library
        return f"the broker's transport cannot be loaded ({exc})"
    kombu_redis = _kombu_redis()
    if kombu_redis is None or type(transport) is not kombu_redis.Transport:
        return f"the broker is not kombu's Redis transport ({type(transport).__name__})"
    broker = _broker_server(transport.client)
    if not _same(server[:3], broker[:3]):
        return "the store and the broker are different Redis servers"
    if not _same(server, broker):
        # The script that pushes a message runs with the store's rights, on the
        # store's connection: only the broker's own user is sure to have them.
        return "the store and the broker connect to their Redis server as different users"
    return Colocation(server, f"{server[2] or f'{server[0]}:{server[1]}'}")


def _broker_server(client: Any) -> tuple[Any, ...]:
    """Where and as whom kombu's Redis transport connects for ``client`` (a kombu
    ``Connection``), as :func:`celery_unique.stores.redis.server_of` tells it of a pool."""
    import hashlib

    host = client.hostname or "127.0.0.1"
    user, password = client.userid or None, client.password or None
    if "://" in host:  # socket://[user:password@]path, as kombu reads it
        from kombu.utils.url import url_to_parts

        parts = url_to_parts(host)
        place: tuple[Any, ...] = (None, 6379, "/" + str(parts.path or "").lstrip("/"))
        user, password = parts.username, parts.password
    else:
        place = (host, int(client.port or 6379), None)
    digest = hashlib.sha256(str(password).encode()).hexdigest() if password else None
    return (*place, bool(client.ssl), user, digest)


def _kombu_redis() -> Any:
    """kombu's Redis transport module if this process loaded it, else ``None``.

    Never imported here: a broker on that transport has loaded it already, and
    importing it otherwise needs what kombu's own ``redis`` extra installs
    (``packaging``), which an app on another broker need not have.
    """
    return sys.modules.get("kombu.transport.redis")


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two servers (and whatever else the tuples name after the place) are one."""
    if a[2] or b[2]:
        place = bool(a[2] == b[2])
    else:
        place = bool(_host(a[0]) == _host(b[0]) and a[1] == b[1])
    return place and a[3:] == b[3:]


def _host(name: Any) -> str:
    name = str(name or "localhost")
    return "127.0.0.1" if name == "localhost" else name


def suits(app: Celery, rt: Runtime) -> bool:
    """Whether a dispatch's decision may wait for its message, to travel with it."""
    return colocation(app, rt) is not None and not _foreign(signals.before_task_publish)


def _foreign(signal: Any) -> bool:
    return any(
        not (isinstance(lookup[0], str) and lookup[0].startswith(OWN_RECEIVERS))
        for lookup, _ in signal.receivers
    )


_armed: ContextVar[Gate | None] = ContextVar("celery_unique_armed", default=None)


def send_armed(gate: Gate, producer: Any, send: Callable[[], Any]) -> Any:
    """``send()`` the gate's job; its decision travels with the message if the channel can."""
    if broker_db(getattr(producer, "channel", None), gate.rt) is None:
        gate.let_out()
        return send()
    token = _armed.set(gate)
    try:
        result = send()
    finally:
        _armed.reset(token)
    if not gate.resolved:
        # No queue is bound where the message was routed: kombu dropped it. The
        # store is asked as it would be on any deployment.
        gate.let_out()
    return result


class Uncapturable(Exception):
    """A message kombu must send itself (a fanout exchange, a queue it expires)."""


#: A batch's messages as kombu would push them: (list, message), in order.
Captured = list[tuple[str, "bytes | str"]]

_captured: ContextVar[Captured | None] = ContextVar("celery_unique_captured", default=None)


def suits_batch(app: Celery, rt: Runtime) -> bool:
    """Whether a batch may build all of its messages before the store decides it, so that
    they travel with its decisions.

    Every message is built, also those of items the store then finds duplicates:
    nothing outside this package may see one go (a ``before_task_publish`` or
    ``after_task_publish`` receiver, a ``task-sent`` event, a parent task's
    trail of children), and none may run eagerly instead.
    """
    conf = app.conf
    return (
        suits(app, rt)
        and not _foreign(signals.after_task_publish)
        and not conf.task_always_eager
        and not conf.task_send_sent_event
        and app.current_worker_task is None
    )


def capturing_now() -> bool:
    return _captured.get() is not None


@contextmanager
def capturing() -> Iterator[Captured]:
    """Within the block, a hooked channel's puts are noted instead of sent."""
    captured: Captured = []
    token = _captured.set(captured)
    try:
        yield captured
    finally:
        _captured.reset(token)


@dataclass(frozen=True, slots=True)
class _Hooked:
    server: tuple[Any, ...]
    db: int


def broker_db(channel: Any, rt: Runtime) -> int | None:
    """The database of ``channel`` if it is a Redis channel on the store's server (and
    hooked), else ``None``."""
    hooked = _hooked(channel)
    colocated = rt.colocation
    if isinstance(hooked, _Hooked) and colocated and _same(colocated.server, hooked.server):
        return hooked.db
    return None


def _hooked(channel: Any) -> _Hooked | None:
    if channel is None:
        return None
    hooked = getattr(channel, "_celery_unique_put", False)
    if hooked is False:
        hooked = channel._celery_unique_put = _hook(channel)
    return cast("_Hooked | None", hooked)


_unique_put: ContextVar[bool] = ContextVar("celery_unique_unique_put", default=False)


@contextmanager
def unique_message(producer: Any) -> Iterator[None]:
    """While the block publishes a unique job's message, its Redis channel lends one client.

    kombu's Redis transport builds a new redis-py client for every command it
    sends, which costs about as much as a dispatch's store round trip; the
    commands are the same from a client kept by the channel. Other messages
    take kombu's way unchanged.
    """
    _hooked(getattr(producer, "channel", None))
    token = _unique_put.set(True)
    try:
        yield
    finally:
        _unique_put.reset(token)


def _hook(given: Any) -> _Hooked | None:
    """Divert a kombu Redis channel's puts to the store while a gate is armed, and lend
    a unique job's message one client."""
    kombu_redis = _kombu_redis()
    if kombu_redis is None or type(given) is not kombu_redis.Channel:
        return None
    from celery_unique.stores.redis import server_of

    channel: Any = given
    pool = channel.pool
    hooked = _Hooked(server_of(pool), int(pool.connection_kwargs.get("db") or 0))
    put, put_fanout = channel._put, channel._put_fanout
    dumps = kombu_redis.dumps

    def _put(queue: str, message: Any, **options: Any) -> Any:
        gate, captured = _armed.get(), _captured.get()
        if captured is None and (gate is None or gate.resolved):
            if gate is not None:
                # kombu retrying the publish: only a decision that lets the job out
                # (or fail-open's none) may; a failed decision raises its error again.
                gate.resolve()
            return put(queue, message, **options)
        expires = getattr(channel, "_expires", None)
        if "_publish_batch" in options or (expires and queue in expires):
            # kombu sends more than the message: it must send it itself.
            if captured is not None:
                raise Uncapturable(queue)
            assert gate is not None
            gate.let_out()
            return put(queue, message, **options)
        key = channel._q_for_pri(queue, channel._get_message_priority(message, reverse=False))
        key = f"{getattr(channel, 'global_keyprefix', '') or ''}{key}"
        payload = dumps(message)
        if captured is not None:
            captured.append((key, payload))
            return None
        assert gate is not None
        claim, store = gate.claim, gate.rt.store
        assert claim is not None
        decision = gate.let_out(
            lambda: store.decide_enqueue(claim, hooked.db, key, payload)  # type: ignore[attr-defined]
        )
        if decision is None:  # the store is down and the app fails open
            return put(queue, message, **options)
        gate.enqueued = True
        return None

    def _put_fanout(exchange: str, message: Any, routing_key: str, **options: Any) -> Any:
        if _captured.get() is not None:
            raise Uncapturable(exchange)
        gate = _armed.get()
        if gate is not None:
            gate.let_out()  # a failed decision raises its error again, on a retry too
        return put_fanout(exchange, message, routing_key, **options)

    create = channel._create_client

    def _create_client(asynchronous: bool = False) -> Any:
        if asynchronous or not _unique_put.get():
            return create(asynchronous)
        kept = channel.__dict__.get("_celery_unique_client")
        # kombu replaces the pool when the connection is lost: a new one, a new client.
        if kept is None or kept.connection_pool is not channel.pool:
            kept = channel._celery_unique_client = create(False)
        return kept

    channel._put, channel._put_fanout = _put, _put_fanout
    channel._create_client = _create_client
    return hooked
