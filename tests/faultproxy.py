"""A loopback TCP proxy that injects network faults between clients and a server.

Fault tests put a :class:`FaultProxy` between redis-py clients (in this
process, or in subprocesses such as Celery workers, which only need its
:meth:`~FaultProxy.url`) and a Redis server, then break the network on
purpose, from any thread, at any moment::

    with FaultProxy("127.0.0.1", 6379) as proxy:
        client = redis.Redis.from_url(
            proxy.url(15), socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
        )
        client.ping()  # connect first: the handshake's replies are replies too
        proxy.drop_replies(1)
        client.set("k", "v")  # TimeoutError, yet the server did set k

Two redis-py habits matter. A new connection first sends its handshake
(``HELLO``, ``CLIENT SETINFO``, ``SELECT``) and waits for each reply, so a
reply fault aimed at a command must wait until the connection is up. And a
pooled client checks an idle connection before reusing it and silently
replaces one that was reset, so to see an open connection fail, use
``single_connection_client=True`` (and no retries).

Every client connection gets an upstream connection of its own, opened when
the client connects, so a server restarted between two connections is simply
found again; if the upstream refuses (or resets), the client connection is
reset. A server paused with SIGSTOP needs nothing special: bytes wait in the
kernel's buffers like any other slow reply.

Faults
------
A *reply chunk* is what one ``recv`` from the upstream returns (at most
64 KiB). For Redis request/response traffic one reply almost always arrives in
one chunk, and that is the granularity of every reply fault; a pipelined
batch whose replies arrive together counts as one chunk. Faults are decided
when a chunk arrives from the upstream, in this order: reset, drop, delay.

``delay_replies(seconds)``
    Each chunk arriving from now on is forwarded to the client ``seconds``
    after it arrived (0 turns delays off; chunks already held keep their
    time). Bytes never overtake each other: a chunk waits for the ones before
    it, even if its own time came first.
``drop_replies(count=None)``
    The next ``count`` chunks (``None``: every chunk until :meth:`heal`) are
    swallowed: the server executed the request, the client never hears back.
    The connection that lost a chunk is dead from then on, since its client
    would read the next reply as the answer to the lost request: its upstream
    side is closed at once, nothing more reaches the client, and the client
    side is closed when the client closes it (as redis-py does on a timeout)
    or reset when it sends anything more.
``reset_on_reply(count=1)``
    The next ``count`` chunks are not forwarded; instead both sides of their
    connection are reset (``SO_LINGER`` 0, so the client reads ECONNRESET)
    when the chunk would have been forwarded. The server executed the request.
``reset_on_reply_to(name, refuse=False)``
    The next command named ``name`` (any client) goes to the server; the next
    reply chunk on its connection is not forwarded, and both sides of that
    connection are reset instead: the server executed the command, its client
    reads ECONNRESET. Aims a lost reply at one command of a busy client. With
    ``refuse``, new connections are refused from that moment (as by
    ``refuse(True)``), so that a client's retries fail too.
``reset_all()``
    Reset every open client connection, and its upstream, now.
``pause()`` / ``resume()``
    Stop forwarding in both directions: nothing is read from or written to
    connected sockets, so data waits in the proxy's and the kernel's buffers
    and connections stay open. Resuming forwards everything in order. New
    connections are still accepted while paused (their bytes wait too).
``refuse(on)``
    While on, each new client connection is accepted and reset at once;
    existing connections keep working.
``heal()``
    Turn every fault above off (resumes, stops refusing). Dead connections stay
    dead, and chunks already delayed keep their time.

Control methods run on the proxy's I/O thread and return once it applied them:
after ``pause()`` returns, no further byte is forwarded; after
``reset_all()`` returns, the connections are gone. Faults may also be set
before :meth:`~FaultProxy.start`.

Counters
--------
``connections_opened``, ``connections_refused``, ``replies_dropped``,
``resets`` (client connections the proxy reset, for any reason: a fault,
``refuse``, or an upstream that refused or reset), ``bytes_up`` and
``bytes_down`` (bytes handed to the upstream and to clients),
``commands_seen`` and :attr:`~FaultProxy.command_names` (complete RESP
commands handed to the upstream, by upper-cased name). Byte and command counts
are updated just after the bytes were handed to the kernel, so a peer may see
bytes a moment before they are counted; but a request is counted before any
reply to it can be forwarded, so a client that got its answer can assert on
``commands_seen`` and ``bytes_up`` at once. ``resets`` and ``replies_dropped``
are counted before the client can notice the fault.

Everything runs on one ``selectors`` thread, woken by a socket pair: no busy
loop, no polling; :meth:`~FaultProxy.close` closes every socket and joins the
thread within a few seconds.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["FaultProxy", "RespRequestParser"]

#: Bytes read by one ``recv``: the size of the largest reply chunk.
CHUNK_SIZE = 65536
#: Bytes buffered per connection and direction before the proxy stops reading that side.
HIGH_WATER = 1 << 20
#: How long a control method waits for the I/O thread.
CONTROL_TIMEOUT = 5.0
#: How long :meth:`FaultProxy.close` waits for the I/O thread to end.
JOIN_TIMEOUT = 5.0
#: Bytes of a command's first element kept for its name (longer names are cut).
NAME_LIMIT = 64

_READ = selectors.EVENT_READ
_WRITE = selectors.EVENT_WRITE
_LISTENER = object()
_WAKE = object()
_IN_PROGRESS = frozenset({0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN})
_RESET_LINGER = struct.pack("ii", 1, 0)


class RespRequestParser:
    """Streaming parser of the client-to-server side of RESP: finds where each command ends.

    Requests are arrays of bulk strings (``*2\\r\\n$3\\r\\nGET\\r\\n$1\\r\\nk\\r\\n``),
    which is all redis-py sends, or inline commands (one line, counted by line).
    Bulk payloads are skipped, not buffered, so a large value costs no memory.
    An array element that is not a bulk string abandons its command uncounted,
    and parsing starts again at the next line.
    """

    def __init__(self) -> None:
        self._line = bytearray()
        self._items_left = 0
        self._bulk_left = 0
        self._capture_left = 0
        self._first_item = False
        self._name = bytearray()

    def feed(self, data: bytes) -> list[str]:
        """Consume ``data``; return the upper-cased names of the commands it completed."""
        names: list[str] = []
        pos, end = 0, len(data)
        while pos < end:
            if self._bulk_left:
                take = min(self._bulk_left, end - pos)
                if self._capture_left:
                    grab = min(take, self._capture_left)
                    self._name += data[pos : pos + grab]
                    self._capture_left -= grab
                pos += take
                self._bulk_left -= take
                if not self._bulk_left:
                    self._item_done(names)
                continue
            newline = data.find(b"\n", pos)
            if newline < 0:
                self._line += data[pos:]
                break
            self._line += data[pos : newline + 1]
            pos = newline + 1
            line = bytes(self._line).rstrip(b"\r\n")
            self._line.clear()
            self._on_line(line, names)
        return names

    def _on_line(self, line: bytes, names: list[str]) -> None:
        if not self._items_left:
            if line.startswith(b"*"):
                count = _to_int(line[1:])
                # *0 and *-1 (or garbage) carry no command.
                if count is not None and count > 0:
                    self._items_left = count
                    self._first_item = True
                    self._name.clear()
            elif line.strip():
                names.append(_name_of(line.split()[0]))
            return
        length = _to_int(line[1:]) if line.startswith(b"$") else None
        if length is None:
            self._items_left = 0
            return
        if length < 0:
            self._item_done(names)
            return
        self._bulk_left = length + 2
        self._capture_left = min(length, NAME_LIMIT) if self._first_item else 0

    def _item_done(self, names: list[str]) -> None:
        self._first_item = False
        self._items_left -= 1
        if not self._items_left:
            names.append(_name_of(self._name))
            self._name.clear()


def _to_int(text: bytes) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _name_of(raw: bytes | bytearray) -> str:
    return bytes(raw).decode("utf-8", "replace").upper()


def _abort(sock: socket.socket) -> None:
    """Close ``sock`` so that the peer reads ECONNRESET rather than an orderly EOF."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_LINGER)
    sock.close()


def _no_delay(sock: socket.socket) -> None:
    # Nagle's algorithm and delayed ACKs would add up to 40 ms to small replies,
    # and timing assertions on delays would measure that instead.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Link:
    """One client connection and its upstream connection. Owned by the I/O thread."""

    __slots__ = (
        "client",
        "client_eof",
        "client_mask",
        "closed",
        "connected",
        "dead",
        "doomed",
        "held",
        "held_bytes",
        "parser",
        "reset_reply",
        "to_client",
        "to_upstream",
        "upstream",
        "upstream_eof",
        "upstream_mask",
        "upstream_shut",
    )

    def __init__(self, client: socket.socket, upstream: socket.socket, connected: bool) -> None:
        self.client = client
        self.upstream: socket.socket | None = upstream
        self.connected = connected
        self.client_mask = 0
        self.upstream_mask = 0
        self.to_upstream = bytearray()
        # (due time, chunk); a None chunk is a reset waiting for its turn.
        self.held: deque[tuple[float, bytes | None]] = deque()
        self.held_bytes = 0
        self.to_client = bytearray()
        self.client_eof = False
        self.upstream_eof = False
        self.upstream_shut = False
        self.dead = False
        self.doomed = False
        self.closed = False
        self.parser = RespRequestParser()
        self.reset_reply = False


class _Request:
    """A control action for the I/O thread, and the event its caller waits on."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action = action
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.action()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()


class FaultProxy:
    """A TCP proxy from a loopback port to ``upstream_host:upstream_port`` that breaks on demand.

    See the module's documentation for the exact semantics of each fault.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.listen_host = listen_host
        self.listen_port = listen_port

        #: Client connections accepted, except those :meth:`refuse` reset.
        self.connections_opened = 0
        #: Client connections reset on arrival because of :meth:`refuse`.
        self.connections_refused = 0
        #: Reply chunks swallowed by :meth:`drop_replies`.
        self.replies_dropped = 0
        #: Client connections the proxy reset, whatever the reason.
        self.resets = 0
        #: Bytes handed to the upstream.
        self.bytes_up = 0
        #: Bytes handed to clients.
        self.bytes_down = 0
        #: Complete commands handed to the upstream.
        self.commands_seen = 0
        self._names: Counter[str] = Counter()
        #: The same names in the order they were handed on.
        self._log: list[str] = []
        self._names_lock = threading.Lock()

        # Fault settings: written by control actions, which run on the I/O thread.
        self._delay = 0.0
        self._drop_left: int | None = 0
        self._reset_left = 0
        self._reset_after: str | None = None
        self._refuse_after_reset = False
        self._paused = False
        self._refusing = False

        self._lock = threading.Lock()
        self._requests: list[_Request] = []
        self._running = False
        self._started = False
        self._closed = False
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._links: set[_Link] = set()
        self._port: int | None = None
        self._upstream_family = socket.AF_INET
        self._upstream_address: Any = None
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> FaultProxy:
        """Bind, listen and start the I/O thread; return ``self``."""
        with self._lock:
            if self._started or self._closed:
                raise RuntimeError("a FaultProxy can be started once")
            self._started = True
        self._upstream_family, self._upstream_address = self._resolve_upstream()
        family = socket.AF_INET6 if ":" in self.listen_host else socket.AF_INET
        listener = socket.create_server(
            (self.listen_host, self.listen_port), family=family, backlog=128
        )
        try:
            listener.setblocking(False)
            wake_r, wake_w = socket.socketpair()
        except BaseException:
            listener.close()
            raise
        selector = selectors.DefaultSelector()
        try:
            for sock in (wake_r, wake_w):
                sock.setblocking(False)
            selector.register(listener, _READ, _LISTENER)
            selector.register(wake_r, _READ, _WAKE)
            self._port = listener.getsockname()[1]
            thread = threading.Thread(
                target=self._run, name=f"faultproxy-{self._port}", daemon=True
            )
            self._listener, self._selector = listener, selector
            self._wake_r, self._wake_w = wake_r, wake_w
            self._thread = thread
            with self._lock:
                self._running = True
            thread.start()
        except BaseException:
            with self._lock:
                self._running = False
            selector.close()
            for sock in (listener, wake_r, wake_w):
                sock.close()
            raise
        return self

    def close(self) -> None:
        """Stop accepting, close every socket and join the I/O thread. Idempotent.

        Raises RuntimeError if the I/O thread does not end in time, or ended
        on an error of its own (a bug of the proxy, to surface in the test).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        self._control(self._request_stop)
        thread.join(JOIN_TIMEOUT)
        if thread.is_alive():
            raise RuntimeError(f"{thread.name} did not stop within {JOIN_TIMEOUT}s")
        if self._error is not None:
            raise RuntimeError(f"{thread.name} failed") from self._error

    def __enter__(self) -> FaultProxy:
        if not self._started:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def port(self) -> int:
        """The port the proxy listens on."""
        if self._port is None:
            raise RuntimeError("the proxy is not started")
        return self._port

    def url(self, db: int = 0) -> str:
        """A Redis URL that reaches the upstream through the proxy."""
        wildcard = self.listen_host in ("", "0.0.0.0", "::")
        host = "127.0.0.1" if wildcard else self.listen_host
        if ":" in host:
            host = f"[{host}]"
        return f"redis://{host}:{self.port}/{db}"

    # -- faults ------------------------------------------------------------

    def delay_replies(self, seconds: float) -> None:
        """Forward each reply chunk arriving from now on ``seconds`` late (0: on time)."""
        if seconds < 0:
            raise ValueError("a delay cannot be negative")

        def action() -> None:
            self._delay = float(seconds)

        self._control(action)

    def drop_replies(self, count: int | None = None) -> None:
        """Swallow the next ``count`` reply chunks (None: all until :meth:`heal`)."""
        if count is not None and count < 0:
            raise ValueError("count cannot be negative")

        def action() -> None:
            self._drop_left = count

        self._control(action)

    def reset_on_reply(self, count: int = 1) -> None:
        """Reset the connection of each of the next ``count`` reply chunks instead of forwarding."""
        if count < 0:
            raise ValueError("count cannot be negative")

        def action() -> None:
            self._reset_left = count

        self._control(action)

    def reset_on_reply_to(self, name: str, *, refuse: bool = False) -> None:
        """Reset the connection of the next command named ``name`` when its reply comes
        (and, with ``refuse``, refuse new connections from then on)."""

        def action() -> None:
            self._reset_after = name.upper()
            self._refuse_after_reset = refuse

        self._control(action)

    def reset_all(self) -> None:
        """Reset every open connection, both sides, before returning."""

        def action() -> None:
            for link in list(self._links):
                self._close_link(link, reset=True)

        self._control(action)

    def pause(self) -> None:
        """Stop forwarding in both directions; connections stay open, data stays buffered."""
        self._set_paused(True)

    def resume(self) -> None:
        """Forward, in order, everything :meth:`pause` held back, and carry on."""
        self._set_paused(False)

    def refuse(self, on: bool) -> None:
        """While ``on``, reset each new client connection as soon as it is accepted."""

        def action() -> None:
            self._refusing = on

        self._control(action)

    def heal(self) -> None:
        """Turn every fault off; dead connections stay dead."""

        def action() -> None:
            self._delay = 0.0
            self._drop_left = 0
            self._reset_left = 0
            self._reset_after = None
            self._paused = False
            self._refusing = False

        self._control(action)

    # -- counters ----------------------------------------------------------

    @property
    def command_names(self) -> Counter[str]:
        """How many commands of each (upper-cased) name were handed to the upstream; a copy."""
        with self._names_lock:
            return Counter(self._names)

    def command_log(self) -> list[str]:
        """Every command handed to the upstream, by upper-cased name, in order; a copy."""
        with self._names_lock:
            return list(self._log)

    @property
    def open_connections(self) -> int:
        """Client connections currently open (dead ones included, until closed)."""
        return len(self._links)

    def reset_counters(self) -> None:
        """Set every counter back to zero."""

        def action() -> None:
            with self._names_lock:
                self.commands_seen = 0
                self._names.clear()
                self._log.clear()
            self.connections_opened = self.connections_refused = 0
            self.replies_dropped = self.resets = 0
            self.bytes_up = self.bytes_down = 0

        self._control(action)

    # -- control plumbing --------------------------------------------------

    def _set_paused(self, paused: bool) -> None:
        def action() -> None:
            self._paused = paused

        self._control(action)

    def _request_stop(self) -> None:
        self._stopping = True

    def _control(self, action: Callable[[], None]) -> None:
        """Run ``action`` on the I/O thread (or here, if it is not running) and wait for it."""
        request = _Request(action)
        with self._lock:
            if not self._running or threading.current_thread() is self._thread:
                action()
                return
            self._requests.append(request)
        self._wake()
        if not request.done.wait(CONTROL_TIMEOUT):
            raise RuntimeError(f"the proxy's I/O thread did not answer within {CONTROL_TIMEOUT}s")
        if request.error is not None:
            raise request.error

    def _wake(self) -> None:
        wake_w = self._wake_w
        if wake_w is None:
            return
        # OSError: full (a wake-up is pending anyway), or closed by a shutdown
        # that ran the request itself.
        with contextlib.suppress(OSError):
            wake_w.send(b"\0")

    def _resolve_upstream(self) -> tuple[socket.AddressFamily, Any]:
        infos = socket.getaddrinfo(self.upstream_host, self.upstream_port, type=socket.SOCK_STREAM)
        # "localhost" may resolve to ::1 first while Redis listens on 127.0.0.1 only.
        infos.sort(key=lambda info: info[0] != socket.AF_INET)
        family, _, _, _, address = infos[0]
        return family, address

    # -- I/O thread --------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            self._error = exc
        finally:
            self._shutdown()

    def _loop(self) -> None:
        selector = self._selector
        assert selector is not None
        while True:
            events = selector.select(self._next_timeout(time.monotonic()))
            # Drain before running requests: a request queued after the drain
            # leaves its wake-up byte behind, so it cannot be missed.
            self._drain_wake()
            self._run_requests()
            if self._stopping:
                return
            for key, mask in events:
                if key.data is _WAKE:
                    continue
                if key.data is _LISTENER:
                    self._accept()
                else:
                    link: _Link = key.data
                    # An earlier event of this batch may have closed the link.
                    if link.closed:
                        continue
                    if key.fileobj is link.client:
                        self._on_client(link)
                    else:
                        self._on_upstream(link, mask)
            now = time.monotonic()
            for link in list(self._links):
                self._pump(link, now)
            for link in self._links:
                self._update_interest(link)

    def _next_timeout(self, now: float) -> float | None:
        if self._paused:
            return None
        soonest: float | None = None
        for link in self._links:
            if not link.held:
                continue
            due, chunk = link.held[0]
            # A reset behind unsent bytes waits for the client to be writable, not for time.
            if chunk is None and link.to_client:
                continue
            if soonest is None or due < soonest:
                soonest = due
        return None if soonest is None else max(0.0, soonest - now)

    def _run_requests(self) -> None:
        with self._lock:
            requests, self._requests = self._requests, []
        for request in requests:
            request.run()

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                # BlockingIOError: nothing left to accept.
                return
            if self._refusing:
                self.connections_refused += 1
                self.resets += 1
                _abort(client)
                continue
            self._open_link(client)

    def _open_link(self, client: socket.socket) -> None:
        # Counted here, not once the upstream answers: a refusing upstream may say so
        # at once or later, and the count must not depend on which.
        self.connections_opened += 1
        client.setblocking(False)
        _no_delay(client)
        try:
            upstream = socket.socket(self._upstream_family, socket.SOCK_STREAM)
        except OSError:
            self.resets += 1
            _abort(client)
            return
        upstream.setblocking(False)
        try:
            status = upstream.connect_ex(self._upstream_address)
        except OSError as exc:
            status = exc.errno or errno.ECONNREFUSED
        if status not in _IN_PROGRESS:
            self.resets += 1
            upstream.close()
            _abort(client)
            return
        link = _Link(client, upstream, connected=status == 0)
        if link.connected:
            _no_delay(upstream)
        self._links.add(link)

    def _on_client(self, link: _Link) -> None:
        try:
            data = link.client.recv(CHUNK_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_link(link, reset=False)
            return
        if link.dead:
            # The client hung up (as it should after a lost reply), or it carries
            # on out of step: either way this connection must not serve it.
            self._close_link(link, reset=bool(data))
        elif data:
            link.to_upstream += data
        else:
            link.client_eof = True

    def _on_upstream(self, link: _Link, mask: int) -> None:
        upstream = link.upstream
        # A stale event: the upstream side was closed after the select returned.
        if upstream is None:
            return
        if not link.connected:
            if upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._close_link(link, reset=True)
            else:
                link.connected = True
                _no_delay(upstream)
            return
        if not mask & _READ:
            return
        try:
            data = upstream.recv(CHUNK_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_link(link, reset=True)
            return
        if not data:
            link.upstream_eof = True
            return
        if link.doomed:
            return
        due = time.monotonic() + self._delay
        if self._reset_left or link.reset_reply:
            if link.reset_reply:
                link.reset_reply = False
                self._refusing = self._refusing or self._refuse_after_reset
            else:
                self._reset_left -= 1
            link.doomed = True
            link.held.append((due, None))
        elif self._drop_left is None or self._drop_left:
            if self._drop_left is not None:
                self._drop_left -= 1
            self.replies_dropped += 1
            link.dead = True
            self._close_upstream(link)
        else:
            link.held.append((due, data))
            link.held_bytes += len(data)

    def _pump(self, link: _Link, now: float) -> None:
        """Move whatever may move on ``link`` now."""
        if self._paused:
            return
        if not self._flush_upstream(link):
            return
        if not self._release(link, now):
            return
        if not self._flush_client(link):
            return
        if not self._release(link, now):
            return
        if link.upstream_eof and not link.held and not link.to_client:
            self._close_link(link, reset=False)

    def _flush_upstream(self, link: _Link) -> bool:
        upstream = link.upstream
        if upstream is None or not link.connected:
            return True
        if link.to_upstream:
            try:
                sent = upstream.send(link.to_upstream)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close_link(link, reset=True)
                return False
            if sent:
                chunk = bytes(link.to_upstream[:sent])
                del link.to_upstream[:sent]
                self.bytes_up += sent
                names = link.parser.feed(chunk)
                if self._reset_after is not None and self._reset_after in names:
                    self._reset_after = None
                    link.reset_reply = True
                if names:
                    with self._names_lock:
                        self.commands_seen += len(names)
                        self._names.update(names)
                        self._log.extend(names)
        if link.client_eof and not link.to_upstream and not link.upstream_shut:
            # Pass the client's half-close on; the server answers what it got, then hangs up.
            link.upstream_shut = True
            with contextlib.suppress(OSError):
                upstream.shutdown(socket.SHUT_WR)
        return True

    def _release(self, link: _Link, now: float) -> bool:
        """Move due chunks to the client's buffer; carry out a due reset. False if it did."""
        while link.held:
            due, chunk = link.held[0]
            if due > now:
                break
            if chunk is None:
                if link.to_client:
                    break
                self._close_link(link, reset=True)
                return False
            link.held.popleft()
            link.held_bytes -= len(chunk)
            link.to_client += chunk
        return True

    def _flush_client(self, link: _Link) -> bool:
        if not link.to_client:
            return True
        try:
            sent = link.client.send(link.to_client)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            self._close_link(link, reset=False)
            return False
        del link.to_client[:sent]
        self.bytes_down += sent
        return True

    def _update_interest(self, link: _Link) -> None:
        paused = self._paused
        want = 0
        if link.dead or (not paused and not link.client_eof and len(link.to_upstream) < HIGH_WATER):
            want |= _READ
        if link.to_client and not paused:
            want |= _WRITE
        link.client_mask = self._register(link.client, link.client_mask, want, link)
        if link.upstream is None:
            return
        if not link.connected:
            want = _WRITE
        else:
            want = 0
            if (
                not paused
                and not link.upstream_eof
                and not link.doomed
                and link.held_bytes + len(link.to_client) < HIGH_WATER
            ):
                want |= _READ
            if link.to_upstream and not paused:
                want |= _WRITE
        link.upstream_mask = self._register(link.upstream, link.upstream_mask, want, link)

    def _register(self, sock: socket.socket, current: int, want: int, link: _Link) -> int:
        selector = self._selector
        assert selector is not None
        if want == current:
            return current
        if not current:
            selector.register(sock, want, link)
        elif not want:
            selector.unregister(sock)
        else:
            selector.modify(sock, want, link)
        return want

    def _close_upstream(self, link: _Link) -> None:
        upstream = link.upstream
        if upstream is None:
            return
        if link.upstream_mask:
            assert self._selector is not None
            self._selector.unregister(upstream)
        link.upstream_mask = 0
        link.upstream = None
        upstream.close()

    def _close_link(self, link: _Link, reset: bool) -> None:
        if link.closed:
            return
        link.closed = True
        self._links.discard(link)
        # Counted before the client can see the reset, so a test that saw it sees the count.
        if reset:
            self.resets += 1
        selector = self._selector
        assert selector is not None
        for sock, mask in ((link.client, link.client_mask), (link.upstream, link.upstream_mask)):
            if sock is None:
                continue
            if mask:
                selector.unregister(sock)
            if reset:
                _abort(sock)
            else:
                sock.close()
        link.client_mask = link.upstream_mask = 0
        link.upstream = None

    def _shutdown(self) -> None:
        for link in list(self._links):
            try:
                self._close_link(link, reset=False)
            except Exception:
                # Whatever went wrong, every socket must still be closed.
                link.client.close()
                if link.upstream is not None:
                    link.upstream.close()
        with self._lock:
            self._running = False
            requests, self._requests = self._requests, []
        # Requests that raced with the stop still get an answer.
        for request in requests:
            request.run()
        if self._selector is not None:
            self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
