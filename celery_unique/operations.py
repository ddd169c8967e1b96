"""What an operator does with held keys, for any store: list, show, release, reap, count.

The Celery CLI (``celery -A proj unique ...``) and the Django management
commands are thin shells around these functions. Everything here works on the
current app's namespace only, through the store contract (``scan``, ``get``,
``delete``, ``release``); nothing knows how a store lays its keys out.

Keys are accepted in three spellings: the display key users read in logs and
errors (``<task name>:<key>``, or the bare key of a key shared across tasks),
and the storage key (``unique:v1:{ns}:a:<task>\\x1f<key>``, the unit separator
also accepted written out as the four characters ``\\x1f``).
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from celery import states

from celery_unique.config import runtime
from celery_unique.exceptions import ImproperlyConfigured
from celery_unique.keys import keyspace
from celery_unique.signals import ReleaseReason, emit_released
from celery_unique.stores.base import HeldKey, KeyKind, Scope, Store

if TYPE_CHECKING:
    from celery import Celery

#: How a storage key's separator may be typed on a command line.
ESCAPED_SEPARATOR = "\\x1f"

_KIND_CHARS = {KeyKind.ACTIVE: keyspace.ACTIVE, KeyKind.WINDOW: keyspace.WINDOW}


class AmbiguousKey(LookupError):
    """A key names several held keys; give its kind or its storage key."""

    def __init__(self, key: str, matches: list[KeyInfo]) -> None:
        names = ", ".join(f"{info.kind.value} {info.printable_storage_key}" for info in matches)
        super().__init__(f"{key!r} names {len(matches)} held keys: {names}")
        self.key = key
        self.matches = matches


class OwedToDuplicates(RuntimeError):
    """A release refused: the key's ``latest``/``debounce`` job holds what its duplicates left
    it (a run owed to them, their arguments, which its next run starts with); releasing
    would lose that."""

    def __init__(self, info: KeyInfo) -> None:
        left = info.duplicates or "their arguments"
        super().__init__(
            f"{info.display_key!r} was not released: its job {info.job_id} follows its "
            f"duplicates (latest/debounce) and releasing it would lose what they left it "
            f"({left}); release it once the job has run, or drop that too (--drop-owed, "
            "drop_owed=True)"
        )
        self.info = info


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """One held key, as an operator reads it."""

    display_key: str
    storage_key: str
    kind: KeyKind
    job_id: str
    #: The task whose dispatch wrote the key.
    task: str
    #: The task name the key is scoped to; ``""`` for a key shared across tasks.
    key_scope: str
    #: How long an active key is held (``None`` for window keys).
    scope: Scope | None
    #: An ``exists`` key kept after its job finished.
    finished: bool
    #: Milliseconds until the store forgets the key; ``None``: never by itself.
    expires_in_ms: int | None
    fingerprint: str | None
    policy: str | None
    #: When a decision wrote the key (ms since the epoch, store's clock), if known.
    since_ms: int | None = None
    #: ``latest``/``debounce``: the job owed a run once this one ends, if one is.
    owed: str | None = None
    #: ``latest``/``debounce``: digest of the arguments the latest duplicate left.
    arguments_digest: str | None = None
    #: ``debounce``: how far off the job's planned start is, if it has not come.
    starts_in_ms: int | None = None

    @classmethod
    def of(cls, held: HeldKey) -> KeyInfo:
        _, _, key_scope, key = keyspace.split_storage_key(held.key)
        return cls(
            display_key=keyspace.display_key(key_scope, key),
            storage_key=held.key,
            kind=held.kind,
            job_id=held.job_id,
            task=held.task,
            key_scope=key_scope,
            scope=held.scope,
            finished=held.finished,
            expires_in_ms=held.expires_in_ms,
            fingerprint=held.fingerprint,
            policy=held.policy,
            since_ms=held.since_ms,
            owed=held.owed,
            arguments_digest=arguments_digest(held.arguments),
            starts_in_ms=held.starts_in_ms,
        )

    @property
    def duplicates(self) -> str:
        """What ``latest``/``debounce`` duplicates left the job, in a few words ("" if nothing)."""
        facts = []
        if self.starts_in_ms is not None:
            facts.append(f"starts in {format_ms(self.starts_in_ms)}")
        if self.arguments_digest is not None:
            facts.append(f"latest arguments {self.arguments_digest}")
        if self.owed is not None:
            facts.append(f"run owed (job {self.owed})")
        return "; ".join(facts)

    @property
    def printable_storage_key(self) -> str:
        return printable(self.storage_key)

    @property
    def state(self) -> str:
        """``held`` (job not finished), ``finished`` (retained) or ``remembered`` (window)."""
        if self.kind is KeyKind.WINDOW:
            return "remembered"
        return "finished" if self.finished else "held"

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values."""
        return {
            "display_key": self.display_key,
            "storage_key": self.storage_key,
            "kind": self.kind.value,
            "job_id": self.job_id,
            "task": self.task,
            "key_scope": self.key_scope,
            "scope": None if self.scope is None else self.scope.value,
            "finished": self.finished,
            "expires_in_ms": self.expires_in_ms,
            "fingerprint": self.fingerprint,
            "policy": self.policy,
            "since_ms": self.since_ms,
            "owed": self.owed,
            "arguments_digest": self.arguments_digest,
            "starts_in_ms": self.starts_in_ms,
        }


def arguments_digest(stored: str | None) -> str | None:
    """A short digest of stored arguments: enough to tell two apart, nothing of their content."""
    if stored is None:
        return None
    return hashlib.sha256(stored.encode()).hexdigest()[:12]


def printable(storage_key: str) -> str:
    """A storage key with its unit separator (and any character that prints nothing or
    reorders the text, as :func:`keyspace.shown` does) written out."""
    return keyspace.shown(storage_key.replace(keyspace.SEPARATOR, ESCAPED_SEPARATOR))


def format_ms(ms: int | None) -> str:
    """A duration for people: ``1d 2h``, ``3m 4s``, ``250ms``; ``never`` for ``None``."""
    if ms is None:
        return "never"
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms // 1000
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        amount, seconds = divmod(seconds, size)
        if amount:
            parts.append(f"{amount}{unit}")
    return " ".join(parts[:2])


def _prefixes(app: Celery, kind: KeyKind | None = None) -> tuple[str, str]:
    """Where the namespace's keys (of ``kind``) start: with the namespace's hash tag, and
    spread (whose kind follows their own tag: the store filters those)."""
    tagged, spread = keyspace.namespace_prefixes(runtime(app).namespace)
    return (tagged if kind is None else f"{tagged}{_KIND_CHARS[kind]}:"), spread


def parse_kind(kind: KeyKind | str | None) -> KeyKind | None:
    """``"active"``/``"window"`` (or a :class:`KeyKind`) -> :class:`KeyKind`."""
    return None if kind is None else KeyKind(kind)


def iter_keys(app: Celery, *, kind: KeyKind | str | None = None) -> Iterator[KeyInfo]:
    """Every key of the app's namespace, in the store's order."""
    wanted = parse_kind(kind)
    store = runtime(app).store
    for prefix in _prefixes(app, wanted):
        for held in store.scan(kind=wanted, prefix=prefix):
            yield KeyInfo.of(held)


def list_keys(
    app: Celery,
    *,
    kind: KeyKind | str | None = None,
    task: str | None = None,
    match: str | None = None,
    limit: int | None = None,
    offset: int = 0,
) -> list[KeyInfo]:
    """Held keys of the app's namespace, ordered by storage key.

    ``task`` keeps keys written by that task; ``match`` is a shell-style
    pattern (``*``, ``?``, ``[...]``) on the display key. ``offset``/``limit``
    page through the ordered result; with a limit only ``offset + limit`` keys
    are kept in memory while the store is scanned.
    """
    if offset < 0 or (limit is not None and limit < 0):
        raise ValueError("offset and limit must not be negative")
    selected: Iterable[KeyInfo] = (
        info
        for info in iter_keys(app, kind=kind)
        if (task is None or info.task == task)
        and (match is None or fnmatchcase(info.display_key, match))
    )
    ordered = (
        sorted(selected, key=_by_storage_key)
        if limit is None
        else heapq.nsmallest(offset + limit, selected, key=_by_storage_key)
    )
    return ordered[offset:]


def _by_storage_key(info: KeyInfo) -> str:
    return info.storage_key


def candidate_storage_keys(namespace: str, key: str, kind: KeyKind | None = None) -> list[str]:
    """Every storage key ``key`` may stand for, most literal reading first.

    A storage key stands for itself (none, if it is another namespace's).
    Otherwise ``key`` is read as a bare key shared across tasks and as
    ``<task name>:<key>`` split at each ``:`` (task names may contain ``:``
    themselves), for each kind, with the namespace's hash tag and spread.
    """
    if key.startswith(keyspace.PREFIX):
        if keyspace.SEPARATOR not in key:
            key = key.replace(ESCAPED_SEPARATOR, keyspace.SEPARATOR, 1)
        return [key] if key.startswith(keyspace.namespace_prefixes(namespace)) else []
    splits = [("", key)] + [
        (key[:at], key[at + 1 :])
        for at, char in enumerate(key)
        if char == ":" and 0 < at < len(key) - 1
    ]
    kinds = [kind] if kind is not None else [KeyKind.ACTIVE, KeyKind.WINDOW]
    readings: list[tuple[str, str, str | None]] = [(scope, rest, None) for scope, rest in splits]
    # A key scoped to a task may be spread (unique_key_spread="key"), under a tag
    # of its own or of its task's.
    for scope, rest in splits[1:]:
        readings += [(scope, rest, keyspace.key_tag(scope, rest))]
        readings += [(scope, rest, keyspace.task_tag(scope))]
    return [
        keyspace.storage_key(namespace, _KIND_CHARS[each], scope, rest, tag=tag)
        for scope, rest, tag in readings
        for each in kinds
    ]


def show(app: Celery, key: str, *, kind: KeyKind | str | None = None) -> list[KeyInfo]:
    """Every held key that ``key`` may name (see :func:`candidate_storage_keys`)."""
    store = runtime(app).store
    found: list[KeyInfo] = []
    for stored in candidate_storage_keys(runtime(app).namespace, key, parse_kind(kind)):
        held = store.get(stored)
        if held is not None:
            found.append(KeyInfo.of(held))
    return found


def resolve(
    app: Celery, key: str, *, kind: KeyKind | str | None = None, job_id: str | None = None
) -> KeyInfo | None:
    """The one held key ``key`` names (held by ``job_id`` when given); ``None`` if none.

    Raises :class:`AmbiguousKey` when it names several.
    """
    matches = [info for info in show(app, key, kind=kind) if job_id in (None, info.job_id)]
    if len(matches) > 1:
        raise AmbiguousKey(key, matches)
    return matches[0] if matches else None


def release(
    app: Celery,
    key: str,
    *,
    job_id: str | None = None,
    kind: KeyKind | str | None = None,
    drop_owed: bool = False,
) -> bool:
    """Forget a held key now; return whether it was there to forget.

    The delete is a compare-and-delete on the holder read just before, so a
    key that changed hands in between is left alone; with ``job_id`` the key
    is only forgotten while that job holds it. Raises :class:`AmbiguousKey`
    when ``key`` names several held keys (pass ``kind`` or the storage key).

    The job goes on; but a ``latest``/``debounce`` job keeps with its key what
    its duplicates left it (a run owed to them, the arguments it is to start
    with). Such a key is kept, :class:`OwedToDuplicates` raised, unless
    ``drop_owed``: then that is dropped with the key.
    """
    info = resolve(app, key, kind=kind, job_id=job_id)
    if info is None:
        return False
    spared: list[KeyInfo] = []
    if _release_held(app, info, drop_owed, spared):
        return True
    if spared:
        raise OwedToDuplicates(spared[0])
    return False


def release_many(
    app: Celery,
    keys: Iterable[KeyInfo],
    *,
    drop_owed: bool = False,
    spared: list[KeyInfo] | None = None,
) -> list[KeyInfo]:
    """Forget each of these held keys (as :func:`list_keys` found them); return those forgotten.

    Each delete is a compare-and-delete on the job the key was found with: a key
    that changed hands since it was listed is left alone, and not returned. A
    key kept for what its job owes its duplicates (see :func:`release`) is
    appended to ``spared``.
    """
    kept: list[KeyInfo] = [] if spared is None else spared
    return [info for info in keys if _release_held(app, info, drop_owed, kept)]


def _release_held(app: Celery, info: KeyInfo, drop_owed: bool, spared: list[KeyInfo]) -> bool:
    store = runtime(app).store
    released = store.delete(info.storage_key, job_id=info.job_id, spare_owed=not drop_owed)
    if released:
        emit_released(
            app, info.job_id, info.storage_key, task_name=info.task, reason=ReleaseReason.OPERATOR
        )
    elif not drop_owed:
        kept = kept_for_duplicates(store, info.storage_key, info.job_id)
        if kept is not None:
            spared.append(KeyInfo.of(kept))
    return released


def kept_for_duplicates(store: Store, storage_key: str, job_id: str) -> HeldKey | None:
    """After ``store.delete(storage_key, job_id=job_id, spare_owed=True)`` deleted nothing:
    the hold the store kept for what its job's duplicates left it, or ``None`` when the
    key no longer names that job (it changed hands or went)."""
    held = store.get(storage_key)
    return held if held is not None and held.job_id == job_id else None


#: States in which a job can no longer run: its keys are orphans if still held.
FINAL_STATES = states.READY_STATES


@dataclass(frozen=True, slots=True)
class Orphan:
    """A key still held for a job that has ended."""

    key: KeyInfo
    #: The job's state in the result backend.
    state: str
    #: How long the release keeps the key (``exists``): ms, or ``None`` for ever.
    keep_ms: int | None


@dataclass(slots=True)
class ReapReport:
    """What :func:`reap` looked at and did."""

    applied: bool
    #: Unfinished active keys looked at.
    checked: int = 0
    orphans: list[Orphan] = field(default_factory=list)
    #: Orphans actually released (only with ``apply=True``; a key taken over
    #: by another job in the meantime is left alone).
    released: list[Orphan] = field(default_factory=list)
    #: Jobs found alive or unknown to the result backend, per state.
    kept: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        def orphan(item: Orphan) -> dict[str, Any]:
            return {**item.key.as_dict(), "state": item.state, "keep_ms": item.keep_ms}

        return {
            "applied": self.applied,
            "checked": self.checked,
            "orphans": [orphan(item) for item in self.orphans],
            "released": [orphan(item) for item in self.released],
            "kept": dict(self.kept),
        }


def job_state(app: Celery, job_id: str) -> str:
    """The job's state in the result backend (``PENDING`` when it knows nothing)."""
    return str(app.AsyncResult(job_id).state)


#: How :func:`reap` counts a job whose recorded failure may not be its end.
MAY_BE_REQUEUED = "FAILURE_MAY_BE_REQUEUED"


def failure_may_requeue(app: Celery, task_name: str, job_id: str) -> bool:
    """Whether the job's recorded ``FAILURE`` may be followed by another run of its message.

    A hard time limit records the failure, and then, for a task with ``acks_late``
    and ``acks_on_failure_or_timeout=False``, requeues the message: the job runs
    again (the result backend says ``FAILURE`` until that run ends), and its key
    must stay held. Such a failure is left to the job's own release or its lease.
    """
    task = app.tasks.get(task_name)
    acks_late = getattr(task, "acks_late", app.conf.task_acks_late)
    acks_anyway = getattr(
        task, "acks_on_failure_or_timeout", app.conf.task_acks_on_failure_or_timeout
    )
    if not acks_late or acks_anyway:
        return False
    # The worker's main process records a time limit as TimeLimitExceeded; a class the
    # reading process cannot import comes back as one made up under the same name.
    return type(app.AsyncResult(job_id).result).__name__ == "TimeLimitExceeded"


#: How far apart the result backend's clock (the workers') and the store's may be.
CLOCK_SKEW_MS = 1000


def ended_before(app: Celery, job_id: str, since_ms: int | None) -> bool:
    """Whether the job's recorded end predates ``since_ms`` (the key is a later job's).

    A caller that reuses a fixed ``task_id`` dispatches a new job under the id
    of one that ended: the result backend still says the old job's final state
    until the new one ends. Its key, written after that end, is not an orphan.
    """
    if since_ms is None:
        return False
    done = app.AsyncResult(job_id).date_done
    if isinstance(done, str):
        done = datetime.fromisoformat(done)
    if not isinstance(done, datetime):
        return False
    if done.tzinfo is None:
        done = done.replace(tzinfo=timezone.utc)  # Celery records date_done in UTC
    return done.timestamp() * 1000 < since_ms - CLOCK_SKEW_MS


def _check_result_backend(app: Celery) -> None:
    from celery.backends.base import DisabledBackend

    if isinstance(app.backend, DisabledBackend):
        raise ImproperlyConfigured(
            "reaping needs a result backend (result_backend) to prove a job has ended; "
            "without one, keys of lost jobs are freed by their lease (unique_lease)"
        )


def retention_ms(app: Celery, info: KeyInfo) -> int | None:
    """How long an ``exists`` key outlives its job: the task's declaration, else result_expires.

    (The job's message header carries the exact value; a reaper does not have it.)
    """
    task = app.tasks.get(info.task)
    declaration = getattr(task, "__unique__", None)
    declared: int | None = getattr(declaration, "retention_ms", None)
    return declared if declared is not None else runtime(app).default_retention_ms


def reap(app: Celery, *, apply: bool = False) -> ReapReport:
    """Find (and with ``apply`` release) active keys whose job has ended.

    A key is an orphan when it is an unfinished active-type key and its job's
    state in the result backend is final (success, failure, revoked,
    rejected) and was recorded after the key was written. Jobs that may still
    run (``PENDING``, ``RECEIVED``, ``STARTED``, ``RETRY``, and a ``FAILURE`` by a
    hard time limit whose message is requeued: :func:`failure_may_requeue`,
    counted as ``FAILURE_MAY_BE_REQUEUED``) keep their keys: a
    job the result backend has never heard of (or forgotten) is left to its
    lease, and so is a key written after its job id's recorded end (a new job
    under a reused ``task_id``: counted as ``REUSED_ID``). Releases are
    compare-and-delete on the job id and keep ``exists`` keys for their
    retention, exactly as the worker would have.
    """
    _check_result_backend(app)
    store = runtime(app).store
    report = ReapReport(applied=apply)
    for info in iter_keys(app, kind=KeyKind.ACTIVE):
        if info.finished:
            continue
        report.checked += 1
        state = job_state(app, info.job_id)
        if state not in FINAL_STATES:
            report.kept[state] += 1
            continue
        if ended_before(app, info.job_id, info.since_ms):
            report.kept["REUSED_ID"] += 1
            continue
        if state == states.FAILURE and failure_may_requeue(app, info.task, info.job_id):
            report.kept[MAY_BE_REQUEUED] += 1
            continue
        keep = retention_ms(app, info) if info.scope is Scope.EXISTS else 0
        orphan = Orphan(key=info, state=state, keep_ms=keep)
        report.orphans.append(orphan)
        if apply and store.release(info.job_id, info.storage_key, keep_ms=keep):
            report.released.append(orphan)
            emit_released(
                app,
                info.job_id,
                info.storage_key,
                task_name=info.task,
                reason=ReleaseReason.REAPED,
                kept=keep != 0,
            )
    return report


def stats(app: Celery) -> dict[str, Any]:
    """Counts of the namespace's keys: per kind, per scope, per task, held vs finished."""
    kinds: Counter[str] = Counter()
    scopes: Counter[str] = Counter()
    holds: Counter[str] = Counter()
    tasks: dict[str, Counter[str]] = {}
    for info in iter_keys(app):
        kinds[info.kind.value] += 1
        if info.scope is not None:
            scopes[info.scope.value] += 1
        holds[info.state] += 1
        column = info.kind.value if info.kind is KeyKind.WINDOW else info.state
        tasks.setdefault(info.task, Counter())[column] += 1
    return {
        "namespace": runtime(app).namespace,
        "keys": sum(kinds.values()),
        "kinds": {kind.value: kinds[kind.value] for kind in KeyKind},
        "scopes": {scope.value: scopes[scope.value] for scope in Scope},
        "held": holds["held"],
        "finished": holds["finished"],
        "tasks": {
            name: {column: counts[column] for column in ("held", "finished", "window")}
            for name, counts in sorted(tasks.items())
        },
    }
