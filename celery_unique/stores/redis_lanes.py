"""A connection per dispatching thread for the decide script, outside redis-py's pool.

Taking a connection from redis-py's pool and giving it back (locking, pool
bookkeeping, instrumentation) costs more CPU per dispatch than the decide
script itself costs the server. A thread has one decision in flight at a
time, so it can keep one connection of its own. The rare nested decision (a
dispatch made while another one's reply is still unread, e.g. from a routing
function) finds the lane busy and goes through the pool instead.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any


def green_threads() -> bool:
    """Whether gevent or eventlet has replaced thread-local storage (monkey-patching)."""
    return threading.local.__module__ != "_thread"


class Lane:
    """One thread's connection, and whether a reply on it is still unread."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.pid = os.getpid()
        self.busy = False
        #: How the server names this connection (``CLIENT KILL`` filters), learnt at
        #: connect; ``None`` when the server would not say.
        self.identity: tuple[str, ...] | None = None

    def done(self) -> None:
        """The reply was read (or the connection dropped): the lane is free again."""
        self.busy = False


class Lanes:
    def __init__(self, pool: Any) -> None:
        self._pool = pool
        import redis

        self._socket_errors: tuple[type[BaseException], ...] = (
            OSError,
            redis.ConnectionError,
            redis.TimeoutError,
        )
        self._local = threading.local()
        # Every lane's connection, so that close() reaches other threads' too.
        self._connections: weakref.WeakSet[Any] = weakref.WeakSet()

    @staticmethod
    def suits(pool: Any) -> bool:
        """Plain pools only, in a process whose threads are OS threads.

        Sentinel's and caching pools wrap their connections. Under gevent or
        eventlet every greenlet is a "thread": thousands of short-lived ones
        would each open a connection of their own, where the pool shares a few.
        """
        from redis import BlockingConnectionPool, ConnectionPool

        return (
            type(pool) in (ConnectionPool, BlockingConnectionPool)
            and getattr(pool, "cache", None) is None
            and not green_threads()
        )

    def take(self) -> Lane | None:
        """This thread's lane, marked busy; ``None`` when it is busy already."""
        lane: Lane | None = getattr(self._local, "lane", None)
        if lane is None or lane.pid != os.getpid():
            # After a fork the parent's socket is not ours to use (nor to close).
            connection = self._pool.connection_class(**self._pool.connection_kwargs)
            lane = self._local.lane = Lane(connection)
            self._connections.add(connection)
        if lane.busy:
            return None
        connection = lane.connection
        # As the pool does before lending a connection: a socket with something
        # to read is either out of step or closed by the server; start afresh.
        try:
            stale = connection._sock is not None and connection.can_read()
        except self._socket_errors:
            stale = True
        if stale:
            connection.disconnect()
        if connection._sock is None:
            # Connect here rather than inside the first send, so that a failure to
            # connect is known to have sent nothing, and learn the server's name
            # for the connection: undoing a decision whose reply was lost starts by
            # killing the connection that carried it.
            connection.connect()
            lane.identity = identify(connection)
        lane.busy = True
        return lane

    def close(self) -> None:
        for connection in list(self._connections):
            connection.disconnect()


def identify(connection: Any) -> tuple[str, ...] | None:
    """``CLIENT KILL`` filters naming ``connection`` on its server, or ``None``.

    The id alone could name another client after a server restart (ids start
    again from 1); id and address together cannot. ``CLIENT INFO`` needs Redis
    6.2; an older server, or one whose ACL refuses ``CLIENT``, gives ``None``
    and undoing falls back to repeating the rollback.
    """
    import redis

    try:
        connection.send_command("CLIENT", "INFO")
        reply = connection.read_response()
    except redis.ResponseError:
        return None
    fields = dict(part.split("=", 1) for part in _text(reply).split() if "=" in part)
    if "id" not in fields or "addr" not in fields:
        return None
    return ("ID", fields["id"], "ADDR", fields["addr"])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
