"""The Redis store's calls beyond deciding, on the real server: how a URL becomes its pool,
where it says it connects, what it reads back (held keys, scans, the eviction policy, the
registry of apps), the undo of a lost decision, and empty batches that ask nothing."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from celery_unique.exceptions import BackendUnavailable, StoreRefused
from celery_unique.stores import cleanup
from celery_unique.stores.base import (
    ActiveClaim,
    Claim,
    EvictionUnknown,
    KeyKind,
    OnDuplicate,
    RunStart,
    Scope,
    Verdict,
    WindowClaim,
)
from celery_unique.stores.redis import POOL_CONNECTIONS, Enqueued, RedisStore, server_of

pytestmark = pytest.mark.redis

NS = "calls"


def key(name: str, kind: str = "a", task: str = "calls.task") -> str:
    return f"unique:v1:{{{NS}}}:{kind}:{task}\x1f{name}"


def claim(name: str, job: str | None = None) -> Claim:
    return Claim(
        job or str(uuid.uuid4()), "calls.task", ActiveClaim(key(name), Scope.QUEUED, 60_000)
    )


@pytest.fixture
def store(redis_client: Any, redis_url: str) -> Iterator[RedisStore]:
    built = RedisStore.from_url(redis_url)
    try:
        yield built
    finally:
        built.close()


def test_a_url_becomes_a_blocking_pool_with_the_stores_timeouts(redis_url: str) -> None:
    built = RedisStore.from_url(redis_url)
    try:
        pool = built.client.connection_pool
        assert type(pool) is redis.BlockingConnectionPool
        assert pool.max_connections == POOL_CONNECTIONS == 100
        assert pool.timeout == 10
        kwargs = pool.connection_kwargs
        assert kwargs["socket_connect_timeout"] == 5
        assert kwargs["socket_timeout"] == 10
        assert kwargs["health_check_interval"] == 30
        assert kwargs["decode_responses"] is False
        assert built.server() == server_of(pool)
        assert built.db == int(redis_url.rsplit("/", 1)[1])
    finally:
        built.close()


def test_the_urls_own_options_override_the_stores(redis_url: str) -> None:
    built = RedisStore.from_url(
        f"{redis_url}?max_connections=7&socket_timeout=2.5&socket_connect_timeout=1"
    )
    try:
        pool = built.client.connection_pool
        assert pool.max_connections == 7
        assert pool.connection_kwargs["socket_timeout"] == 2.5
        assert pool.connection_kwargs["socket_connect_timeout"] == 1
        built.ping()
    finally:
        built.close()


def test_a_sentinel_store_names_no_server_of_its_own() -> None:
    built = RedisStore.from_url("redis+sentinel://127.0.0.1:1/main/3")
    try:
        assert built.server() is None
        assert built.db == 3
    finally:
        built.close()


def test_a_store_on_database_zero_says_so(redis_url: str) -> None:
    built = RedisStore.from_url(redis_url.rsplit("/", 1)[0])
    try:
        assert built.db == 0
    finally:
        built.close()


def test_a_held_key_reads_back_with_its_job_and_remaining_lease(store: RedisStore) -> None:
    made = claim("held", "job-held")
    assert store.decide([made])[0].verdict is Verdict.CREATED
    held = store.get(key("held"))
    assert held is not None
    assert (held.job_id, held.kind, held.scope, held.task) == (
        "job-held",
        KeyKind.ACTIVE,
        Scope.QUEUED,
        "calls.task",
    )
    assert held.expires_in_ms is not None
    assert 50_000 < held.expires_in_ms <= 60_000
    assert store.get(key("missing")) is None


def test_a_scan_lists_held_keys_of_its_kind_and_prefix_only(
    store: RedisStore, redis_client: Any
) -> None:
    window = WindowClaim(key("w*1", "w"), 60_000, "fp", "p")
    store.decide(
        [
            claim("a*1", "job-1"),
            claim("a?2", "job-2"),
            Claim("job-3", "calls.task", window=window),
        ]
    )
    redis_client.set(f"unique:apps:{{{NS}}}x", "not a held key")
    redis_client.set("other:app:data", "not ours")
    every = sorted(held.key for held in store.scan())
    assert every == sorted([key("a*1"), key("a?2"), key("w*1", "w")])
    actives = [held.job_id for held in store.scan(kind=KeyKind.ACTIVE)]
    assert sorted(actives) == ["job-1", "job-2"]
    windows = [held.job_id for held in store.scan(kind=KeyKind.WINDOW)]
    assert windows == ["job-3"]
    # A prefix is matched as written: its glob characters match themselves only.
    assert [held.job_id for held in store.scan(prefix=key("a*"))] == ["job-1"]
    assert [held.job_id for held in store.scan(prefix=key("a?"))] == ["job-2"]
    assert list(store.scan(prefix=key("a["))) == []


def test_the_eviction_policy_is_the_servers(store: RedisStore, redis_client: Any) -> None:
    config = redis_client.config_get("maxmemory*")
    assert store.eviction() == (int(config["maxmemory"]), config["maxmemory-policy"])


def test_apps_registered_within_their_keep_are_listed_and_older_ones_not(
    store: RedisStore, redis_client: Any
) -> None:
    registry = f"unique:apps:{{{NS}}}"
    now_ms = int(redis_client.time()[0]) * 1000
    redis_client.hset(registry, "old", json.dumps({"tasks": ["t.old"], "at": now_ms - 60_001}))
    redis_client.hset(registry, "edge", json.dumps({"tasks": ["t.edge"], "at": now_ms - 60_000}))
    apps = store.register_app(NS, "web", ["t.b", "t.a"], 60_000)
    assert apps == {"web": ["t.a", "t.b"], "edge": ["t.edge"]}
    entry = json.loads(redis_client.hget(registry, "web"))
    assert entry["tasks"] == ["t.a", "t.b"]
    assert now_ms <= entry["at"] <= now_ms + 2_000  # the server's clock, in whole seconds
    assert entry["at"] % 1000 == 0
    assert 0 < redis_client.pttl(registry) <= 60_000
    again = store.register_app(NS, "worker", ["t.c"], 60_000)
    assert again["web"] == ["t.a", "t.b"]
    assert again["worker"] == ["t.c"]


def test_empty_batches_ask_the_server_nothing(store: RedisStore, redis_client: Any) -> None:
    before = redis_client.info("stats")["total_commands_processed"]
    assert store.release_many([]) == []
    assert store.renew_many([], 1_000) == 0
    store.rollback_many([])
    after = redis_client.info("stats")["total_commands_processed"]
    assert after == before + 1  # the INFO itself


def lost_on(identity: tuple[str, ...] | None) -> BackendUnavailable:
    lost = BackendUnavailable("lost")
    lost._connection = identity  # type: ignore[attr-defined]
    return lost


def test_the_undo_of_a_lost_decision_on_a_gone_connection_is_final(
    store: RedisStore, redis_client: Any
) -> None:
    made = claim("lost")
    store.decide([made])
    gone = ("ID", "999999999", "ADDR", "127.0.0.1:1")
    assert store.forget_decision([made], lost_on(gone)) is True
    assert redis_client.exists(key("lost")) == 0


def test_the_undo_of_a_lost_decision_kills_the_connection_that_carried_it(
    store: RedisStore, redis_client: Any, redis_url: str
) -> None:
    other = redis.Redis.from_url(redis_url)
    try:
        other.client_setname("carrier")
        info = other.client_info()
        identity = ("ID", str(info["id"]), "ADDR", info["addr"])
        made = claim("carried")
        store.decide([made])
        assert store.forget_decision([made], lost_on(identity)) is True
        names = [client.get("name") for client in redis_client.client_list()]
        assert "carrier" not in names
        assert redis_client.exists(key("carried")) == 0
    finally:
        other.close()


def test_the_undo_of_a_lost_decision_without_its_connection_is_not_final(
    store: RedisStore, redis_client: Any
) -> None:
    made = claim("unnamed")
    store.decide([made])
    assert store.forget_decision([made], lost_on(None)) is False
    assert redis_client.exists(key("unnamed")) == 0


def test_a_decision_after_the_server_forgot_its_scripts_loads_them_again(
    store: RedisStore, redis_client: Any
) -> None:
    redis_client.script_flush()
    assert store.decide([claim("flushed", "job-f")])[0].verdict is Verdict.CREATED
    assert redis_client.script_exists(store._scripts["decide"].sha) == [True]
    redis_client.script_flush()
    batch = [claim(f"flushed-{n}") for n in range(3)]
    assert [each.verdict for each in store.decide(batch)] == [Verdict.CREATED] * 3
    assert store.get(key("flushed")).job_id == "job-f"  # type: ignore[union-attr]


def test_a_script_that_fails_inside_may_have_written(store: RedisStore, redis_client: Any) -> None:
    redis_client.hset(key("wrong-type"), "field", "value")
    with pytest.raises(BackendUnavailable) as failed:
        store.decide([claim("wrong-type")])
    assert failed.value.code == "backend_unavailable"
    assert failed.value.maybe_applied is True
    assert "WRONGTYPE" in str(failed.value)
    redis_client.delete(key("wrong-type"))
    # The connection is in step after the error: the next decision reads its own reply.
    assert store.decide([claim("after", "job-after")])[0].job_id == "job-after"


def test_a_cluster_no_node_of_which_answers_is_unavailable() -> None:
    with pytest.raises(BackendUnavailable) as failed:
        RedisStore.from_url("redis+cluster://127.0.0.1:1/")
    assert failed.value.code == "backend_unavailable"


def test_a_scheme_is_read_whatever_its_case() -> None:
    built = RedisStore.from_url("REDIS+SENTINEL://127.0.0.1:1/main")
    try:
        assert built.server() is None  # a master found through Sentinel
    finally:
        built.close()


def test_a_server_that_cannot_be_reached_is_unavailable_and_nothing_was_sent() -> None:
    built = RedisStore.from_url("redis://127.0.0.1:1/0?socket_connect_timeout=1")
    try:
        with pytest.raises(BackendUnavailable) as failed:
            built.decide([claim("unreached")])
        assert failed.value.code == "backend_unavailable"
        assert failed.value.maybe_applied is False
        with pytest.raises(BackendUnavailable):
            built.get(key("unreached"))
    finally:
        built.close()


def test_a_pending_decision_reads_its_reply_once(store: RedisStore) -> None:
    pending = store.send_decide([claim("pending", "job-p")])
    first = pending.wait()
    assert pending.wait() == first
    assert first[0].job_id == "job-p"
    assert store.decide([claim("pending", "job-q")])[0].job_id == "job-p"


@contextmanager
def acl_user_url(redis_url: str, *rules: str) -> Iterator[str]:
    """The test database's URL as a new user with ``rules`` (as ``ACL SETUSER`` takes
    them), deleted after."""
    admin = redis.Redis.from_url(redis_url)
    name, password = f"calls-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *rules)
    try:
        yield f"redis://{name}:{password}@{redis_url.split('://', 1)[1]}"
    finally:
        admin.execute_command("ACL", "DELUSER", name)
        admin.close()


@pytest.fixture
def limited_url(redis_url: str) -> Iterator[str]:
    """The test database's URL as a user who may run every command but CONFIG and CLIENT."""
    with acl_user_url(redis_url, "~*", "+@all", "-config", "-client") as url:
        yield url


def test_an_eviction_policy_the_server_will_not_tell_is_unknown(limited_url: str) -> None:
    built = RedisStore.from_url(limited_url)
    try:
        with pytest.raises(EvictionUnknown, match="CONFIG GET maxmemory\\* was refused"):
            built.eviction()
    finally:
        built.close()


def test_the_undo_of_a_lost_decision_by_a_user_without_client_is_refused(
    limited_url: str, redis_client: Any
) -> None:
    built = RedisStore.from_url(limited_url)
    try:
        made = claim("refused-kill")
        built.decide([made])
        gone = ("ID", "999999999", "ADDR", "127.0.0.1:1")
        with pytest.raises(StoreRefused):
            built.forget_decision([made], lost_on(gone))
        assert redis_client.exists(key("refused-kill")) == 1  # nothing rolled back yet
    finally:
        built.close()


#: A database of the test server the tests' own data does not use, for a broker's queue.
QUEUE_DB = 12


@pytest.fixture
def queue_db(redis_url: str) -> Iterator[Any]:
    queues = redis.Redis.from_url(f"{redis_url.rsplit('/', 1)[0]}/{QUEUE_DB}")
    name = f"calls-queue-{uuid.uuid4().hex[:8]}"
    try:
        yield queues, name
    finally:
        queues.delete(name)
        queues.close()


def test_a_created_dispatch_pushes_its_message_and_a_duplicate_none(
    store: RedisStore, queue_db: tuple[Any, str], redis_client: Any
) -> None:
    queues, queue = queue_db
    first = store.decide_enqueue(claim("enq", "job-1"), QUEUE_DB, queue, b"message-1")
    assert (first.verdict, first.job_id) == (Verdict.CREATED, "job-1")
    again = store.decide_enqueue(claim("enq", "job-2"), QUEUE_DB, queue, "message-2")
    assert (again.verdict, again.job_id) == (Verdict.REUSED_ACTIVE, "job-1")
    assert queues.lrange(queue, 0, -1) == [b"message-1"]
    # The store's connection went back to its own database: its key is there.
    assert store.get(key("enq")).job_id == "job-1"  # type: ignore[union-attr]
    assert redis_client.exists(key("enq")) == 1
    assert store.decide([claim("enq-after", "job-3")])[0].verdict is Verdict.CREATED
    assert redis_client.exists(key("enq-after")) == 1


def test_a_batch_pushes_the_messages_of_its_created_claims_and_those_without_a_claim(
    store: RedisStore, queue_db: tuple[Any, str]
) -> None:
    queues, queue = queue_db
    store.decide([claim("held-before", "job-0")])
    batch = [claim("b1", "job-1"), claim("held-before", "job-2"), claim("b3", "job-3")]
    sent = [
        Enqueued(1, queue, "m1"),
        Enqueued(2, queue, "m2"),
        Enqueued(3, queue, b"m3"),
        Enqueued(0, queue, "plain"),
    ]
    decided = store.decide_enqueue_many(batch, False, QUEUE_DB, sent)
    assert [each.verdict for each in decided] == [
        Verdict.CREATED,
        Verdict.REUSED_ACTIVE,
        Verdict.CREATED,
    ]
    assert queues.lrange(queue, 0, -1)[::-1] == [b"m1", b"m3", b"plain"]


def windowed(job: str, fingerprint: str) -> Claim:
    return Claim(job, "calls.task", window=WindowClaim(key("win", "w"), 60_000, fingerprint, "p"))


def test_an_all_or_nothing_batch_with_a_conflict_pushes_nothing(
    store: RedisStore, queue_db: tuple[Any, str], redis_client: Any
) -> None:
    queues, queue = queue_db
    store.decide([windowed("job-0", "fp1")])
    batch = [claim("n1", "job-1"), windowed("job-2", "fp2")]
    sent = [Enqueued(1, queue, "m1"), Enqueued(2, queue, "m2"), Enqueued(0, queue, "plain")]
    decided = store.decide_enqueue_many(batch, True, QUEUE_DB, sent)
    assert decided[1].verdict is Verdict.CONFLICT
    assert queues.llen(queue) == 0
    assert redis_client.exists(key("n1")) == 0


def test_a_delivery_before_its_debounced_start_is_told_how_long_to_wait(
    store: RedisStore,
) -> None:
    debounced = ActiveClaim(
        key("debounced"), Scope.ACTIVE, 60_000, OnDuplicate.DEBOUNCE, "args-1", 30_000, 40_000
    )
    created = store.decide([Claim("job-d", "calls.task", debounced)])[0]
    assert created.starts_at_ms is not None
    run = RunStart("r1", Scope.ACTIVE, "calls.task", 60_000, follows_duplicates=True)
    begun = store.begin_run("job-d", key("debounced"), run)
    assert begun.wait_ms is not None
    assert 25_000 < begun.wait_ms <= 30_000
    assert (begun.holder, begun.busy_ms, begun.arguments) == (None, None, None)
    assert store.start_run("job-d", key("debounced"), run) is None


def connections_named(redis_client: Any, name: str) -> int:
    return sum(1 for client in redis_client.client_list() if client.get("name") == name)


def test_a_scan_left_part_way_keeps_the_stores_connections(
    redis_client: Any, redis_url: str
) -> None:
    name = f"calls-{uuid.uuid4().hex[:8]}"
    built = RedisStore.from_url(f"{redis_url}?client_name={name}")
    try:
        built.decide([claim("s1"), claim("s2")])
        scanning = built.scan()
        assert next(scanning).job_id
        before = connections_named(redis_client, name)
        assert before >= 1
        scanning.close()
        assert connections_named(redis_client, name) == before
    finally:
        built.close()


@pytest.fixture
def keyless_url(redis_url: str) -> Iterator[str]:
    """The test database's URL as a user who may run every command on no key of the store."""
    with acl_user_url(redis_url, "~other:*", "+@all") as url:
        yield url


def test_a_decision_refused_before_its_script_ran_owes_no_undo(keyless_url: str) -> None:
    built = RedisStore.from_url(keyless_url)
    owed_before = cleanup.pending()
    try:
        with pytest.raises(StoreRefused) as refused:
            built.decide([claim("no-access")])
        assert refused.value.maybe_applied is False
        assert cleanup.pending() == owed_before
    finally:
        cleanup.discard(built)
        built.close()


@pytest.mark.parametrize(
    ("error", "raised", "dropped"),
    [
        (KeyboardInterrupt(), KeyboardInterrupt, True),
        (OSError("connection reset by peer"), BackendUnavailable, True),
        (redis.ConnectionError("reset"), BackendUnavailable, False),
    ],
    ids=["interrupted", "from-the-socket", "from-redis-py"],
)
def test_a_scan_ended_by_an_error_redis_py_did_not_see_drops_the_idle_connections(
    redis_client: Any, redis_url: str, error: BaseException, raised: type, dropped: bool
) -> None:
    """An interrupt, or an error from under redis-py (its socket's own), may leave a
    connection with its reply unread or broken: the store drops the pool's idle ones (the
    thread's own, the decision's, stays). redis-py disconnects the connection of an error
    it raised itself, and the others are sound: kept."""
    name = f"calls-{uuid.uuid4().hex[:8]}"
    built = RedisStore.from_url(f"{redis_url}?client_name={name}")
    try:
        built.decide([claim("e1"), claim("e2")])
        scanning = built.scan()
        next(scanning)
        before = connections_named(redis_client, name)
        assert before >= 2, "an idle connection of the pool beside the thread's own"
        with pytest.raises(raised):
            scanning.throw(error)
        assert connections_named(redis_client, name) == (1 if dropped else before)
    finally:
        built.close()


@pytest.mark.parametrize(
    ("stored", "runs"),
    [
        ("", "calls.task"),
        ("calls.task", "calls.task"),
        ("calls.job", "calls.tail"),
        ("calls.tail", "calls.job"),
    ],
    ids=["unprefixed", "its-own-task", "another-task", "another-task-sorting-before"],
)
def test_a_run_that_takes_a_free_key_keeps_the_name_of_its_task(
    store: RedisStore, stored: str, runs: str
) -> None:
    """A run whose key nobody holds (its lease ran out) takes it again: the key reads back
    with the run's task, whether the key names a task (that one, or the one the run
    replaced) or not (``unique_prefix=False``)."""
    free = key(f"free-{uuid.uuid4().hex[:6]}", task=stored)
    assert (
        store.begin_run("job-f", free, RunStart("run-1", Scope.ACTIVE, runs, 60_000)).holder is None
    )
    held = store.get(free)
    assert held is not None
    assert (held.job_id, held.task) == ("job-f", runs)
