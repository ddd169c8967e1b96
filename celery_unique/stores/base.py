"""The contract every uniqueness store implements.

A store answers one question atomically: *given these claims, which jobs do
they resolve to?* It never sees task arguments; the dispatch path hands it
opaque storage keys, job ids and digests, and it hands back decisions.

Units and clocks
    Every duration is whole milliseconds. Expiry is measured on the store's own
    clock (the Redis server's, the database's, this host's for SQLite and
    memory), never the producer's, so skewed producers agree.

Atomicity
    :meth:`Store.decide` evaluates a whole batch as one atomic step with
    sequential semantics: item *n* sees what items *0..n-1* wrote. Release,
    rollback and renew are compare-and-set on the job id: they only touch a
    key that still points at the job named, so they are idempotent and safe to
    call from any process, any number of times.

Failures
    Every failure that is not caused by the request itself (unreachable,
    timed out, out of memory, read-only, loading, busy, ...) raises
    :class:`~celery_unique.exceptions.BackendUnavailable`. When a decision's
    request may have been applied although its answer never arrived, the
    error says so (``maybe_applied``) and :meth:`Store.forget_decision` undoes
    it.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from celery_unique.exceptions import BackendUnavailable


class EvictionUnknown(Exception):
    """The store may evict keys, but its settings cannot be read (a refused command)."""


class Scope(str, enum.Enum):
    """How long an active-type key is held."""

    QUEUED = "queued"
    ACTIVE = "active"
    EXISTS = "exists"


class KeyKind(str, enum.Enum):
    ACTIVE = "active"
    WINDOW = "window"


class OnDuplicate(str, enum.Enum):
    """What a duplicate does to the job holding an active key (``unique_on_duplicate``)."""

    #: Nothing: it is handed the holder.
    REUSE = "reuse"
    #: The holder runs with the duplicate's arguments; one re-run is owed if it runs already.
    LATEST = "latest"
    #: As ``LATEST``, and a holder that has not started yet starts later.
    DEBOUNCE = "debounce"

    @property
    def code(self) -> str:
        """Its one-letter spelling, in key headers and Redis values ("" for ``REUSE``)."""
        return _POLICY_CODES[self]


_POLICY_CODES = {OnDuplicate.REUSE: "", OnDuplicate.LATEST: "l", OnDuplicate.DEBOUNCE: "d"}


@dataclass(frozen=True, slots=True)
class ActiveClaim:
    """Hold ``key`` for the job while it is queued/running (and retained, for ``exists``)."""

    key: str
    scope: Scope
    #: Expire the hold after this long unless renewed; ``None`` holds until released.
    lease_ms: int | None
    on_duplicate: OnDuplicate = OnDuplicate.REUSE
    #: ``LATEST``/``DEBOUNCE``: the dispatch's arguments, encoded (opaque to the store).
    arguments: str | None = None
    #: ``DEBOUNCE``: a job that has not started starts this long after the last duplicate
    #: (or after its creation: the dispatch's own countdown/eta, when that is later)...
    debounce_ms: int | None = None
    #: ...but never later than this long after the dispatch that created it (``None``: no cap).
    debounce_max_ms: int | None = None
    #: This dispatch's own token, kept with the key it creates: a job id can be dispatched
    #: again (a caller's ``task_id``), and a release naming the generation it ends
    #: leaves alone the key of a later dispatch of the same id. ``None``: none.
    generation: str | None = None


@dataclass(frozen=True, slots=True)
class WindowClaim:
    """Remember ``key`` -> job for exactly ``window_ms`` from the first dispatch."""

    key: str
    window_ms: int
    #: Digest of everything that makes two requests "the same request".
    fingerprint: str
    #: Digest of retry/time-limit settings: a difference here is drift, not conflict.
    policy: str


@dataclass(frozen=True, slots=True)
class Claim:
    """What one dispatch asks of the store."""

    job_id: str
    task: str
    active: ActiveClaim | None = None
    window: WindowClaim | None = None
    #: A running job that holds ``active.key`` and may pass it on to ``job_id``
    #: (a task that chains to itself): the key moves instead of deduplicating.
    handoff_from: str | None = None


class Verdict(str, enum.Enum):
    #: The keys now point at the claim's job: publish it.
    CREATED = "created"
    #: An active key is held by a job (another, or this very id sent before); nothing to publish.
    REUSED_ACTIVE = "reused_active"
    #: The window key already maps this very request to a job; nothing to publish.
    REUSED_WINDOW = "reused_window"
    #: The window key is known with a different request fingerprint.
    CONFLICT = "conflict"
    #: The window key and the active key point at two different jobs.
    COMPOSITION_CONFLICT = "composition_conflict"

    @property
    def publishes(self) -> bool:
        return self is Verdict.CREATED

    @property
    def failed(self) -> bool:
        return self in (Verdict.CONFLICT, Verdict.COMPOSITION_CONFLICT)


class Effect(str, enum.Enum):
    """What a ``REUSED_ACTIVE`` duplicate did to the holder (``latest``/``debounce``)."""

    #: The holder has not started: it will run with this dispatch's arguments.
    ARGUMENTS_REPLACED = "arguments_replaced"
    #: The same, and its start moved later (:attr:`Decision.starts_at_ms`).
    POSTPONED = "postponed"
    #: The holder runs: one run with this dispatch's arguments follows it.
    RERUN_REQUESTED = "rerun_requested"


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    #: The job the dispatch resolves to: the claim's own id, or the existing one.
    job_id: str
    policy_drift: bool = False
    conflicting_job_ids: tuple[str, ...] = ()
    effect: Effect | None = None
    #: ``debounce``: when the job is planned to start, ms since the epoch on the store's
    #: clock (the start the store holds: never earlier than a previous answer's, and
    #: exactly the cap once capped).
    starts_at_ms: int | None = None


#: ``Release.keep_ms`` of a run that ended while its job goes on (retried,
#: requeued, replaced): the key stays, only the run's mark on it goes.
GOES_ON = -1
#: ``Release.keep_ms`` of a run that started: the key the job holds gets the
#: run's mark (nothing else changes; a key the job does not hold is left alone).
RUNNING = -2
#: ``Release.keep_ms`` of a run about to hand its job over to a replacement (or
#: to its next attempt):
#: the key stays, marked as handed over by the run. A release that names the
#: run (a time limit that struck after the replacement left, say) leaves it
#: alone; the replacement's start takes the key as the job's next run.
HANDING_OVER = -3
#: ``Release.keep_ms`` that undoes :data:`HANDING_OVER` (no replacement was sent):
#: the key is marked by the run again.
HAND_OVER_UNDONE = -4
#: How a key handed over by run ``r`` is marked: ``HANDED_OVER_MARK + r``.
HANDED_OVER_MARK = "^"
#: Between the job and the delivery (run id) that passed its key on, in the record's
#: own passed-on field (never in a field that holds a caller's id): ``j + PASSED_ON_RUN
#: + r``. A job id holds no control character, so the pair is read back exactly. Only
#: that delivery is answered again (a lost answer); a copy of the job delivered again
#: passes nothing on.
PASSED_ON_RUN = "\x1e"


class Release(NamedTuple):
    """One job's hold on one active key, to end."""

    job_id: str
    key: str
    #: 0 deletes the key; ``n`` keeps it (finished) ``n`` ms; ``None`` keeps it for
    #: ever; :data:`GOES_ON` keeps it as it is and only ends the run;
    #: :data:`RUNNING` only marks the run; :data:`HANDING_OVER` marks it handed
    #: over, :data:`HAND_OVER_UNDONE` marks it the run's again.
    keep_ms: int | None = 0
    #: The delivery whose run ended (see :meth:`Store.start_run`); ``None`` when the
    #: message never ran. Either way the key is left alone while another delivery
    #: of the same job runs.
    run: str | None = None
    #: The dispatch whose hold ends (:attr:`ActiveClaim.generation`): a key that a later
    #: dispatch of the same job id created is left alone. ``None``: any dispatch of it.
    generation: str | None = None


@dataclass(frozen=True, slots=True)
class RunStart:
    """A delivery of a job about to run: what :meth:`Store.start_run` needs."""

    #: The delivery's own id: two copies of one message have different ones.
    run: str
    scope: Scope
    task: str
    lease_ms: int | None
    #: The job's duplicates may have left it arguments or a later start
    #: (``latest``/``debounce``): :meth:`Store.begin_run` reports them.
    follows_duplicates: bool = False
    #: How long the start vouches that this run is alive (its worker's renewals
    #: vouch again, see :meth:`Store.renew_many`): until then no other delivery of
    #: the job takes its mark. ``None``: the run is never vouched for.
    alive_ms: int | None = None
    #: The dispatch the delivery carries (:attr:`ActiveClaim.generation`), if known.
    generation: str | None = None


@dataclass(frozen=True, slots=True)
class RunBegun:
    """What :meth:`Store.begin_run` found."""

    #: Another job holds the key: this delivery is stale and must not run.
    holder: str | None = None
    #: The arguments the latest duplicate left (encoded), to run with.
    arguments: str | None = None
    #: The job's planned start is this far off: it was not marked and must not run yet.
    wait_ms: int | None = None
    #: Another delivery of the job runs, vouched alive for this long still: this one
    #: was not marked and must not run yet.
    busy_ms: int | None = None


class Hold(NamedTuple):
    """A job's hold on an active key, to renew; ``run``: the delivery running it here."""

    job_id: str
    key: str
    run: str | None = None


@dataclass(frozen=True, slots=True)
class FollowUp:
    """The owed run that took a finished job's key over (:meth:`Store.pass_on`)."""

    job_id: str
    #: The latest duplicate's arguments (encoded), to publish it with.
    arguments: str
    #: The task to publish it as (the one that wrote the key).
    task: str


@dataclass(frozen=True, slots=True)
class HeldKey:
    """A key as the store holds it now (for explain, the CLI and the admin)."""

    key: str
    kind: KeyKind
    job_id: str
    task: str
    scope: Scope | None = None
    #: For active keys: the job has finished and the key is kept for retention.
    finished: bool = False
    #: Milliseconds until the store forgets the key; ``None`` if it never expires.
    expires_in_ms: int | None = None
    fingerprint: str | None = None
    policy: str | None = None
    #: When a decision wrote the key: ms since the epoch on the store's clock
    #: (``None`` for keys written before stores recorded it).
    since_ms: int | None = None
    #: The delivery of the job running now, if one is (see :meth:`Store.start_run`).
    run: str | None = None
    #: What the job does with its duplicates (its dispatch's ``unique_on_duplicate``).
    on_duplicate: OnDuplicate = OnDuplicate.REUSE
    #: The job owed a run after this one (``latest``/``debounce``), if one is.
    owed: str | None = None
    #: The arguments the latest duplicate left, encoded (``latest``/``debounce``).
    arguments: str | None = None
    #: ``debounce``: the job's planned start is this far off (``None``: none, or passed).
    starts_in_ms: int | None = None


@dataclass(frozen=True, slots=True)
class StoreStats:
    active: int = 0
    window: int = 0
    extra: dict[str, object] = field(default_factory=dict)


class PendingDecisions(ABC):
    """Decisions asked for and not yet read: the store works while the caller does."""

    @abstractmethod
    def wait(self) -> list[Decision]:
        """The decisions (read once, then cached); raises like :meth:`Store.decide`."""


class DecidedAlready(PendingDecisions):
    """For stores that answer on the spot."""

    def __init__(self, decisions: list[Decision]) -> None:
        self.decisions = decisions

    def wait(self) -> list[Decision]:
        return self.decisions


class Store(ABC):
    """A uniqueness store. Instances are per process; create them after fork."""

    @abstractmethod
    def decide(self, claims: Sequence[Claim], *, all_or_nothing: bool = True) -> list[Decision]:
        """Decide every claim in one atomic step, in order; write what the verdicts say.

        With ``all_or_nothing`` a single failed verdict (conflict) means nothing
        at all is written; the decisions are still returned so the caller can
        tell which item failed. Otherwise failed items write nothing and the
        others proceed as if the failed ones were absent.
        """

    def send_decide(
        self, claims: Sequence[Claim], *, all_or_nothing: bool = True
    ) -> PendingDecisions:
        """Start :meth:`decide` and return at once; the decisions are read with ``wait()``.

        The store applies the decisions when it receives the request, exactly as
        ``decide`` would; only the reading of the answer is deferred, so the
        caller can build its broker message meanwhile. Stores without a
        network round trip answer on the spot.
        """
        return DecidedAlready(self.decide(claims, all_or_nothing=all_or_nothing))

    @abstractmethod
    def release(self, job_id: str, key: str, *, keep_ms: int | None = 0) -> bool:
        """End ``job_id``'s hold on the active ``key``; return whether it held it.

        ``keep_ms=0`` deletes the key; a positive value keeps it (marked finished)
        for that long; ``None`` keeps it with no expiry. Keys held by another job
        are left alone.
        """

    def release_many(self, releases: Sequence[Release]) -> list[bool]:
        """End many holds at once; for each, whether it changed its key.

        Stores override this to do it in one round trip: a worker sends the
        releases of every job that ended meanwhile together.
        """
        return [self.release(r.job_id, r.key, keep_ms=r.keep_ms) for r in releases]

    @abstractmethod
    def rollback(self, claim: Claim) -> None:
        """Undo what a ``CREATED`` decision of ``claim`` wrote (the publish failed).

        Keys go back to ``claim.handoff_from`` when the claim took them over,
        and are freed otherwise; keys no longer pointing at the claim's job
        are left alone.
        """

    def rollback_many(self, claims: Sequence[Claim]) -> None:
        """:meth:`rollback` every claim (in one round trip where the store can)."""
        for claim in claims:
            self.rollback(claim)

    def forget_decision(self, claims: Sequence[Claim], error: BackendUnavailable) -> bool:
        """Undo what a decision may have written although its answer was lost.

        ``error`` is what :meth:`decide` (or ``wait()``) raised, with
        ``maybe_applied`` set. Every claim's job is one that was never
        published, so undoing is a rollback, always safe. Returns whether the
        undo is final: ``False`` when the lost request could still arrive at the
        store later (the caller repeats the undo a few times). Raises
        :class:`~celery_unique.exceptions.BackendUnavailable` while the store
        does not answer.
        """
        self.rollback_many(claims)
        return True

    def start_run(self, job_id: str, key: str, run: RunStart) -> str | None:
        """Mark the active ``key`` as held by a run of ``job_id`` (delivery ``run.run``).

        Called in the worker before the job's body runs. A key the job holds
        gets the run's mark (and is unfinished again, with at least a lease);
        a key nobody holds (its lease ran out, or another delivery of the job
        ended and released it) is taken again. Returns ``None`` then, or the
        id of the other job that holds the key now, writing nothing: this
        delivery is a copy of a job whose key moved on, and must not run. A
        job that handed its key over while it ran (self-rescheduling) runs
        on without it, and so does a job whose key an operator released
        (:meth:`delete`) before another job took it: it still runs, unmarked,
        beside that job. Stores that cannot mark runs return ``None``.

        A key marked by another delivery of the job that is still vouched
        alive (``run.alive_ms`` at its start, renewals since) is not marked:
        :meth:`begin_run` reports how long it is vouched for
        (:attr:`RunBegun.busy_ms`), and this method returns ``None``.
        """
        return None

    def begin_run(self, job_id: str, key: str, run: RunStart) -> RunBegun:
        """:meth:`start_run`, and what the job's duplicates left it.

        With ``run.follows_duplicates``: a job whose planned start has not come
        is not marked (:attr:`RunBegun.wait_ms`); a job that is marked gets the
        arguments the latest duplicate stored (:attr:`RunBegun.arguments`).
        """
        return RunBegun(holder=self.start_run(job_id, key, run))

    def pass_on(
        self, job_id: str, key: str, run: str | None, lease_ms: int | None
    ) -> FollowUp | None:
        """Hand the active ``key`` of ``job_id``, whose run ``run`` ended for good, to the run
        its duplicates are owed, if one is; the caller publishes it.

        Atomic: the key moves to the owed job (unstarted, with a fresh lease)
        or stays as it is. Asked again after it moved, it names the same job
        (an answer lost on the way). ``None``: no run is owed (or the key is
        not the job's, or another delivery of the job runs now).
        """
        return None

    def pass_on_or_release(
        self, job_id: str, key: str, run: str | None, lease_ms: int | None, keep_ms: int | None
    ) -> FollowUp | bool:
        """End the hold of ``job_id`` on the active ``key`` (its run ``run`` ended for good)
        in one step: hand the key to the run its duplicates are owed (returned, for the
        caller to publish), or, none being owed, release it as :meth:`release_many` does
        with ``keep_ms``: ``True`` if that changed the key.

        The run's mark stays on the key until this step, so a duplicate decided before it
        owes the run this step hands over, and one decided after it finds the key
        released: no duplicate is told of a run nobody publishes. Stores override this to
        make it one atomic step; asked again after it handed the key over, it names the
        same job (an answer lost on the way).
        """
        follow = self.pass_on(job_id, key, run, lease_ms)
        if follow is not None:
            return follow
        return self.release_many([Release(job_id, key, keep_ms, run)])[0]

    @abstractmethod
    def renew(self, job_id: str, keys: Sequence[str], lease_ms: int) -> int:
        """Push the lease of unfinished active keys held by ``job_id``; return how many."""

    def renew_many(
        self, holds: Sequence[Hold], lease_ms: int | None, *, alive_ms: int | None = None
    ) -> int:
        """Renew many holds at once; return how many were renewed (lease pushed or run vouched).

        With ``alive_ms``, a hold whose ``run`` still marks its key vouches for
        that run again: no other delivery of the job takes the key's mark for
        ``alive_ms`` (see :meth:`start_run`). ``lease_ms`` ``None``: no lease to
        push. Stores override this to do it in one round trip: a worker renews
        every job it holds with one call.
        """
        if lease_ms is None:
            return 0
        return sum(self.renew(hold.job_id, [hold.key], lease_ms) for hold in holds)

    @abstractmethod
    def get(self, key: str) -> HeldKey | None:
        """The key as held now, or ``None``; writes nothing."""

    @abstractmethod
    def scan(self, *, kind: KeyKind | None = None, prefix: str = "") -> Iterator[HeldKey]:
        """Every held key whose storage key starts with ``prefix``; writes nothing."""

    @abstractmethod
    def delete(self, key: str, *, job_id: str | None = None, spare_owed: bool = False) -> bool:
        """Forget ``key`` (an operator's release); with ``job_id``, only if it still holds it.

        With ``spare_owed``, a hold whose job follows its duplicates (``latest``,
        ``debounce``) is kept (``False`` returned) while deleting it would lose
        what they left: a run owed to them, or their arguments, which the job's
        next run (the first, or one after a retry or a requeue) starts with.

        An operator's release never stops the job: with ``job_id``, the store
        notes (:func:`~celery_unique.keys.keyspace.release_note`, for as long as the
        key would have lived) that the job's hold was released, so that its
        deliveries still run once another job holds the key (:meth:`start_run`).
        """

    @abstractmethod
    def ping(self) -> None:
        """Raise :class:`~celery_unique.exceptions.BackendUnavailable` when unreachable."""

    def eviction(self) -> tuple[int, str] | None:
        """``(maxmemory in bytes, eviction policy)`` of a store that may evict keys when
        full; ``None`` where that cannot happen. Raises :class:`EvictionUnknown` where
        the store could evict keys but will not say whether it does."""
        return None

    def register_app(
        self, namespace: str, app: str, tasks: Sequence[str], keep_ms: int
    ) -> dict[str, list[str]] | None:
        """Note that ``app`` (with its unique ``tasks``) uses ``namespace`` on this store;
        every app noted within ``keep_ms``, with its tasks. ``None``: no registry here."""
        return None

    def stats(self) -> StoreStats:
        active = window = 0
        for held in self.scan():
            if held.kind is KeyKind.ACTIVE:
                active += 1
            else:
                window += 1
        return StoreStats(active=active, window=window)

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release connections and files."""
