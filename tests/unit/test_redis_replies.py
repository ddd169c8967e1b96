"""The Redis store's side of its scripts, on plain values: the records it reads back, the
replies it decodes, how a batch is cut into scripts, the URLs it refuses, and the code
each redis-py error gets. No server is reached."""

from __future__ import annotations

import hashlib
import time

import pytest
import redis

from celery_unique.exceptions import BackendUnavailable, ImproperlyConfigured, StoreRefused
from celery_unique.stores import redis as store
from celery_unique.stores.base import (
    ActiveClaim,
    Claim,
    Decision,
    Effect,
    FollowUp,
    KeyKind,
    OnDuplicate,
    Scope,
    Verdict,
    WindowClaim,
)

US, RS = "\x1f", "\x1e"
#: A key scoped to its task (the task's name is in it), and one shared by every task.
TASK_KEY = "unique:v1:{ns}:a:tasks.recalc\x1fk1"
SHARED_KEY = "unique:v1:{ns}:a:\x1fk1"
WINDOW_KEY = "unique:v1:{ns}:w:tasks.order\x1freq-1"


def record(*fields: str) -> bytes:
    return US.join(fields).encode()


def test_an_active_record_of_nine_fields_reads_as_held_by_its_job() -> None:
    held = store._held(TASK_KEY, record("q", "", "job-1", "", "gen", "", "1700", "", ""), 5_000)
    assert held.kind is KeyKind.ACTIVE
    assert held.scope is Scope.QUEUED
    assert held.job_id == "job-1"
    assert held.task == "tasks.recalc"  # from the key, the record leaving it out
    assert held.finished is False
    assert held.expires_in_ms == 5_000
    assert held.fingerprint is None  # an active record's fifth field is its generation
    assert held.policy is None
    assert held.since_ms == 1700
    assert held.run is None
    assert held.on_duplicate is OnDuplicate.REUSE
    assert (held.owed, held.arguments, held.starts_in_ms) == (None, None, None)


@pytest.mark.parametrize(
    ("kind", "scope"), [("q", Scope.QUEUED), ("a", Scope.ACTIVE), ("e", Scope.EXISTS)]
)
def test_each_scope_letter_reads_as_its_scope(kind: str, scope: Scope) -> None:
    held = store._held(TASK_KEY, record(kind, "1", "job-1", "", "", ""), 10)
    assert held.scope is scope
    assert held.kind is KeyKind.ACTIVE
    assert held.finished is True


def test_a_record_of_an_earlier_version_with_six_fields_reads_with_the_rest_empty() -> None:
    held = store._held(SHARED_KEY, record("a", "", "job-1", "tasks.other", "", ""), -1)
    assert held.task == "tasks.other"  # a shared key names no task: the record does
    assert held.expires_in_ms is None  # no TTL
    assert held.since_ms is None
    assert held.run is None
    assert held.on_duplicate is OnDuplicate.REUSE


def test_a_ttl_of_zero_is_an_expiry_and_a_negative_one_none() -> None:
    assert store._held(TASK_KEY, record("q", "", "j", "", "", ""), 0).expires_in_ms == 0
    assert store._held(TASK_KEY, record("q", "", "j", "", "", ""), -2).expires_in_ms is None


def test_a_window_record_reads_with_its_fingerprint_and_policy_and_no_scope() -> None:
    held = store._held(WINDOW_KEY, record("w", "", "job-2", "", "fp1", "p1", "42"), 900)
    assert held.kind is KeyKind.WINDOW
    assert held.scope is None
    assert held.fingerprint == "fp1"
    assert held.policy == "p1"
    assert held.task == "tasks.order"
    assert held.since_ms == 42


def test_a_window_record_without_a_fingerprint_reads_none() -> None:
    assert store._held(WINDOW_KEY, record("w", "", "j", "", "", ""), 9).fingerprint is None


@pytest.mark.parametrize(
    ("code", "policy"), [("l", OnDuplicate.LATEST), ("d", OnDuplicate.DEBOUNCE)]
)
def test_every_field_of_a_full_active_record_is_read_from_its_place(
    code: str, policy: OnDuplicate
) -> None:
    due = time.time_ns() // 1_000_000 + 60_000
    fields = ["a", "", "job-1", "", "gen", "", "1700", "run-7", "from-job", code, "owed-job"]
    fields += ["YXJncw==", str(due), str(due + 1), "99", ""]
    held = store._held(TASK_KEY, record(*fields), 1)
    assert held.run == "run-7"
    assert held.on_duplicate is policy
    assert held.owed == "owed-job"
    assert held.arguments == "YXJncw=="
    assert held.starts_in_ms is not None
    assert 50_000 < held.starts_in_ms <= 60_000


def test_a_planned_start_that_passed_is_no_start_in_and_one_still_ahead_is() -> None:
    now = time.time_ns() // 1_000_000
    assert store._starts_in("") is None
    assert store._starts_in(str(now - 1_000)) is None
    assert store._starts_in(str(now - 1)) is None
    ahead = store._starts_in(str(now + 5_000))
    assert ahead is not None
    assert 4_000 < ahead <= 5_000


def test_a_created_decision_reads_with_no_effect() -> None:
    assert store._decision(US.join(["created", "job-1", "0"])) == Decision(Verdict.CREATED, "job-1")


def test_a_reuse_reads_with_its_drift_effect_and_planned_start() -> None:
    reply = US.join(["reused_active", "job-0", "1", "postponed", "1700000000000"])
    assert store._decision(reply) == Decision(
        Verdict.REUSED_ACTIVE,
        "job-0",
        policy_drift=True,
        effect=Effect.POSTPONED,
        starts_at_ms=1_700_000_000_000,
    )


def test_a_reuse_with_an_effect_and_no_start_reads_without_a_start() -> None:
    reply = US.join(["reused_active", "job-0", "0", "arguments_replaced", ""])
    decided = store._decision(reply)
    assert decided.effect is Effect.ARGUMENTS_REPLACED
    assert decided.starts_at_ms is None
    assert decided.policy_drift is False


def test_a_conflict_reads_with_every_conflicting_job() -> None:
    reply = US.join(["composition_conflict", "job-1", "1", "job-a", "job-b"])
    assert store._decision(reply) == Decision(
        Verdict.COMPOSITION_CONFLICT,
        "job-1",
        policy_drift=True,
        conflicting_job_ids=("job-a", "job-b"),
    )


def test_a_batch_reply_is_one_decision_a_claim_padded_after_a_conflict() -> None:
    claims = [Claim(job_id=f"job-{n}", task="t") for n in range(3)]
    reply = RS.join(
        [US.join(["created", "job-0", "0"]), US.join(["conflict", "job-x", "0", "job-y"])]
    )
    decided = store.RedisStore._decisions(None, claims, reply.encode())  # type: ignore[arg-type]
    assert decided == [
        Decision(Verdict.CREATED, "job-0"),
        Decision(Verdict.CONFLICT, "job-x", conflicting_job_ids=("job-y",)),
        Decision(Verdict.CREATED, "job-2"),
    ]
    empty = store.RedisStore._decisions(None, claims[:1], b"")  # type: ignore[arg-type]
    assert empty == [Decision(Verdict.CREATED, "job-0")]


def test_a_pass_on_reply_is_the_owed_run_or_whether_the_hold_ended() -> None:
    assert store._follow_up(TASK_KEY, "") is False
    assert store._follow_up(TASK_KEY, RS) is True
    assert store._follow_up(TASK_KEY, US.join(["owed", "", "a\x1fb"])) == FollowUp(
        "owed", "a\x1fb", "tasks.recalc"
    )
    assert store._follow_up(SHARED_KEY, US.join(["owed", "tasks.x", "args"])) == FollowUp(
        "owed", "args", "tasks.x"
    )


def test_the_task_is_stored_only_where_a_key_of_the_claim_does_not_name_it() -> None:
    scoped = Claim("j", "tasks.recalc", active=ActiveClaim(TASK_KEY, Scope.QUEUED, None))
    assert store._stored_task(scoped) == ""
    shared = Claim("j", "tasks.recalc", active=ActiveClaim(SHARED_KEY, Scope.QUEUED, None))
    assert store._stored_task(shared) == "tasks.recalc"
    mixed = Claim(
        "j",
        "tasks.recalc",
        active=ActiveClaim(TASK_KEY, Scope.QUEUED, None),
        window=WindowClaim(WINDOW_KEY, 10, "fp", "p"),
    )
    assert store._stored_task(mixed) == "tasks.recalc"


def claims(count: int, arguments: str | None = None) -> list[Claim]:
    active = ActiveClaim(TASK_KEY, Scope.QUEUED, None, OnDuplicate.LATEST, arguments)
    return [Claim(f"j{n}", "tasks.recalc", active=active) for n in range(count)]


def test_a_single_claim_is_one_script_whatever_its_size() -> None:
    assert store.script_parts(claims(1, "x" * (store.MAX_SCRIPT_BYTES * 2))) == [(0, 1)]


def test_a_batch_is_cut_at_exactly_the_most_claims_a_script_takes() -> None:
    most = store.MAX_CLAIMS_PER_SCRIPT
    assert most == 1_000
    assert store.script_parts(claims(most)) == [(0, most)]
    assert store.script_parts(claims(most + 1)) == [(0, most), (most, most + 1)]
    assert store.script_parts(claims(2 * most + 1)) == [
        (0, most),
        (most, 2 * most),
        (2 * most, 2 * most + 1),
    ]


def test_a_batch_is_cut_where_its_claims_would_pass_the_bytes_a_script_takes() -> None:
    # Each claim weighs 256 bytes more than its arguments: two of these fill a script.
    assert store.MAX_SCRIPT_BYTES == 4 * 1024 * 1024
    half = store.MAX_SCRIPT_BYTES // 2 - 256
    assert store.script_parts(claims(2, "x" * half)) == [(0, 2)]
    assert store.script_parts(claims(3, "x" * half)) == [(0, 2), (2, 3)]
    assert store.script_parts(claims(2, "x" * (half + 1))) == [(0, 1), (1, 2)]
    assert store.script_parts([]) == [(0, 0)]


def test_a_claim_without_an_active_key_weighs_its_overhead_only() -> None:
    window = Claim("j", "tasks.order", window=WindowClaim(WINDOW_KEY, 10, "fp", "p"))
    room = store.MAX_SCRIPT_BYTES - 2 * 256
    assert store.script_parts([*claims(1, "x" * room), window]) == [(0, 2)]
    assert store.script_parts([*claims(1, "x" * (room + 1)), window]) == [(0, 1), (1, 2)]


REFUSED_URLS = [
    ("redis://h:6379/0?db=0", "names its database twice"),
    ("redis://h:6379/%31", "names its database twice"),  # '1', unquoted, then ?db=
    ("redis://h:6379/?db=x", "names database 'x'"),
    ("redis+cluster://h:7000/?db=2", "a cluster has database 0 only"),
    ("redis://h:6379/0?a=1&a=2&b=1&b=2", "gives a, b more than once"),
]


@pytest.mark.parametrize(("url", "says"), REFUSED_URLS)
def test_a_url_read_otherwise_than_written_is_refused(url: str, says: str) -> None:
    if "%31" in url:
        url += "?db=1"
    with pytest.raises(ImproperlyConfigured) as refused:
        store.check_url(url)
    assert says in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:6379",
        "redis://h:6379/",
        "redis://h:6379/3",
        "redis://h:6379?db=3",
        "redis+cluster://h:7000/0",
        "redis+cluster://h:7000/",
        "REDIS+CLUSTER://h:7000/?db=0",
        "unix:///tmp/redis.sock?db=2",
    ],
)
def test_a_url_read_as_written_passes(url: str) -> None:
    store.check_url(url)


def test_a_unix_socket_path_is_not_read_as_a_database() -> None:
    store.check_url("unix:///tmp/redis.sock?db=1")
    with pytest.raises(ImproperlyConfigured, match="a cluster has database 0 only"):
        store.check_url("REDIS+CLUSTER://h:7000/1")


@pytest.mark.parametrize(("given", "seconds"), [("2.5", 2.5), ("1e-3", 0.001), (3, 3.0)])
def test_a_timeout_above_zero_is_taken_in_seconds(given: object, seconds: float) -> None:
    assert store._timeout("redis://h", "socket_timeout", given) == seconds


@pytest.mark.parametrize("given", ["0", "-1", "inf", "nan", "soon", None])
def test_a_timeout_that_is_no_number_of_seconds_above_zero_is_refused(given: object) -> None:
    with pytest.raises(ImproperlyConfigured, match="a timeout is a number of seconds above 0"):
        store._timeout("redis://h", "socket_timeout", given)


@pytest.mark.parametrize(
    ("entry", "address"),
    [
        ("h1:26380", ("h1", 26380)),
        ("h1", ("h1", 26379)),
        ("[::1]:26381", ("::1", 26381)),
        ("[::1]", ("::1", 26379)),
        ("h1:1", ("h1", 1)),
        ("h1:65535", ("h1", 65535)),
    ],
)
def test_a_sentinel_is_read_as_host_and_port(entry: str, address: tuple[str, int]) -> None:
    assert store._sentinel_address("redis+sentinel://x", entry) == address


@pytest.mark.parametrize("entry", ["h1:0", "h1:65536", ":26379", "h1:", "h1:2x"])
def test_a_sentinel_without_a_host_or_a_port_in_range_is_refused(entry: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="names sentinel"):
        store._sentinel_address("redis+sentinel://x", entry)


OPTIONS = {"socket_timeout": 10, "socket_connect_timeout": 5, "decode_responses": False}


def test_a_sentinel_url_names_its_sentinels_master_database_and_credentials() -> None:
    client = store.sentinel(
        "redis+sentinel://us%40r:p%40ss@h1:26380,[::1]/main%2Fa/4"
        "?socket_timeout=2&sentinel_password=sp&sentinel_username=su",
        dict(OPTIONS),
    )
    pool = client.connection_pool
    manager = pool.sentinel_manager
    assert [
        (
            each.connection_pool.connection_kwargs["host"],
            each.connection_pool.connection_kwargs["port"],
        )
        for each in manager.sentinels
    ] == [("h1", 26380), ("::1", 26379)]
    sentinel_kwargs = manager.sentinels[0].connection_pool.connection_kwargs
    assert (sentinel_kwargs["username"], sentinel_kwargs["password"]) == ("su", "sp")
    # The sentinels' own credentials leave their timeouts the store's (and the URL's).
    assert (sentinel_kwargs["socket_timeout"], sentinel_kwargs["socket_connect_timeout"]) == (2, 5)
    assert pool.service_name == "main/a"
    kwargs = pool.connection_kwargs
    assert kwargs["db"] == 4
    assert (kwargs["username"], kwargs["password"]) == ("us@r", "p@ss")
    assert kwargs["socket_timeout"] == 2.0
    assert kwargs["socket_connect_timeout"] == 5
    assert kwargs.get("ssl") is None


def test_a_sentinel_url_without_credentials_or_database_takes_none_and_zero() -> None:
    client = store.sentinel("redis+sentinel://h1/main?socket_connect_timeout=1.5", dict(OPTIONS))
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    assert kwargs["db"] == 0
    assert kwargs["username"] is None
    assert kwargs["password"] is None
    assert kwargs["socket_connect_timeout"] == 1.5
    assert kwargs["socket_timeout"] == 10
    sentinel = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
    assert sentinel["password"] is None
    assert (sentinel["socket_timeout"], sentinel["socket_connect_timeout"]) == (10, 1.5)


def test_a_rediss_sentinel_url_speaks_tls_to_the_sentinels_and_the_master() -> None:
    client = store.sentinel(
        "rediss+sentinel://h1:26379/main?ssl_cert_reqs=none&ssl_ca_certs=/ca.pem", dict(OPTIONS)
    )
    pool = client.connection_pool
    sentinel = pool.sentinel_manager.sentinels[0].connection_pool
    assert issubclass(sentinel.connection_class, redis.SSLConnection)
    assert sentinel.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    assert (
        sentinel.connection_kwargs["socket_timeout"],
        sentinel.connection_kwargs["socket_connect_timeout"],
    ) == (10, 5)
    assert pool.connection_kwargs["ssl_cert_reqs"] == "none"
    assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    assert issubclass(pool.connection_class, redis.SSLConnection)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://h1:26379", "names no master"),
        ("redis+sentinel://h1:26379/", "names no master"),
        ("redis+sentinel://h1:26379/main/0/1", "has more than /<master name>/<db>"),
        ("redis+sentinel://h1:26379/main?db=1", "options a Sentinel URL does not take: db"),
        ("redis+sentinel://h1:26379/main?ssl_keyfile=k", "has TLS options (ssl_keyfile)"),
    ],
)
def test_a_sentinel_url_that_cannot_be_used_as_written_is_refused(url: str, says: str) -> None:
    with pytest.raises(ImproperlyConfigured) as refused:
        store.sentinel(url, dict(OPTIONS))
    assert says in str(refused.value)


def test_a_sentinel_url_lists_the_options_it_takes() -> None:
    with pytest.raises(ImproperlyConfigured) as refused:
        store.sentinel("redis+sentinel://h1/main?zz=1&aa=2", dict(OPTIONS))
    assert (
        "does not take: aa, zz (it takes sentinel_password, sentinel_username,"
        " socket_connect_timeout, socket_timeout, ssl_ca_certs, ssl_ca_path, ssl_cert_reqs,"
        " ssl_certfile, ssl_keyfile)"
    ) in str(refused.value)


OUTAGES = [
    redis.ConnectionError("refused"),
    redis.TimeoutError("slow"),
    ConnectionResetError("reset"),
    redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
    redis.exceptions.BusyLoadingError("loading"),
    redis.exceptions.ResponseError("BUSY Redis is busy running a script"),
    redis.exceptions.ResponseError("-oom command not allowed"),
    redis.exceptions.ResponseError("MISCONF cannot persist"),
    redis.exceptions.ResponseError("NOREPLICAS Not enough good replicas"),
]


@pytest.mark.parametrize("error", OUTAGES, ids=repr)
def test_an_outage_is_backend_unavailable(error: Exception) -> None:
    assert store.is_outage(error)
    failure = store.store_failure(error, maybe_applied=True)
    assert type(failure) is BackendUnavailable
    assert failure.code == "backend_unavailable"
    assert failure.maybe_applied is True
    assert failure.__cause__ is error
    assert str(failure).startswith("Redis store unavailable: ")
    assert str(error) in str(failure)


@pytest.mark.parametrize(
    "error",
    [
        redis.exceptions.ResponseError("WRONGTYPE Operation against a key"),
        redis.exceptions.ResponseError("ERR user_script:1: oops script: abc"),
        redis.exceptions.ResponseError("OOMX not a code"),
        redis.exceptions.DataError("bad"),
    ],
    ids=repr,
)
def test_any_other_error_of_the_store_is_backend_unavailable_without_outage(
    error: Exception,
) -> None:
    assert not store.is_outage(error)
    assert not store.is_refusal(error)
    failure = store.store_failure(error)
    assert type(failure) is BackendUnavailable
    assert failure.maybe_applied is False
    assert failure.__cause__ is error
    assert str(failure) == f"the Redis store failed: {type(error).__name__}: {error}"


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        (redis.exceptions.ResponseError("NOPERM this user has no permissions"), "lacks a command"),
        (
            redis.exceptions.ResponseError("nopermx: no permissions to access a key"),
            "lacks a command",
        ),
        (redis.exceptions.ResponseError("ERR DB index is out of range"), "no such database"),
        (redis.exceptions.ResponseError("invalid DB index"), "no such database"),
        (
            redis.exceptions.ResponseError("ERR SELECT is not allowed in cluster mode"),
            "no such database",
        ),
        (
            redis.exceptions.ResponseError("ERR The user executing the script can't run this"),
            "lacks a command",
        ),
    ],
    ids=repr,
)
def test_a_refusal_is_store_refused_with_its_hint(error: Exception, hint: str) -> None:
    assert store.is_refusal(error)
    failure = store.store_failure(error, maybe_applied=True)
    assert type(failure) is StoreRefused
    assert failure.maybe_applied is True
    assert failure.__cause__ is error
    assert hint in str(failure)
    assert str(failure).startswith(
        f"the Redis store refuses what unique_backend asks: ResponseError: {error} ("
    )


def test_an_error_that_is_not_the_stores_gets_no_code() -> None:
    assert store.store_failure(KeyboardInterrupt()) is None
    assert store.store_failure(ValueError("x")) is None
    assert not store.is_outage(ValueError("x"))
    assert not store.is_refusal(redis.ConnectionError("NOPERM"))


def test_a_refusal_found_only_mid_text_is_no_refusal_but_a_noperm_code_is() -> None:
    assert not store.is_refusal(redis.exceptions.ResponseError("ERR key NOPERMIT"))
    assert store.is_refusal(redis.exceptions.ResponseError("noperm x"))


def test_a_pool_is_one_server_by_where_and_as_whom_it_connects() -> None:
    pool = redis.ConnectionPool.from_url("redis://us:pw@h1:6380/2")
    assert store.server_of(pool) == (
        "h1",
        6380,
        None,
        False,
        "us",
        hashlib.sha256(b"pw").hexdigest(),
    )
    plain = redis.ConnectionPool.from_url("redis://h1")
    assert store.server_of(plain) == ("h1", 6379, None, False, None, None)
    tls = redis.ConnectionPool.from_url("rediss://h1:7000")
    assert store.server_of(tls)[3] is True
    socket = redis.ConnectionPool.from_url("unix:///tmp/r.sock")
    assert store.server_of(socket)[1:3] == (6379, "/tmp/r.sock")


def test_an_empty_database_option_is_refused_not_dropped() -> None:
    with pytest.raises(ImproperlyConfigured, match="names database ''"):
        store.check_url("redis://h:6379?db=")


def test_an_error_of_a_cluster_client_is_backend_unavailable() -> None:
    error = redis.exceptions.RedisClusterException("no node")
    failure = store.store_failure(error)
    assert type(failure) is BackendUnavailable
    assert failure.__cause__ is error


def test_a_first_claim_larger_than_a_script_takes_is_a_part_of_its_own() -> None:
    huge = claims(1, "x" * store.MAX_SCRIPT_BYTES)
    assert store.script_parts([*huge, *claims(1)]) == [(0, 1), (1, 2)]
    assert store.script_parts([*claims(1), *huge, *claims(1)]) == [(0, 1), (1, 2), (2, 3)]
