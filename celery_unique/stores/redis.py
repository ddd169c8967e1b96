"""The production store: Redis (or Redis Cluster, or anything speaking its protocol).

Each decision is one ``EVALSHA`` of ``lua/decide.lua``: one round trip, atomic
on the server, using the server's clock for every expiry. The scripts and the
key/value layout are documented in the ``.lua`` files themselves.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.resources
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

from celery_unique.exceptions import BackendUnavailable, ImproperlyConfigured, StoreRefused
from celery_unique.keys.keyspace import PREFIX, release_note, split_storage_key
from celery_unique.stores import cleanup
from celery_unique.stores._records import claim_keys
from celery_unique.stores.base import (
    GOES_ON,
    HAND_OVER_UNDONE,
    HANDED_OVER_MARK,
    HANDING_OVER,
    RUNNING,
    Claim,
    DecidedAlready,
    Decision,
    Effect,
    EvictionUnknown,
    FollowUp,
    HeldKey,
    Hold,
    KeyKind,
    OnDuplicate,
    PendingDecisions,
    Release,
    RunBegun,
    RunStart,
    Scope,
    Store,
    Verdict,
)
from celery_unique.stores.masking import masked
from celery_unique.stores.redis_lanes import Lane, Lanes

if TYPE_CHECKING:
    import redis
    from redis.cluster import RedisCluster

logger = logging.getLogger("celery_unique")

T = TypeVar("T")

_SCOPES = {"q": Scope.QUEUED, "a": Scope.ACTIVE, "e": Scope.EXISTS}
SCOPE_CHARS = {scope: char for char, scope in _SCOPES.items()}
_US = "\x1f"
#: How release.lua spells the keeps that release nothing.
_SPECIAL_KEEPS = {
    GOES_ON: "-",
    RUNNING: "+",
    HANDING_OVER: HANDED_OVER_MARK,
    HAND_OVER_UNDONE: "v",
}
_RS = "\x1e"
#: How decide.lua spells each ``OnDuplicate``.
#: The policies by the one-letter spelling decide.lua stores.
_FOLLOWS = {policy.code: policy for policy in OnDuplicate}
#: Connections a store's pool opens at most (``?max_connections=`` in the URL overrides it).
POOL_CONNECTIONS = 100
#: The most claims one decide script takes. A script holds the server (every client
#: of it, the broker's too where they share it) while it runs, some 11 µs a claim on
#: an idle machine: a larger batch is decided in parts, one script each, and other
#: clients get in between. A 1,000-item batch is still one script.
MAX_CLAIMS_PER_SCRIPT = 1_000
#: ... and about this many bytes of claims (``latest`` arguments can be large).
MAX_SCRIPT_BYTES = 4 * 1024 * 1024

_GLOB_SPECIAL = str.maketrans({c: "\\" + c for c in "*?[]\\"})


@functools.cache
def script_source(name: str) -> str:
    """A packaged script with the shared helpers prepended."""
    lua = importlib.resources.files("celery_unique.stores") / "lua"
    return (lua / "common.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImproperlyConfigured(
            "the Redis store needs redis-py: pip install 'celery-unique[redis]'"
        ) from exc
    return redis


#: Error replies that mean "cannot serve now", whatever was asked: the server is
#: out of memory, a replica, loading its data set, busy with a script, cut off
#: from its master or cluster, or refusing writes it cannot persist.
OUTAGE_REPLIES = frozenset(
    {
        "OOM",
        "READONLY",
        "LOADING",
        "BUSY",
        "MASTERDOWN",
        "CLUSTERDOWN",
        "TRYAGAIN",
        "NOREPLICAS",
        "MISCONF",
    }
)
#: redis-py's classes for some of them (it strips the code from their message).
_OUTAGE_CLASSES = (
    "OutOfMemoryError",
    "ReadOnlyError",
    "BusyLoadingError",
    "MasterDownError",
    "ClusterDownError",
    "TryAgainError",
)
#: Replies that say the server refuses what the store's settings ask of it, which no
#: wait will change: a database number it does not have (or any, on a cluster), an
#: ACL user without a command or key the library needs. Redis 7.0 reports an ACL
#: refusal inside a script without its ``NOPERM`` code, and redis-py strips the code
#: from the others.
_REFUSALS = re.compile(
    r"^NOPERM\b|no permissions|user executing the script can't"
    r"|DB index is out of range|invalid DB index|SELECT is not allowed in cluster mode",
    re.IGNORECASE,
)


@functools.cache
def _outage_types() -> tuple[type[BaseException], ...]:
    """Exceptions that say the store is unavailable, not that the request was wrong."""
    redis = _import_redis()
    exceptions = redis.exceptions
    named = tuple(
        getattr(exceptions, name) for name in _OUTAGE_CLASSES if hasattr(exceptions, name)
    )
    return (redis.ConnectionError, redis.TimeoutError, OSError, *named)


@functools.cache
def _store_error_types() -> tuple[type[BaseException], ...]:
    """Everything redis-py (or the socket under it) raises about the store."""
    redis = _import_redis()
    return (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


def is_outage(error: BaseException) -> bool:
    """Whether ``error`` (raised by redis-py) means the store cannot serve right now."""
    if isinstance(error, _outage_types()):
        return True
    redis = _import_redis()
    if isinstance(error, redis.ResponseError):
        # Inside a script an error keeps its code; unknown codes keep it in the text.
        code = str(error).split(" ", 1)[0].lstrip("-").upper()
        return code in OUTAGE_REPLIES
    return False


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` (raised by redis-py) says the store's settings ask what the server
    refuses (:data:`_REFUSALS`)."""
    redis = _import_redis()
    return isinstance(error, redis.ResponseError) and bool(_REFUSALS.search(str(error)))


def store_failure(
    error: BaseException, *, maybe_applied: bool = False
) -> BackendUnavailable | None:
    """The coded error standing for ``error`` raised by redis-py or its socket; ``None`` for
    anything else (a time limit, a signal), which goes on as it is.

    Every error about the store is coded, so that nothing above the store can
    mistake one for a decision: a refusal is :class:`StoreRefused`; an outage,
    and any other error reply (a script's own error, a key of the wrong type),
    :class:`BackendUnavailable`.
    """
    if not isinstance(error, _store_error_types()):
        return None
    if is_refusal(error):
        failure: BackendUnavailable = StoreRefused(
            f"the Redis store refuses what unique_backend asks: {type(error).__name__}: "
            f"{error} ({_refusal_hint(error)})"
        )
        failure.maybe_applied = maybe_applied
        failure.__cause__ = error
        return failure
    if is_outage(error):
        return unavailable(error, maybe_applied=maybe_applied)
    failure = BackendUnavailable(f"the Redis store failed: {type(error).__name__}: {error}")
    failure.maybe_applied = maybe_applied
    failure.__cause__ = error
    return failure


def _refusal_hint(error: BaseException) -> str:
    if "DB index" in str(error) or "SELECT" in str(error):
        return (
            "the server has no such database: name one below its 'databases' setting "
            "(16 by default), and none on a cluster"
        )
    return (
        "the store's Redis user lacks a command celery-unique sends, or access to its "
        "keys, which start with 'unique:'"
    )


def unavailable(error: BaseException, *, maybe_applied: bool = False) -> BackendUnavailable:
    """The :class:`BackendUnavailable` standing for a redis-py outage error."""
    failure = BackendUnavailable(f"Redis store unavailable: {type(error).__name__}: {error}")
    failure.maybe_applied = maybe_applied
    failure.__cause__ = error
    return failure


@dataclass(frozen=True, slots=True)
class Enqueued:
    """A message the decide script pushes where kombu's Redis transport would have."""

    #: The claim it goes with (its position in the batch, from 1); 0: pushed unconditionally.
    claim: int
    #: The list kombu would push it to (priority sub-queue and key prefix included).
    queue: str
    #: The message as kombu serializes it.
    message: bytes | str


class RedisStore(Store):
    """Keys in Redis, decided by server-side scripts."""

    def __init__(self, client: redis.Redis | RedisCluster) -> None:
        self.client = client
        self._redis = _import_redis()
        self._scripts = {
            name: client.register_script(script_source(name))
            for name in ("decide", "release", "rollback", "renew", "forget", "start", "pass_on")
        }
        self._pool = getattr(client, "connection_pool", None)
        self._lanes = Lanes(self._pool) if Lanes.suits(self._pool) else None
        #: A cluster client: a script's keys must share a slot, and calls are split by slot.
        self._cluster = self._pool is None

    @classmethod
    def from_url(cls, url: str) -> RedisStore:
        """``redis://``, ``rediss://``, ``unix://``; ``redis+cluster://`` for Redis Cluster;
        ``redis+sentinel://`` for a master found through Redis Sentinel (see :func:`sentinel`)."""
        redis = _import_redis()
        # A short connect timeout keeps a dead server from stalling dispatches
        # for the OS default of minutes.
        options = {"socket_connect_timeout": 5, "socket_timeout": 10, "decode_responses": False}
        scheme, _, rest = url.partition("://")
        scheme = scheme.lower()
        if scheme.endswith("+sentinel"):
            return cls(sentinel(url, options))
        check_url(url)
        if scheme.endswith("+cluster"):
            # Every script's keys share the namespace's hash tag: one slot per call.
            from redis.cluster import RedisCluster

            try:
                cluster = RedisCluster.from_url(f"{scheme[: -len('+cluster')]}://{rest}", **options)
            except _store_error_types() as exc:  # no node gave the cluster's slots
                failure = store_failure(exc)
                assert failure is not None
                raise failure from exc
            return cls(cluster)
        # redis-py's pool refuses a connection past its cap (100 by default since
        # redis-py 8) at once, with an error: 200 greenlets dispatching together
        # would see the store as down. Past the cap, a dispatch waits for a free
        # connection instead, as long as it would wait for a reply.
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=POOL_CONNECTIONS,
            timeout=options["socket_timeout"],
            health_check_interval=30,
            **options,
        )
        _check_options(url, pool)
        return cls(redis.Redis(connection_pool=pool))

    @contextlib.contextmanager
    def _commands(self) -> Iterator[None]:
        """Run redis-py commands: an outage becomes :class:`BackendUnavailable`; an
        exception raised into a command drops the connection that may carry its reply.

        A soft time limit, a timeout of gevent's or a signal handler can raise
        between the moment redis-py sent a command and the moment it reads the
        reply. redis-py then puts the connection back in its pool with the reply
        still unread, and the next command on it reads that reply as its own (a
        ``SCRIPT LOAD``'s digest taken for the job holding a key, say), and every
        command after it is one reply behind.
        """
        try:
            yield
        except _store_error_types() as exc:
            if not isinstance(exc, self._redis.RedisError):
                self._drop_idle_connections()  # redis-py did not see it: nor did it disconnect
            failure = store_failure(exc)
            assert failure is not None
            raise failure from exc
        except GeneratorExit:
            raise
        except BaseException:
            self._drop_idle_connections()
            raise

    def _drop_idle_connections(self) -> None:
        try:
            if self._pool is not None:
                self._pool.disconnect(inuse_connections=False)
            else:
                self.client.disconnect_connection_pools()  # type: ignore[union-attr]
        except Exception:  # pragma: no cover - closing sockets that are already broken
            logger.debug("could not drop the store's idle connections", exc_info=True)

    def _call(self, name: str, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        with self._commands():
            return self._scripts[name](keys=list(keys), args=list(args))

    def _slot_groups(self, keys: Sequence[str]) -> list[list[int]] | None:
        """Indexes of ``keys`` grouped by hash slot, first seen first; ``None`` when one
        call can take them all (a single server, or one slot)."""
        if not self._cluster or len(keys) < 2:
            return None
        from redis.crc import key_slot

        groups: dict[int, list[int]] = {}
        for index, key in enumerate(keys):
            groups.setdefault(key_slot(key.encode()), []).append(index)
        return list(groups.values()) if len(groups) > 1 else None

    def _call_per_slot(
        self, name: str, calls: Sequence[tuple[list[str], list[str | int]]]
    ) -> list[Any]:
        """Run script ``name`` once per call (each call's keys in one slot of a cluster):
        one pipeline, one round trip, per node that serves any of them.

        redis-py's cluster pipeline refuses scripts, so each node's own client
        carries them; a call the node cannot run (its slot moved, the script is
        not loaded there) did not run, and goes again through the cluster
        client, which follows the cluster.
        """
        redis = self._redis
        script = self._scripts[name]
        nodes: dict[str, tuple[Any, list[int]]] = {}
        replies: list[Any] = [None] * len(calls)
        with self._commands():
            for index, (keys, _) in enumerate(calls):
                node = self.client.get_node_from_key(keys[0])  # type: ignore[union-attr]
                nodes.setdefault(node.name, (node, []))[1].append(index)
            for node, indexes in nodes.values():
                with node.redis_connection.pipeline(transaction=False) as pipe:
                    for index in indexes:
                        keys, args = calls[index]
                        pipe.evalsha(script.sha, len(keys), *keys, *args)
                    answers = pipe.execute(raise_on_error=False)
                for index, answer in zip(indexes, answers, strict=True):
                    if isinstance(
                        answer, (redis.exceptions.NoScriptError, redis.exceptions.AskError)
                    ):
                        keys, args = calls[index]
                        answer = script(keys=keys, args=args)
                    elif isinstance(answer, Exception):
                        raise answer
                    replies[index] = answer
        return replies

    def _call_by_slot(
        self,
        name: str,
        items: Sequence[T],
        first_key: Callable[[T], str],
        arguments: Callable[[Sequence[T]], tuple[list[str], list[str | int]]],
    ) -> list[tuple[list[int], Any]]:
        """Run script ``name`` on ``items``: in one call, or on a cluster whose slots they
        span, once per slot (:meth:`_call_per_slot`). Each call's reply, with the
        indexes of the items it was given."""
        groups = self._slot_groups([first_key(item) for item in items])
        if groups is None:
            return [(list(range(len(items))), self._call(name, *arguments(items)))]
        calls = [arguments([items[index] for index in group]) for group in groups]
        return list(zip(groups, self._call_per_slot(name, calls), strict=True))

    def decide(self, claims: Sequence[Claim], *, all_or_nothing: bool = True) -> list[Decision]:
        return self.send_decide(claims, all_or_nothing=all_or_nothing).wait()

    def send_decide(
        self, claims: Sequence[Claim], *, all_or_nothing: bool = True
    ) -> PendingDecisions:
        if self._cluster:
            return DecidedAlready(self._decide_on_cluster(claims, all_or_nothing))
        if len(script_parts(claims)) > 1:
            return DecidedAlready(self._decide_in_parts(claims, all_or_nothing))
        keys, args = self._decide_arguments(claims, all_or_nothing)
        return _PendingScript(self, self._script_connection(), claims, keys, args)

    def _decide_in_parts(self, claims: Sequence[Claim], all_or_nothing: bool) -> list[Decision]:
        """Decide a batch too large for one script: in parts, one script each, in order.

        Each part sees what the parts before it wrote, so items still behave as
        if dispatched one after another. An all-or-nothing batch refused in one
        part sends no later part and rolls back what the earlier ones created;
        one that fails half-way is undone whole, as a lost decision is.
        """
        decisions: list[Decision] = [Decision(Verdict.CREATED, claim.job_id) for claim in claims]
        decided = 0
        try:
            for start, stop in script_parts(claims):
                part = claims[start:stop]
                reply = self._call("decide", *self._decide_arguments(part, all_or_nothing))
                decisions[start:stop] = self._decisions(part, reply)
                decided = stop
                if all_or_nothing and any(each.verdict.failed for each in decisions[start:stop]):
                    break
        except BackendUnavailable as failure:
            failure.maybe_applied = True
            cleanup.undo_decision(self, claims, failure)
            raise
        except BaseException:
            self._roll_back_created(claims[:decided], decisions[:decided])
            raise
        if all_or_nothing and any(each.verdict.failed for each in decisions[:decided]):
            self._roll_back_created(claims[:decided], decisions[:decided])
        return decisions

    def _roll_back_created(self, claims: Sequence[Claim], decisions: Sequence[Decision]) -> None:
        """Roll back the claims of a failed all-or-nothing batch that a part created."""
        created = [
            claim
            for claim, decision in zip(claims, decisions, strict=True)
            if decision.verdict is Verdict.CREATED
        ]
        try:
            self.rollback_many(created)
        except BackendUnavailable:
            cleanup.roll_back(self, created)  # again in the background, until it lands

    def _decide_on_cluster(self, claims: Sequence[Claim], all_or_nothing: bool) -> list[Decision]:
        """Decide on Redis Cluster: one script per hash slot the claims touch.

        A claim's keys share a slot (the key layout sees to it). Claims of one
        slot are decided together, in order; when an all-or-nothing batch is
        refused in one slot, what the others created is rolled back.
        """
        try:
            # Redis Cluster routes per command: no connection to hold on to, and no
            # telling whether a request whose reply was lost was applied.
            replies = self._call_by_slot(
                "decide",
                claims,
                lambda claim: claim_keys(claim)[0],
                lambda part: self._decide_arguments(part, all_or_nothing),
            )
        except BackendUnavailable as failure:
            failure.maybe_applied = True
            cleanup.undo_decision(self, claims, failure)
            raise
        decisions: list[Decision] = [Decision(Verdict.CREATED, claim.job_id) for claim in claims]
        refused = False
        for group, reply in replies:
            decided = self._decisions([claims[index] for index in group], reply)
            refused = refused or any(decision.verdict.failed for decision in decided)
            for index, decision in zip(group, decided, strict=True):
                decisions[index] = decision
        if refused and all_or_nothing and len(replies) > 1:
            self._roll_back_created(claims, decisions)
        return decisions

    def _script_connection(self) -> _Borrowed | Lane:
        """The dispatching thread's own connection, else one lent by the pool."""
        try:
            # A failure to connect sent nothing: nothing to undo.
            lane = None if self._lanes is None else self._lanes.take()
            return lane if lane is not None else _Borrowed(self._pool)
        except Exception as exc:
            failure = store_failure(exc)
            if failure is not None:
                raise failure from exc
            raise

    def server(self) -> tuple[Any, ...] | None:
        """Where and as whom the store connects (:func:`server_of`); ``None`` for a cluster
        or Sentinel, whose server can change under it."""
        from redis.sentinel import SentinelConnectionPool

        if self._pool is None or isinstance(self._pool, SentinelConnectionPool):
            return None
        return server_of(self._pool)

    @property
    def db(self) -> int:
        return int(self._pool.connection_kwargs.get("db") or 0) if self._pool is not None else 0

    def decide_enqueue(self, claim: Claim, db: int, queue: str, message: bytes | str) -> Decision:
        """Decide one claim and, if created, push ``message`` to list ``queue`` of database
        ``db`` of the same server, in one script: one round trip for the whole dispatch.

        A request whose reply is lost is *not* undone: whatever the script did,
        the key and the message went together (or neither did).
        """
        return self.decide_enqueue_many([claim], True, db, [Enqueued(1, queue, message)])[0]

    def decide_enqueue_many(
        self,
        claims: Sequence[Claim],
        all_or_nothing: bool,
        db: int,
        messages: Sequence[Enqueued],
    ) -> list[Decision]:
        """:meth:`decide` a batch and push, in the same script, the messages of its
        created claims (and those of jobs without uniqueness) to database ``db``.

        An all-or-nothing batch with a conflict pushes nothing. As for one
        dispatch, a lost reply is not undone.
        """
        keys, args = self._decide_arguments(claims, all_or_nothing)
        args += [db, self.db]
        for sent in messages:
            payload = sent.message
            args += [
                sent.claim,
                sent.queue,
                payload.decode() if isinstance(payload, bytes) else payload,
            ]
        pending = _PendingScript(self, self._script_connection(), claims, keys, args, undo=False)
        return pending.wait()

    def _decisions(self, claims: Sequence[Claim], reply: bytes | str) -> list[Decision]:
        text = _text(reply)
        decided = [_decision(result) for result in text.split(_RS)] if text else []
        # An all-or-nothing batch stops at its first conflict and writes nothing;
        # the claims after it are padded so that each claim has a decision, and
        # the caller fails the whole batch on that conflict.
        return decided + [
            Decision(Verdict.CREATED, claim.job_id) for claim in claims[len(decided) :]
        ]

    def _decide_arguments(
        self, claims: Sequence[Claim], all_or_nothing: bool
    ) -> tuple[list[str], list[str | int]]:
        keys: list[str] = []
        index: dict[str, int] = {}

        def position(key: str | None) -> int:
            if key is None:
                return 0
            if key not in index:
                keys.append(key)
                index[key] = len(keys)  # Lua indexes from 1; 0 means "none".
            return index[key]

        args: list[str | int] = ["1" if all_or_nothing else "0", len(claims)]
        for claim in claims:
            active, window = claim.active, claim.window
            args += [
                claim.job_id,
                _stored_task(claim),
                position(active.key if active else None),
                SCOPE_CHARS[active.scope] + (active.generation or "") if active else "",
                "" if active is None or active.lease_ms is None else active.lease_ms,
                position(window.key if window else None),
                window.window_ms if window else "",
                window.fingerprint if window else "",
                window.policy if window else "",
                claim.handoff_from or "",
                active.on_duplicate.code if active else "",
                (active.arguments or "") if active else "",
                _ms(active.debounce_ms) if active else "",
                _ms(active.debounce_max_ms) if active else "",
            ]
        return keys, args

    def release(self, job_id: str, key: str, *, keep_ms: int | None = 0) -> bool:
        return self.release_many([Release(job_id, key, keep_ms)])[0]

    def release_many(self, releases: Sequence[Release]) -> list[bool]:
        if not releases:
            return []

        def arguments(part: Sequence[Release]) -> tuple[list[str], list[str | int]]:
            args: list[str | int] = []
            for release in part:
                keep = release.keep_ms
                args += [
                    release.job_id,
                    "" if keep is None else _SPECIAL_KEEPS.get(keep, keep),
                    release.run or "",
                    release.generation or "",
                ]
            return [release.key for release in part], args

        released = [False] * len(releases)
        for group, reply in self._call_by_slot(
            "release", releases, lambda release: release.key, arguments
        ):
            for index, flag in zip(group, _text(reply), strict=True):
                released[index] = flag == "1"
        return released

    def rollback(self, claim: Claim) -> None:
        self.rollback_many([claim])

    def rollback_many(self, claims: Sequence[Claim]) -> None:
        if claims:
            self._call_by_slot(
                "rollback", claims, lambda claim: claim_keys(claim)[0], self._rollback_arguments
            )

    @staticmethod
    def _rollback_arguments(claims: Sequence[Claim]) -> tuple[list[str], list[str | int]]:
        keys: list[str] = []
        args: list[str | int] = [len(claims)]
        for claim in claims:
            mine = claim_keys(claim)
            keys += mine
            active = claim.active
            has_active = "1" if active is not None else "0"
            generation = (active.generation if active is not None else None) or ""
            args += [claim.job_id, claim.handoff_from or "", has_active, len(mine), generation]
        return keys, args

    def forget_decision(self, claims: Sequence[Claim], error: BackendUnavailable) -> bool:
        """Kill the connection that carried the lost request, then roll its claims back.

        The server runs one connection's commands in order and drops a killed
        client's unread input, so once ``CLIENT KILL`` has answered the lost
        request has either run already (and the rollback sees what it wrote)
        or never will. Without the connection's name (a server before 6.2, an
        ACL refusing ``CLIENT``, Redis Cluster) the rollback cannot be final.
        """
        identity: tuple[str, ...] | None = getattr(error, "_connection", None)
        if identity is not None:
            with self._commands():
                try:
                    self.client.execute_command("CLIENT", "KILL", *identity)  # type: ignore[no-untyped-call]
                except self._redis.ResponseError as exc:
                    if is_outage(exc) or is_refusal(exc):
                        raise
                    # "No such client": it is gone already, and its input with it.
        self.rollback_many(claims)
        return identity is not None

    def start_run(self, job_id: str, key: str, run: RunStart) -> str | None:
        return self.begin_run(job_id, key, run).holder

    def begin_run(self, job_id: str, key: str, run: RunStart) -> RunBegun:
        task = "" if split_storage_key(key)[2] == run.task else run.task
        follows = "1" if run.follows_duplicates else ""
        args = [job_id, run.run, SCOPE_CHARS[run.scope], task, _ms(run.lease_ms), follows]
        args += [_ms(run.alive_ms), run.generation or ""]
        reply = _text(self._call("start", [key, release_note(key, job_id)], args))
        if not reply.startswith(_RS):
            return RunBegun(holder=reply or None)
        kind, value = reply[1], reply[2:]
        if kind == "W":
            return RunBegun(wait_ms=int(value))
        if kind == "B":
            return RunBegun(busy_ms=int(value))
        return RunBegun(arguments=value)

    def pass_on(
        self, job_id: str, key: str, run: str | None, lease_ms: int | None
    ) -> FollowUp | None:
        reply = _text(self._call("pass_on", [key], [job_id, run or "", _ms(lease_ms)]))
        follow = _follow_up(key, reply)
        return None if isinstance(follow, bool) else follow

    def pass_on_or_release(
        self, job_id: str, key: str, run: str | None, lease_ms: int | None, keep_ms: int | None
    ) -> FollowUp | bool:
        keep = "" if keep_ms is None else keep_ms
        args = [job_id, run or "", _ms(lease_ms), "1", keep]
        return _follow_up(key, _text(self._call("pass_on", [key], args)))

    def renew(self, job_id: str, keys: Sequence[str], lease_ms: int) -> int:
        return self.renew_many([Hold(job_id, key) for key in keys], lease_ms)

    def renew_many(
        self, holds: Sequence[Hold], lease_ms: int | None, *, alive_ms: int | None = None
    ) -> int:
        if not holds:
            return 0
        head: list[str | int] = [_ms(lease_ms), _ms(alive_ms)]

        def arguments(part: Sequence[Hold]) -> tuple[list[str], list[str | int]]:
            args = list(head)
            for hold in part:
                args += [hold.job_id, hold.run or ""]
            return [hold.key for hold in part], args

        replies = self._call_by_slot("renew", holds, lambda hold: hold.key, arguments)
        return sum(int(reply) for _, reply in replies)

    def get(self, key: str) -> HeldKey | None:
        with self._commands(), self.client.pipeline(transaction=True) as pipe:
            pipe.get(key)
            pipe.pttl(key)
            value, ttl = pipe.execute()
        return None if value is None else _held(key, value, ttl)

    def scan(self, *, kind: KeyKind | None = None, prefix: str = "") -> Iterator[HeldKey]:
        pattern = prefix.translate(_GLOB_SPECIAL) + "*"
        with self._commands():
            for raw in self.client.scan_iter(match=pattern, count=1000):
                key = raw.decode()
                if not key.startswith(PREFIX):
                    continue  # Not a held key (the namespace registry, another app's data).
                held = self.get(key)
                if held is not None and kind in (None, held.kind):
                    yield held

    def delete(self, key: str, *, job_id: str | None = None, spare_owed: bool = False) -> bool:
        keys = [key] if job_id is None else [key, release_note(key, job_id)]
        return bool(self._call("forget", keys, [job_id or "", "1" if spare_owed else ""]) == 1)

    def eviction(self) -> tuple[int, str] | None:
        with self._commands():
            try:
                config = self.client.config_get("maxmemory*")
            except self._redis.ResponseError as exc:
                # CONFIG refused to this user (an ACL), or renamed (managed services):
                # not an outage, and nothing to tell about the policy.
                raise EvictionUnknown(f"CONFIG GET maxmemory* was refused: {exc}") from exc
        values = {_text(name or ""): _text(value or "") for name, value in config.items()}
        try:
            maxmemory = int(values.get("maxmemory", "0"))
        except ValueError:
            return None
        return maxmemory, values.get("maxmemory-policy", "")

    def register_app(
        self, namespace: str, app: str, tasks: Sequence[str], keep_ms: int
    ) -> dict[str, list[str]]:
        # Outside the key layout's prefix, so that no scan of held keys meets it.
        registry = f"unique:apps:{{{namespace}}}"
        with self._commands():
            now_ms = int(self.client.time()[0]) * 1000
            with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(registry, app, json.dumps({"tasks": sorted(tasks), "at": now_ms}))
                pipe.pexpire(registry, keep_ms)
                pipe.hgetall(registry)
                *_, entries = pipe.execute()
        apps = {}
        for name, raw in entries.items():
            entry = json.loads(raw)
            if now_ms - int(entry.get("at", 0)) <= keep_ms:
                apps[_text(name)] = list(entry.get("tasks", []))
        return apps

    def ping(self) -> None:
        with self._commands():
            self.client.ping()

    def close(self) -> None:
        if self._lanes is not None:
            self._lanes.close()
        self.client.close()


def sentinel(url: str, options: dict[str, Any]) -> Any:
    """A client of the master Redis Sentinel names, for a ``redis+sentinel://`` URL.

    ``redis+sentinel://[[user]:password@]host1:26379,host2:26379/<master name>[/<db>]``,
    with ``rediss+sentinel://`` for TLS to the sentinels, the master and replicas
    alike (so that no password crosses in plain text), with ``ssl_cert_reqs``,
    ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` and ``ssl_ca_path`` for
    both. The password (and user) are the master's; ``?sentinel_password=...``
    (and ``sentinel_username``) are the sentinels' own, and ``socket_timeout`` /
    ``socket_connect_timeout`` override the store's. After a failover the
    client asks the sentinels again; what it sees meanwhile (READONLY, refused
    connections) is ``backend_unavailable``.
    """
    from redis.sentinel import Sentinel

    parts = urlsplit(url)
    credentials, _, hosts = parts.netloc.rpartition("@")
    if "@" in credentials:
        _refuse(
            url,
            "gives credentials more than once: give the master's before the first host "
            "(escape an '@' in a password as %40)",
        )
    sentinels = [_sentinel_address(url, entry) for entry in hosts.split(",")]
    names = [unquote(part) for part in parts.path.split("/") if part]
    if not names:
        _refuse(
            url, "names no master: redis+sentinel://host:26379,host2:26379/<master name>[/<db>]"
        )
    if len(names) > 2:
        _refuse(url, "has more than /<master name>/<db> in its path")
    master, db = names[0], _database(url, names[1] if len(names) > 1 else "0")
    query = _options(url, parts.query)
    unknown = sorted(set(query) - _SENTINEL_OPTIONS)
    if unknown:
        _refuse(
            url,
            f"has options a Sentinel URL does not take: {', '.join(unknown)} "
            f"(it takes {', '.join(sorted(_SENTINEL_OPTIONS))})",
        )
    for name in ("socket_timeout", "socket_connect_timeout"):
        if name in query:
            options = {**options, name: _timeout(url, name, query.pop(name))}
    sentinel_auth = {
        name.removeprefix("sentinel_"): query.pop(name)
        for name in ("sentinel_username", "sentinel_password")
        if name in query
    }
    tls: dict[str, Any] = {name: query.pop(name) for name in _SENTINEL_TLS if name in query}
    if parts.scheme.startswith("rediss"):
        tls["ssl"] = True
    elif tls:
        _refuse(url, f"has TLS options ({', '.join(sorted(tls))}) but is not rediss+sentinel://")
    timeouts = {name: options[name] for name in ("socket_timeout", "socket_connect_timeout")}
    watcher = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        sentinels,
        **timeouts,
        # The sentinels' own connections carry their password: over TLS as well. Named
        # in full: redis-py gives them the timeouts only when it is given no such options.
        sentinel_kwargs={**timeouts, **sentinel_auth, **tls},
    )
    return watcher.master_for(  # type: ignore[no-untyped-call, unused-ignore]
        master,
        db=db,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        **tls,
        **options,
    )


#: The TLS options a ``rediss+sentinel://`` URL takes, for sentinels and master alike.
_SENTINEL_TLS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")
#: The options a ``redis+sentinel://`` URL takes.
_SENTINEL_OPTIONS = frozenset(
    {"socket_timeout", "socket_connect_timeout", "sentinel_username", "sentinel_password"}
    | set(_SENTINEL_TLS)
)
_NUMBER = re.compile(r"[0-9]+")


def check_url(url: str) -> None:
    """Refuse a Redis URL that redis-py would read otherwise than written.

    redis-py reads ``/abc`` as database 0, ``/1/2`` as database 12, a ``?db=``
    over the path's database, and the first of an option given twice; a
    cluster has database 0 only. Each is :class:`ImproperlyConfigured`.
    """
    parts = urlsplit(url)
    parts.port  # noqa: B018 - raises ValueError for a port that is no port
    query = _options(url, parts.query)
    scheme = parts.scheme.lower()
    in_path = None if scheme == "unix" else unquote(parts.path).removeprefix("/") or None
    if in_path is not None and "db" in query:
        _refuse(url, "names its database twice, in its path and as ?db=")
    given = in_path if in_path is not None else query.get("db")
    db = None if given is None else _database(url, given)
    if db and scheme.endswith("+cluster"):
        _refuse(url, "names a database: a cluster has database 0 only")


def _options(url: str, query: str) -> dict[str, str]:
    """A URL's query options; an option given twice is refused (which one was meant?)."""
    found = parse_qs(query, keep_blank_values=True)
    twice = sorted(name for name, values in found.items() if len(values) > 1)
    if twice:
        _refuse(url, f"gives {', '.join(twice)} more than once")
    return {name: values[0] for name, values in found.items()}


def _database(url: str, given: str) -> int:
    if not _NUMBER.fullmatch(given):
        _refuse(url, f"names database {given!r}, which is not a number (0, 1, ...)")
    return int(given)


def _timeout(url: str, name: str, given: object) -> float:
    try:
        seconds = float(given)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        _refuse(url, f"has {name}={given!r}: a timeout is a number of seconds above 0")
    return seconds


def _check_options(url: str, pool: Any) -> None:
    """Refuse what no connection of ``pool`` can be opened with: redis-py hands an option
    it does not know to each new connection, and the first one to connect fails."""
    kwargs = pool.connection_kwargs
    for name in ("socket_timeout", "socket_connect_timeout"):
        if kwargs.get(name) is not None:
            _timeout(url, name, kwargs[name])
    try:
        pool.connection_class(**kwargs)  # builds, connects nothing
    except (TypeError, ValueError, _import_redis().RedisError) as exc:
        _refuse(url, f"has an option its connections do not take ({exc})")


def _sentinel_address(url: str, entry: str) -> tuple[str, int]:
    """``host[:port]`` of one sentinel (``[::1]:26379`` for IPv6)."""
    host, colon, port = entry.rpartition(":")
    if not colon or entry.endswith("]"):
        host, port = entry, "26379"
    if not host or not _NUMBER.fullmatch(port) or not 0 < int(port) < 65536:
        _refuse(url, f"names sentinel {entry!r}: use host:port, with a port from 1 to 65535")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _refuse(url: str, why: str) -> NoReturn:
    raise ImproperlyConfigured(f"unique_backend {masked(url)!r} {why}")


class _Borrowed:
    """A connection lent by redis-py's pool, given back when done."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.connection = pool.get_connection()  # connects, when it must

    def done(self) -> None:
        self.pool.release(self.connection)


class _PendingScript(PendingDecisions):
    """An EVALSHA of ``decide`` sent, its reply not read yet."""

    def __init__(
        self,
        store: RedisStore,
        source: _Borrowed | Lane,
        claims: Sequence[Claim],
        keys: list[str],
        args: list[str | int],
        *,
        undo: bool = True,
    ) -> None:
        self.store, self.claims, self.keys, self.args = store, claims, keys, args
        #: Whether a lost reply owes the undo of its claims (not when they went with a message).
        self.undo = undo
        self.decisions: list[Decision] | None = None
        self.failure: BaseException | None = None
        self.held = source
        self.connection = source.connection
        self.identity = getattr(source, "identity", None)
        script = store._scripts["decide"]
        try:
            self.connection.send_packed_command(
                [resp_command("EVALSHA", script.sha, len(keys), *keys, *args)]
            )
        except BaseException as exc:
            # Part of the request may have left: the server could still run it.
            self._drop()
            raise self._lost(exc) from exc

    def wait(self) -> list[Decision]:
        if self.decisions is not None:
            return self.decisions
        if self.failure is not None:
            raise self.failure  # the connection is gone: never read a reply twice
        try:
            self.decisions = self._read()
        except BaseException as error:
            self.failure = error
            raise
        return self.decisions

    def _read(self) -> list[Decision]:
        redis = self.store._redis
        try:
            try:
                reply = self.connection.read_response()
            except redis.exceptions.NoScriptError:
                # First call on this server (or after SCRIPT FLUSH): EVAL also caches it.
                script = self.store._scripts["decide"]
                self.connection.send_command(
                    "EVAL", script.script, len(self.keys), *self.keys, *self.args
                )
                reply = self.connection.read_response()
        except redis.ResponseError as exc:
            self.held.done()
            # The server answered, with an error. Refused before the script ran
            # (BUSY, LOADING, NOPERM on a key), nothing was written; refused by a
            # command inside it (OOM at its second write), part of it may have been.
            inside = "script:" in str(exc)
            failure = store_failure(exc, maybe_applied=inside)
            assert failure is not None
            if inside and self.undo:
                cleanup.undo_decision(self.store, self.claims, failure)
            raise failure from exc
        except BaseException as exc:
            # Sent, no answer (timeout, reset, interrupted): it may have run.
            self._drop()
            raise self._lost(exc) from exc
        self.held.done()
        return self.store._decisions(self.claims, reply)

    def _lost(self, error: BaseException) -> BaseException:
        """The error to raise for a request that was sent and never answered; owes its undo.

        Whatever interrupted the wait (a timeout, a reset connection, a signal),
        the script may have run: its claims are undone in the background as soon
        as the store answers.
        """
        failure = unavailable(error, maybe_applied=True)
        failure._connection = self.identity  # type: ignore[attr-defined]
        if self.undo:
            cleanup.undo_decision(self.store, self.claims, failure)
        return failure if isinstance(error, _store_error_types()) else error

    def _drop(self) -> None:
        # A connection with an unread or broken reply must never be reused.
        self.connection.disconnect()
        self.held.done()


def script_parts(claims: Sequence[Claim]) -> list[tuple[int, int]]:
    """``(start, stop)`` of the parts a batch is decided in on one server: at most
    ``MAX_CLAIMS_PER_SCRIPT`` claims and about ``MAX_SCRIPT_BYTES`` each."""
    if len(claims) == 1:
        return [(0, 1)]  # every single dispatch: one script, whatever its size
    parts: list[tuple[int, int]] = []
    start = size = 0
    for index, claim in enumerate(claims):
        arguments = claim.active.arguments if claim.active else None
        weight = 256 + len(arguments or "")
        if index > start and (
            index - start >= MAX_CLAIMS_PER_SCRIPT or size + weight > MAX_SCRIPT_BYTES
        ):
            parts.append((start, index))
            start, size = index, 0
        size += weight
    parts.append((start, len(claims)))
    return parts


def resp_command(*parts: str | int) -> bytes:
    """One command in the Redis protocol.

    redis-py's general packer takes about ten microseconds for a decide call,
    a cost on every dispatch; the arguments here are only ``str`` and ``int``.
    """
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part.encode() if isinstance(part, str) else b"%d" % part
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def server_of(pool: Any) -> tuple[Any, ...]:
    """Where a redis-py pool's connections go and as whom: ``(host, port, unix path, TLS,
    user, password digest)``.

    Two clients are on one server as one user only when all of it is equal: a
    script runs with its caller's rights, on its caller's connection. The
    password is kept as a digest, so that no repr shows it.
    """
    import redis

    kwargs: Mapping[str, Any] = pool.connection_kwargs
    password = kwargs.get("password") or ""
    return (
        kwargs.get("host"),
        int(kwargs.get("port") or 6379),
        kwargs.get("path"),
        issubclass(pool.connection_class, redis.SSLConnection),
        kwargs.get("username") or None,
        hashlib.sha256(str(password).encode()).hexdigest() if password else None,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ms(value: int | None) -> int | str:
    return "" if value is None else value


_VERDICTS = {verdict.value: verdict for verdict in Verdict}


def _decision(result: str) -> Decision:
    verdict, job_id, drift, *rest = result.split(_US)
    decided = _VERDICTS[verdict]
    if decided.failed:
        return Decision(decided, job_id, policy_drift=drift == "1", conflicting_job_ids=tuple(rest))
    effect, starts_at = ([*rest, "", ""])[:2]
    return Decision(
        decided,
        job_id,
        policy_drift=drift == "1",
        effect=Effect(effect) if effect else None,
        starts_at_ms=int(starts_at) if starts_at else None,
    )


def _stored_task(claim: Claim) -> str:
    """The task name to store, or "" when every key of the claim already names it.

    Keys scoped to their task carry its name; repeating it in the value would
    cost each key that many bytes of Redis memory.
    """
    if all(split_storage_key(key)[2] == claim.task for key in claim_keys(claim)):
        return ""
    return claim.task


def _follow_up(key: str, reply: str) -> FollowUp | bool:
    """pass_on.lua's reply: the owed run it handed the key to, or whether it ended the hold."""
    if reply in ("", _RS):
        return reply == _RS
    owed, task, arguments = reply.split(_US, 2)
    return FollowUp(owed, arguments, task or split_storage_key(key)[2])


def _held(key: str, value: bytes, ttl: int) -> HeldKey:
    # Values written by earlier versions have fewer fields.
    kind, finished, job_id, task, fingerprint, policy, *rest = value.decode().split(_US)
    since, run, _, follows, owed, arguments, due, _ = ([*rest, *[""] * 8])[:8]
    task = task or split_storage_key(key)[2]
    is_window = kind == "w"
    return HeldKey(
        key=key,
        kind=KeyKind.WINDOW if is_window else KeyKind.ACTIVE,
        job_id=job_id,
        task=task,
        scope=None if is_window else _SCOPES[kind],
        finished=finished == "1",
        expires_in_ms=ttl if ttl >= 0 else None,
        fingerprint=(fingerprint or None) if is_window else None,
        policy=policy or None,
        since_ms=int(since) if since else None,
        run=run or None,
        on_duplicate=_FOLLOWS.get(follows, OnDuplicate.REUSE),
        owed=owed or None,
        arguments=arguments or None,
        starts_in_ms=_starts_in(due),
    )


def _starts_in(due: str) -> int | None:
    """ms until a planned start (``due``, the server's clock), read on this host's clock
    (for people: a planned start is enforced on the server's)."""
    if not due:
        return None
    left = int(due) - time.time_ns() // 1_000_000
    return left if left > 0 else None
