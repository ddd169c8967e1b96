"""The fault-injection proxy of tests/faultproxy.py: each fault does exactly what it says.

Tests marked ``redis`` go through the proxy to the shared Redis on 6379, db 15,
under a key prefix of their own that they delete afterwards (no flush: other
runs use that server). Clients time out after 0.5 s and never retry, so a
fault shows as an exception. The others use a plain socket as the upstream.
"""

from __future__ import annotations

import gc
import itertools
import socket
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.conftest import HOST, service_port
from tests.faultproxy import FaultProxy, RespRequestParser
from tests.polling import eventually

DB = 15
TIMEOUT = 0.5
PING = b"*1\r\n$4\r\nPING\r\n"

Connect = Callable[..., "redis.Redis"]


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    """A started proxy in front of the test Redis."""
    with FaultProxy(HOST, service_port("redis")) as started:
        yield started


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test or run uses."""
    return f"faultproxy-test:{uuid.uuid4().hex}:"


@pytest.fixture
def direct(prefix: str) -> Iterator[redis.Redis]:
    """A client of db 15 that bypasses the proxy; deletes the test's keys afterwards."""
    client = redis.Redis(host=HOST, port=service_port("redis"), db=DB)
    try:
        yield client
    finally:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture
def connect(proxy: FaultProxy) -> Iterator[Connect]:
    """Make clients through the proxy, without retries; all are closed at teardown.

    Clients hold one connection (``single_connection_client``): a pooled client
    would silently replace a connection that was reset while idle.
    """
    made: list[redis.Redis] = []

    def make(timeout: float = TIMEOUT, single: bool = True) -> redis.Redis:
        client = redis.Redis.from_url(
            proxy.url(DB),
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            single_connection_client=single,
        )
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def refusing_upstream() -> Iterator[socket.socket]:
    """A bound socket that does not listen yet: connections to it are refused until it does."""
    with socket.socket() as upstream:
        upstream.bind((HOST, 0))
        upstream.settimeout(2)
        yield upstream


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    """Read ``size`` bytes from ``sock``, failing on EOF."""
    data = b""
    while len(data) < size:
        piece = sock.recv(size - len(data))
        assert piece, f"EOF after {data!r}"
        data += piece
    return data


def packed(*args: bytes | str) -> bytes:
    """The bytes redis-py sends for one command: an array of bulk strings."""
    parts = [arg.encode() if isinstance(arg, str) else arg for arg in args]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


# -- the request parser ----------------------------------------------------


commands = st.lists(
    st.tuples(
        st.sampled_from(["get", "SET", "EvalSha", "client"]),
        st.lists(st.binary(max_size=300), max_size=4),
    ),
    min_size=1,
    max_size=6,
)


@given(commands, st.lists(st.integers(min_value=0, max_value=4000), max_size=8))
def test_parser_finds_every_command_however_the_stream_is_split(
    batch: list[tuple[str, list[bytes]]], cuts: list[int]
) -> None:
    """Packed commands are counted once each, by name, wherever the recv boundaries fall."""
    stream = b"".join(packed(name, *args) for name, args in batch)
    bounds = sorted({0, len(stream), *(cut % (len(stream) + 1) for cut in cuts)})
    parser = RespRequestParser()
    names: list[str] = []
    for start, end in itertools.pairwise(bounds):
        names += parser.feed(stream[start:end])
    assert names == [name.upper() for name, _ in batch]


def test_parser_counts_inline_commands_and_skips_empty_arrays() -> None:
    """Inline commands count by line; ``*0``, blank lines and a null first element are harmless."""
    parser = RespRequestParser()
    assert parser.feed(b"ping\r\n*0\r\n\r\nset a b\r\n") == ["PING", "SET"]
    assert parser.feed(b"*2\r\n$-1\r\n$1\r\nx\r\n") == [""]
    assert parser.feed(PING[:3]) == []
    assert parser.feed(PING[3:]) == ["PING"]


def test_parser_skips_a_large_value_without_buffering_it() -> None:
    """A multi-megabyte argument split over many reads is one command."""
    stream = packed("SET", "k", b"v" * 3_000_000)
    parser = RespRequestParser()
    names = [
        name for at in range(0, len(stream), 65536) for name in parser.feed(stream[at : at + 65536])
    ]
    assert names == ["SET"]


# -- lifecycle, without Redis ----------------------------------------------


def test_url_and_port_name_the_listening_socket(refusing_upstream: socket.socket) -> None:
    """``url(db)`` is ``redis://127.0.0.1:<port>/<db>`` with the port actually bound."""
    refusing_upstream.listen()
    with FaultProxy(HOST, refusing_upstream.getsockname()[1]) as proxy:
        assert proxy.url(3) == f"redis://127.0.0.1:{proxy.port}/3"
        with socket.create_connection((HOST, proxy.port), timeout=2):
            pass


def test_refused_upstream_resets_the_client_and_a_restarted_one_is_found(
    refusing_upstream: socket.socket,
) -> None:
    """While the upstream refuses, clients are reset; once it listens, a new connection works."""
    with FaultProxy(HOST, refusing_upstream.getsockname()[1]) as proxy:
        # The reset may come before the client's connect() has returned, so it may raise.
        with (
            pytest.raises(ConnectionResetError),
            socket.create_connection((HOST, proxy.port), timeout=2) as sock,
        ):
            sock.recv(1)
        assert proxy.resets == 1

        refusing_upstream.listen()
        with socket.create_connection((HOST, proxy.port), timeout=2) as sock:
            sock.sendall(b"hello")
            server_side, _ = refusing_upstream.accept()
            with server_side:
                server_side.settimeout(2)
                assert recv_exactly(server_side, 5) == b"hello"
                server_side.sendall(b"world")
                assert recv_exactly(sock, 5) == b"world"
        assert proxy.connections_opened == 2
        # Byte counters follow the send that moved the bytes, so they may lag the peer.
        eventually(lambda: (proxy.bytes_up, proxy.bytes_down) == (5, 5), 5, "byte counts")


def test_close_stops_the_thread_closes_every_socket_and_is_idempotent(
    refusing_upstream: socket.socket,
) -> None:
    """close() joins the I/O thread, hangs up on clients and leaves nothing for ResourceWarning."""
    refusing_upstream.listen()
    before = set(threading.enumerate())

    def use_and_close() -> None:
        proxy = FaultProxy(HOST, refusing_upstream.getsockname()[1]).start()
        assert len(set(threading.enumerate()) - before) == 1
        with socket.create_connection((HOST, proxy.port), timeout=2) as client:
            eventually(lambda: proxy.open_connections == 1, 5, "the proxied connection")
            proxy.close()
            assert client.recv(1) == b""
        proxy.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        use_and_close()
        gc.collect()
    assert set(threading.enumerate()) == before
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_control_methods_from_many_threads_all_return(refusing_upstream: socket.socket) -> None:
    """Concurrent control calls are each applied and answered; none waits for a lost wake-up."""

    def hammer(proxy: FaultProxy) -> None:
        for _ in range(100):
            proxy.pause()
            proxy.delay_replies(0.1)
            proxy.heal()

    with FaultProxy(HOST, refusing_upstream.getsockname()[1]) as proxy:
        started = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            for future in [pool.submit(hammer, proxy) for _ in range(4)]:
                future.result(timeout=10)
        assert time.monotonic() - started < 4


# -- faults, through to Redis ----------------------------------------------


@pytest.mark.redis
def test_commands_pass_through(
    proxy: FaultProxy, connect: Connect, prefix: str, direct: redis.Redis
) -> None:
    """Without faults, commands reach Redis and answers come back unchanged, and are counted."""
    client = connect()
    assert client.set(f"{prefix}k", "v")
    assert client.get(f"{prefix}k") == b"v"
    assert direct.get(f"{prefix}k") == b"v"
    assert proxy.connections_opened == 1
    assert proxy.bytes_up > 0
    proxy.reset_counters()
    assert (proxy.connections_opened, proxy.bytes_up, proxy.commands_seen) == (0, 0, 0)
    assert proxy.command_names == Counter()


@pytest.mark.redis
def test_commands_seen_counts_each_command_once_by_name(
    proxy: FaultProxy, connect: Connect, prefix: str, direct: redis.Redis
) -> None:
    """A pipeline of three commands counts three; one EVALSHA counts one EVALSHA."""
    # Pooled: a pipeline takes a connection from the pool, not a single-connection
    # client's own, and a new connection's handshake would add commands.
    client = connect(single=False)
    client.ping()
    seen, names = proxy.commands_seen, proxy.command_names

    pipe = client.pipeline(transaction=False)
    pipe.set(f"{prefix}n", 1)
    pipe.incr(f"{prefix}n")
    pipe.get(f"{prefix}n")
    assert pipe.execute() == [True, 2, b"2"]
    assert proxy.commands_seen - seen == 3

    sha = direct.script_load("return redis.call('INCR', KEYS[1])")
    assert client.evalsha(sha, 1, f"{prefix}n") == 3
    assert proxy.commands_seen - seen == 4
    # redis-py's incr() sends INCRBY.
    assert proxy.command_names - names == Counter({"SET": 1, "INCRBY": 1, "GET": 1, "EVALSHA": 1})


@pytest.mark.redis
def test_delay_holds_each_reply_back(proxy: FaultProxy, connect: Connect) -> None:
    """With a delay, a call takes at least that long; healed, it is fast again."""
    client = connect()
    client.ping()
    proxy.delay_replies(0.25)
    started = time.monotonic()
    assert client.ping()
    assert time.monotonic() - started >= 0.25

    proxy.heal()
    started = time.monotonic()
    assert client.ping()
    assert time.monotonic() - started < 0.2


@pytest.mark.redis
def test_bytes_keep_their_order_when_the_delay_is_lifted(proxy: FaultProxy) -> None:
    """A reply arriving after the delay was lifted still waits for the delayed one before it."""
    with socket.create_connection((HOST, proxy.port), timeout=2) as sock:
        proxy.delay_replies(0.4)
        started = time.monotonic()
        sock.sendall(PING)
        time.sleep(0.1)  # the reply is now held by the proxy
        proxy.delay_replies(0)
        sock.sendall(packed("ECHO", "hi"))
        first = recv_exactly(sock, 7)
        assert time.monotonic() - started >= 0.4
        assert first + recv_exactly(sock, 8) == b"+PONG\r\n$2\r\nhi\r\n"


@pytest.mark.redis
def test_dropped_reply_times_out_though_the_server_executed_it(
    proxy: FaultProxy, connect: Connect, prefix: str, direct: redis.Redis
) -> None:
    """drop_replies(1): the client times out, the write happened, then the next call works."""
    client = connect()
    client.ping()
    proxy.drop_replies(1)
    with pytest.raises(redis.TimeoutError):
        client.set(f"{prefix}k", "v")
    assert direct.get(f"{prefix}k") == b"v"
    assert proxy.replies_dropped == 1
    # redis-py hangs up after a timeout; the proxy closes the dead connection in turn.
    eventually(lambda: proxy.open_connections == 0, 5, "the dead connection to close")
    assert client.get(f"{prefix}k") == b"v"


@pytest.mark.redis
def test_connection_that_lost_a_reply_forwards_nothing_more(proxy: FaultProxy) -> None:
    """After a dropped reply the connection stays mute and is reset at the client's next request."""
    with socket.create_connection((HOST, proxy.port), timeout=2) as sock:
        sock.sendall(PING)
        assert recv_exactly(sock, 7) == b"+PONG\r\n"
        proxy.drop_replies(1)
        sock.sendall(PING)
        sock.settimeout(0.3)
        with pytest.raises(socket.timeout):
            sock.recv(100)
        proxy.heal()
        sock.settimeout(2)
        sock.sendall(PING)
        with pytest.raises(ConnectionResetError):
            sock.recv(100)
    assert proxy.resets == 1


@pytest.mark.redis
def test_drop_without_count_drops_until_heal(proxy: FaultProxy, connect: Connect) -> None:
    """drop_replies() swallows every reply, new connections' included, until heal()."""
    client = connect(timeout=0.3)
    client.ping()
    proxy.drop_replies()
    for _ in range(2):
        with pytest.raises(redis.TimeoutError):
            client.ping()
    assert proxy.replies_dropped == 2
    proxy.heal()
    assert client.ping()


@pytest.mark.redis
def test_reset_on_reply_resets_the_client_after_the_server_executed(
    proxy: FaultProxy, connect: Connect, prefix: str, direct: redis.Redis
) -> None:
    """reset_on_reply: the client reads ECONNRESET instead of the reply, and the INCR happened."""
    client = connect()
    client.ping()
    proxy.reset_on_reply(1)
    with pytest.raises(redis.ConnectionError) as caught:
        client.incr(f"{prefix}n")
    assert isinstance(caught.value.__context__, ConnectionResetError)
    assert direct.get(f"{prefix}n") == b"1"
    assert proxy.resets == 1
    assert client.incr(f"{prefix}n") == 2


@pytest.mark.redis
def test_reset_on_reply_to_aims_at_one_command_and_can_refuse_retries(
    proxy: FaultProxy, connect: Connect, prefix: str, direct: redis.Redis
) -> None:
    """reset_on_reply_to: other commands pass; the named one runs on the server, its
    client reads ECONNRESET; with refuse=True, a new connection is refused after it."""
    client, bystander = connect(), connect()
    client.ping()
    bystander.ping()
    proxy.reset_on_reply_to("incrby", refuse=True)  # redis-py sends incr() as INCRBY
    assert client.set(f"{prefix}n", 5)
    with pytest.raises(redis.ConnectionError) as caught:
        client.incr(f"{prefix}n")
    assert isinstance(caught.value.__context__, ConnectionResetError)
    assert direct.get(f"{prefix}n") == b"6"
    assert proxy.resets == 1
    assert bystander.incr(f"{prefix}n") == 7  # the fault is spent; open connections work
    with pytest.raises(redis.ConnectionError):
        client.get(f"{prefix}n")  # a new connection: refused
    proxy.refuse(False)
    assert client.get(f"{prefix}n") == b"7"


@pytest.mark.redis
def test_reset_all_breaks_open_connections_only(proxy: FaultProxy, connect: Connect) -> None:
    """reset_all: every open connection fails at its next use; a new connection works."""
    clients = [connect(), connect()]
    for client in clients:
        client.ping()
    proxy.reset_all()
    assert (proxy.open_connections, proxy.resets) == (0, 2)
    for client in clients:
        with pytest.raises(redis.ConnectionError):
            client.ping()
    assert connect().ping()


@pytest.mark.redis
def test_pause_holds_a_call_until_resume(
    proxy: FaultProxy, connect: Connect, prefix: str, direct: redis.Redis
) -> None:
    """A call made while paused neither reaches Redis nor returns until resume, then completes."""
    client = connect(timeout=5)
    client.ping()
    direct.set(f"{prefix}k", "before")
    seen = proxy.commands_seen
    proxy.pause()
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.set, f"{prefix}k", "during", get=True)
        time.sleep(0.3)
        assert not call.done()
        assert proxy.commands_seen == seen
        assert direct.get(f"{prefix}k") == b"before"
        proxy.resume()
        assert call.result(timeout=5) == b"before"
    assert direct.get(f"{prefix}k") == b"during"


@pytest.mark.redis
def test_refuse_resets_new_connections_and_spares_open_ones(
    proxy: FaultProxy, connect: Connect
) -> None:
    """While refusing, a new connection fails and an open one works; afterwards both work."""
    old = connect()
    old.ping()
    proxy.refuse(True)
    fresh = connect(single=False)
    with pytest.raises(redis.ConnectionError):
        fresh.ping()
    assert old.ping()
    assert proxy.connections_refused == 1
    proxy.refuse(False)
    assert fresh.ping()
