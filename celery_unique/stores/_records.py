"""The decision rules, written once for every store that runs Python.

Memory, SQLite and the Django store read records inside their own atomic
section and hand them to these functions, which return what to write. The
Redis store runs the same rules in Lua (``lua/decide.lua``); the shared
contract suite holds both to one behaviour.
"""

from __future__ import annotations

import enum
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from celery_unique.keys.keyspace import release_note
from celery_unique.stores.base import (
    GOES_ON,
    HAND_OVER_UNDONE,
    HANDED_OVER_MARK,
    HANDING_OVER,
    PASSED_ON_RUN,
    RUNNING,
    ActiveClaim,
    Claim,
    Decision,
    Effect,
    FollowUp,
    HeldKey,
    Hold,
    KeyKind,
    OnDuplicate,
    Release,
    RunBegun,
    RunStart,
    Scope,
    Store,
    Verdict,
)


@dataclass(frozen=True, slots=True)
class Record:
    """A stored key. ``expires_at`` is absolute milliseconds on the store's clock."""

    job_id: str
    task: str
    kind: KeyKind
    scope: Scope | None = None
    finished: bool = False
    expires_at: int | None = None
    fingerprint: str | None = None
    policy: str | None = None
    #: When a decision wrote it: ms since the epoch (the store's wall clock).
    since: int | None = None
    #: The delivery of the job running now (active keys).
    run: str | None = None
    #: The running job that handed this key over to ``job_id`` (self-rescheduling).
    handed_from: str | None = None
    #: What the job does with its duplicates: only a job that follows them takes any.
    on_duplicate: OnDuplicate = OnDuplicate.REUSE
    #: The job owed a run once this one ends (a caller's job id, nothing else).
    owed: str | None = None
    #: The latest duplicate's arguments, encoded (``latest``/``debounce``).
    arguments: str | None = None
    #: ``debounce``: the planned start, on the store's clock (like ``expires_at``).
    due: int | None = None
    #: ``debounce``: the latest planned start allowed, on the store's clock.
    cap: int | None = None
    #: ``run`` is vouched alive until then (its start, its worker's renewals), on the
    #: store's clock: no other delivery of the job takes the mark before.
    alive_until: int | None = None
    #: The delivery of an ended job that passed the key on to this one, until it
    #: starts: ``j + PASSED_ON_RUN + r`` (see :func:`passing_on`).
    passed_on_by: str | None = None
    #: Active keys: the dispatch that created the hold (:attr:`ActiveClaim.generation`).
    generation: str | None = None

    def run_alive(self, now: int) -> bool:
        """Whether a delivery still vouched alive marks the key (not one that handed it over)."""
        return (
            self.run is not None
            and not self.run.startswith(HANDED_OVER_MARK)
            and self.alive_until is not None
            and self.alive_until > now
        )

    def alive(self, now: int) -> bool:
        return self.expires_at is None or self.expires_at > now

    def held(self, key: str, now: int) -> HeldKey:
        return HeldKey(
            key=key,
            kind=self.kind,
            job_id=self.job_id,
            task=self.task,
            scope=self.scope,
            finished=self.finished,
            expires_in_ms=None if self.expires_at is None else max(0, self.expires_at - now),
            fingerprint=self.fingerprint,
            policy=self.policy,
            since_ms=self.since,
            run=self.run,
            on_duplicate=self.on_duplicate,
            owed=self.owed,
            arguments=self.arguments,
            starts_in_ms=None if self.due is None or self.due <= now else self.due - now,
        )


def carries_owed(record: Record) -> bool:
    """Whether the run ``record`` owes came with the key from the running job that handed
    it over (self-rescheduling): it follows this job's run, which keeps its own arguments.
    """
    return record.owed is not None and record.handed_from is not None


def owes_duplicates(record: Record) -> bool:
    """Whether an operator's release of ``record`` would lose what the job's duplicates left
    it: the run owed to them, or their arguments, which the job's next run (the first,
    or one after a retry or a requeue) starts with."""
    return (
        record.kind is KeyKind.ACTIVE
        and not record.finished
        and record.on_duplicate is not OnDuplicate.REUSE
        and (record.owed is not None or record.arguments is not None)
    )


def _planned_start(due: int | None, now: int, wall: int) -> int | None:
    """A planned start on the store's clock, as ms since the epoch (``wall`` is ``now``)."""
    return None if due is None else wall + due - now


class _Unchanged(enum.Enum):
    TOKEN = "unchanged"


#: Returned by a change that leaves the record as it was.
UNCHANGED = _Unchanged.TOKEN

#: ``None`` in a write set means "delete this key".
Writes = dict[str, "Record | None"]
Lookup = Callable[[str], "Record | None"]
#: A compare-and-set step: the record now and the clock -> the new record.
Change = Callable[["Record | None", int], "Record | _Unchanged | None"]


def claim_keys(claim: Claim) -> list[str]:
    """Every storage key a claim names, active first."""
    return [part.key for part in (claim.active, claim.window) if part is not None]


def _expiry(now: int, ttl_ms: int | None) -> int | None:
    return None if ttl_ms is None else now + ttl_ms


def decide(
    claims: Sequence[Claim],
    lookup: Lookup,
    now: int,
    *,
    all_or_nothing: bool,
    wall: int | None = None,
) -> tuple[list[Decision], Writes]:
    """Apply the decision rules to ``claims`` in order; return decisions and writes.

    ``lookup`` reads the store as it was before the batch; this function
    overlays the batch's own writes so later items see earlier ones. ``now``
    is the store's clock for expiry; ``wall`` (default: ``now``) is the same
    moment in ms since the epoch, recorded as each new key's ``since``.
    """
    since = now if wall is None else wall
    writes: Writes = {}

    def read(key: str) -> Record | None:
        record = writes[key] if key in writes else lookup(key)
        return record if record is not None and record.alive(now) else None

    decisions: list[Decision] = []
    for claim in claims:
        decision, item_writes = _decide_one(claim, read, now, since)
        decisions.append(decision)
        if decision.verdict.failed and all_or_nothing:
            return decisions + _unevaluated(claims[len(decisions) :]), {}
        writes.update(item_writes)
    return decisions, writes


def _unevaluated(claims: Sequence[Claim]) -> list[Decision]:
    # Items after a failure in an all-or-nothing batch: nothing was decided for them.
    return [Decision(Verdict.CREATED, claim.job_id) for claim in claims]


def _decide_one(
    claim: Claim, read: Callable[[str], Record | None], now: int, since: int
) -> tuple[Decision, Writes]:
    active, window = claim.active, claim.window
    held = read(active.key) if active else None
    holder = held.job_id if held else None
    remembered = read(window.key) if window else None

    if window is not None and remembered is not None:
        if remembered.fingerprint != window.fingerprint:
            return Decision(
                Verdict.CONFLICT, remembered.job_id, conflicting_job_ids=(remembered.job_id,)
            ), {}
        if holder is not None and holder != remembered.job_id:
            return Decision(
                Verdict.COMPOSITION_CONFLICT,
                remembered.job_id,
                conflicting_job_ids=(remembered.job_id, holder),
            ), {}
        drift = remembered.policy != window.policy
        return Decision(Verdict.REUSED_WINDOW, remembered.job_id, policy_drift=drift), {}

    writes: Writes = {}
    if window is not None:
        target = claim.job_id
        if holder is not None and holder != claim.job_id and not _hands_off(claim, held):
            target = holder  # Link the new window key to the job holding the active key.
        writes[window.key] = Record(
            job_id=target,
            task=claim.task,
            kind=KeyKind.WINDOW,
            expires_at=now + window.window_ms,
            fingerprint=window.fingerprint,
            policy=window.policy,
            since=since,
        )

    if active is not None and held is not None and not _hands_off(claim, held):
        # Held by another job, or by this very job id sent before: either way the
        # job exists already and publishing again would run it twice.
        followed = _follow_duplicate(claim, active, held, now)
        if followed is None:
            return Decision(Verdict.REUSED_ACTIVE, held.job_id), writes
        effect, record = followed
        writes[active.key] = record
        starts_at = _planned_start(record.due, now, since) if effect is Effect.POSTPONED else None
        return Decision(
            Verdict.REUSED_ACTIVE, held.job_id, effect=effect, starts_at_ms=starts_at
        ), writes

    due = None
    if active is not None:
        cap = owed = arguments = None
        if active.on_duplicate is OnDuplicate.DEBOUNCE and active.debounce_ms is not None:
            due = now + active.debounce_ms
            # Never before the first planned start (a countdown longer than the cap).
            cap = None if active.debounce_max_ms is None else now + active.debounce_max_ms
            cap = None if cap is None else max(cap, due)
        follows = active.on_duplicate is not OnDuplicate.REUSE
        if held is not None and held.owed is not None and follows:
            # The running job hands its key to its successor: the run its duplicates are
            # owed goes with the key, to follow the successor's run.
            owed, arguments = held.owed, held.arguments
        writes[active.key] = Record(
            job_id=claim.job_id,
            task=claim.task,
            kind=KeyKind.ACTIVE,
            scope=active.scope,
            expires_at=_expiry(now, active.lease_ms),
            since=since,
            handed_from=held.job_id if held is not None else None,
            on_duplicate=active.on_duplicate,
            owed=owed,
            arguments=arguments,
            due=due,
            cap=cap,
            generation=active.generation,
        )
    starts_at = _planned_start(due, now, since)
    return Decision(Verdict.CREATED, claim.job_id, starts_at_ms=starts_at), writes


def _follow_duplicate(
    claim: Claim, active: ActiveClaim, held: Record, now: int
) -> tuple[Effect, Record] | None:
    """What a ``latest``/``debounce`` duplicate does to the job holding its key, if anything.

    Only an unfinished ``active``/``exists`` hold of the same task, whose own
    dispatch chose to follow duplicates, follows: a finished job is reused as it
    is, another task's job never gets these arguments, and a job that cannot
    pass its key on must not be owed a run.
    """
    if (
        active.on_duplicate is OnDuplicate.REUSE
        or held.on_duplicate is OnDuplicate.REUSE
        or held.kind is not KeyKind.ACTIVE
        or held.finished
        or held.scope is Scope.QUEUED
        or held.task != claim.task
    ):
        return None
    if held.run is not None or carries_owed(held):
        # It runs (or handed itself to a replacement, or took over a run owed after
        # the job that handed it the key): one run is owed after it, under the id of
        # the first duplicate that asked for it.
        owed = held.owed or claim.job_id
        return Effect.RERUN_REQUESTED, replace(held, owed=owed, arguments=active.arguments)
    if (
        active.on_duplicate is OnDuplicate.DEBOUNCE
        and active.debounce_ms is not None
        and held.on_duplicate is OnDuplicate.DEBOUNCE
    ):
        # Never earlier than a start planned before: the message may not be received
        # sooner (its countdown), and every receipt names a start that holds.
        due = max(now + active.debounce_ms, held.due or 0)
        expires_at = held.expires_at
        if held.cap is not None:
            # Capped: the lease its creation set covers the latest start already, and
            # a stream of duplicates must not keep the key of a lost job alive.
            due = min(due, held.cap)
        elif expires_at is not None and active.lease_ms is not None:
            expires_at = max(expires_at, now + active.lease_ms)
        record = replace(held, arguments=active.arguments, due=due, expires_at=expires_at)
        return Effect.POSTPONED, record
    return Effect.ARGUMENTS_REPLACED, replace(held, arguments=active.arguments)


def _hands_off(claim: Claim, held: Record | None) -> bool:
    return (
        held is not None
        and claim.handoff_from is not None
        and held.job_id == claim.handoff_from
        and not held.finished
    )


def releasing(
    job_id: str, keep_ms: int | None, run: str | None = None, generation: str | None = None
) -> Change:
    """End ``job_id``'s hold: delete (``keep_ms=0``) or keep it finished for ``keep_ms``;
    with :data:`GOES_ON`, only end the run ``run``; with :data:`RUNNING`, only mark it;
    with :data:`HANDING_OVER`, mark it as the run that handed the job over. With
    ``generation``, only the hold that dispatch created ends."""

    def change(record: Record | None, now: int) -> Record | _Unchanged | None:
        if record is None or not record.alive(now) or record.job_id != job_id:
            return UNCHANGED
        if not same_generation(record, generation):
            return UNCHANGED  # A later dispatch of the same job id holds the key now.
        if record.kind is not KeyKind.ACTIVE:
            return UNCHANGED  # Window keys are forgotten only by time.
        handed_by = HANDED_OVER_MARK + run if run else None
        if keep_ms in (HANDING_OVER, HAND_OVER_UNDONE):
            before, after = (run, handed_by) if keep_ms == HANDING_OVER else (handed_by, run)
            if run is None or record.run != before:
                return UNCHANGED
            return replace(record, run=after)
        if keep_ms == RUNNING:
            if record.finished or record.run in (run, handed_by) or record.run_alive(now):
                return UNCHANGED
            return replace(record, run=run, alive_until=None)
        if not _run_may_end(record, run, now):
            # Another delivery of the job runs now, or this one handed the job over
            # to a replacement: the key is theirs.
            return UNCHANGED
        if keep_ms == GOES_ON:
            return UNCHANGED if record.run is None else replace(record, run=None, alive_until=None)
        if keep_ms == 0:
            return None
        if record.finished:
            return UNCHANGED  # A repeated final signal must not push retention further.
        return replace(
            record, finished=True, expires_at=_expiry(now, keep_ms), run=None, alive_until=None
        )

    return change


def same_generation(record: Record, generation: str | None) -> bool:
    """Whether a release naming ``generation`` may end ``record``'s hold (either unknown:
    a key or a header written by an earlier version)."""
    return generation is None or record.generation is None or record.generation == generation


def _run_may_end(record: Record, run: str | None, now: int) -> bool:
    """Whether the end of delivery ``run`` may end ``record``'s hold: no other delivery
    of the job runs, and ``run`` did not hand the job over to a replacement.

    A mark whose worker stopped vouching for it is a run that ended or died. Its own
    release may never come (a worker cut off from its broker can lose track of a run
    its pool went on with), so it does not keep the key from the job's other deliveries.
    """
    if record.run is None or record.run == run:
        return True
    if record.run.startswith(HANDED_OVER_MARK):
        return record.run != HANDED_OVER_MARK + (run or "")
    return record.alive_until is not None and record.alive_until <= now


def starting_run(job_id: str, start: RunStart, outcome: list[RunBegun]) -> Change:
    """Mark the key as held by the run ``start`` of ``job_id`` (see ``Store.begin_run``).

    ``outcome`` receives what the start found.
    """

    def change(record: Record | None, now: int) -> Record | _Unchanged | None:
        outcome[:] = [RunBegun()]
        if record is None or not record.alive(now):
            return Record(
                job_id=job_id,
                task=start.task,
                kind=KeyKind.ACTIVE,
                scope=start.scope,
                expires_at=_expiry(now, start.lease_ms),
                since=now,
                run=start.run,
                alive_until=_expiry(now, start.alive_ms),
                generation=start.generation,
            )
        if record.job_id != job_id:
            if record.handed_from != job_id:
                outcome[:] = [RunBegun(holder=record.job_id)]
            return UNCHANGED
        if start.follows_duplicates and record.due is not None and record.due > now:
            outcome[:] = [RunBegun(wait_ms=record.due - now)]
            return UNCHANGED
        if record.run != start.run and record.run_alive(now):
            # Another delivery of the job runs, and its worker says it is alive: the
            # broker delivered the message again although that run goes on.
            assert record.alive_until is not None
            outcome[:] = [RunBegun(busy_ms=record.alive_until - now)]
            return UNCHANGED
        # A run that follows its duplicates starts with the latest arguments: a run
        # owed by an earlier duplicate is this one. Unless that run came with the key
        # from the job that handed it over: it follows this run, which keeps its own.
        carried = carries_owed(record)
        if start.follows_duplicates and record.arguments is not None and not carried:
            outcome[:] = [RunBegun(arguments=record.arguments)]
        expires_at = record.expires_at
        if record.finished or (
            expires_at is not None
            and start.lease_ms is not None
            and expires_at < now + start.lease_ms
        ):
            expires_at = _expiry(now, start.lease_ms)
        owed = record.owed if carried or not start.follows_duplicates else None
        return replace(
            record,
            finished=False,
            expires_at=expires_at,
            run=start.run,
            alive_until=_expiry(now, start.alive_ms),
            due=None,
            owed=owed,
            passed_on_by=None,
        )

    return change


def passing_on(
    job_id: str,
    run: str | None,
    lease_ms: int | None,
    outcome: list[FollowUp | None],
    *,
    release: Change | None = None,
) -> Change:
    """Hand the key of ``job_id`` to the run it owes (see ``Store.pass_on``); with
    ``release``, make that change instead when no run is owed (``pass_on_or_release``)."""

    def change(record: Record | None, now: int) -> Record | _Unchanged | None:
        outcome[:] = [None]
        if record is None or not record.alive(now) or record.kind is not KeyKind.ACTIVE:
            return UNCHANGED
        passed = job_id + PASSED_ON_RUN + (run or "")
        if record.passed_on_by == passed:
            outcome[:] = [FollowUp(record.job_id, record.arguments or "", record.task)]
            return UNCHANGED
        if record.job_id != job_id or record.finished or not _run_may_end(record, run, now):
            return UNCHANGED
        owed = record.owed
        if owed is None:
            return UNCHANGED if release is None else release(record, now)
        outcome[:] = [FollowUp(owed, record.arguments or "", record.task)]
        return replace(
            record,
            job_id=owed,
            owed=None,
            passed_on_by=passed,
            run=None,
            alive_until=None,
            handed_from=None,
            due=None,
            since=now,
            expires_at=_expiry(now, lease_ms),
        )

    return change


def rolling_back(claim: Claim, key: str) -> Change:
    """Undo ``claim``'s write of ``key``: hand it back (take-over) or delete it.

    A claim with a generation undoes only the active key its own decision wrote: the
    same job id may hold that key by another way since (a later dispatch of a caller's
    id; the run a running job owed its duplicates, named after the duplicate whose
    decision is undone)."""
    active = claim.active
    own_active = active is not None and key == active.key
    generation = active.generation if active is not None else None

    def change(record: Record | None, now: int) -> Record | _Unchanged | None:
        if record is None or not record.alive(now) or record.job_id != claim.job_id:
            return UNCHANGED
        if own_active and generation is not None and record.generation != generation:
            return UNCHANGED
        if claim.handoff_from is not None and own_active:
            return replace(record, job_id=claim.handoff_from, handed_from=None)
        return None

    return change


def renewing(hold: Hold, lease_ms: int | None, alive_ms: int | None = None) -> Change:
    """Push the lease of an unfinished active key ``hold`` names to at least ``lease_ms``;
    with ``alive_ms``, vouch for its run again if that still marks the key."""

    def change(record: Record | None, now: int) -> Record | _Unchanged | None:
        if (
            record is None
            or not record.alive(now)
            or record.job_id != hold.job_id
            or record.kind is not KeyKind.ACTIVE
            or record.finished
        ):
            return UNCHANGED
        renewed = record
        if alive_ms is not None and hold.run is not None and record.run == hold.run:
            renewed = replace(renewed, alive_until=now + alive_ms)
        expires_at = record.expires_at
        if lease_ms is not None and expires_at is not None and expires_at < now + lease_ms:
            renewed = replace(renewed, expires_at=now + lease_ms)
        return UNCHANGED if renewed is record else renewed

    return change


def forgetting(
    job_id: str | None, forgotten: list[Record] | None = None, *, spare_owed: bool = False
) -> Change:
    """Delete the key (an operator's release); with ``job_id``, only while it holds it;
    with ``spare_owed``, not while :func:`owes_duplicates`.

    ``forgotten`` receives the record deleted, for :func:`noting`.
    """

    def change(record: Record | None, now: int) -> Record | _Unchanged | None:
        if record is None or not record.alive(now) or job_id not in (None, record.job_id):
            return UNCHANGED
        if spare_owed and owes_duplicates(record):
            return UNCHANGED
        if forgotten is not None:
            forgotten[:] = [record]
        return None

    return change


def noting(forgotten: list[Record]) -> Change:
    """Write the release note of the unfinished active hold :func:`forgetting` deleted, if
    any: it lives as long as the hold would have, and names the dispatch released."""

    def change(record: Record | None, now: int) -> Record | _Unchanged | None:
        if not forgotten or forgotten[0].kind is not KeyKind.ACTIVE or forgotten[0].finished:
            return UNCHANGED
        held = forgotten[0]
        return Record(
            job_id=held.job_id,
            task=held.task,
            kind=KeyKind.ACTIVE,
            expires_at=held.expires_at,
            since=now,
            generation=held.generation,
        )

    return change


def reading_note(generation: str | None, released: list[bool]) -> Change:
    """Read a release note (writing nothing): ``released`` gets whether it releases the
    dispatch ``generation`` of its job."""

    def change(record: Record | None, now: int) -> Record | _Unchanged | None:
        released[:] = [
            record is not None and record.alive(now) and same_generation(record, generation)
        ]
        return UNCHANGED

    return change


class RecordStore(Store):
    """A store that runs the rules above in Python: it only has to apply changes atomically.

    Subclasses implement :meth:`_change` (read the named records, apply each
    change, write the results, all in one atomic step) plus ``decide``,
    ``get``, ``scan`` and ``ping``; releasing, rolling back, renewing and
    deleting are the same compare-and-set changes everywhere.
    """

    @abstractmethod
    def _change(self, changes: Sequence[tuple[str, Change]]) -> list[bool]:
        """Apply ``changes`` atomically, in order; for each, whether it changed its record."""

    def release(self, job_id: str, key: str, *, keep_ms: int | None = 0) -> bool:
        return self._change([(key, releasing(job_id, keep_ms))])[0]

    def release_many(self, releases: Sequence[Release]) -> list[bool]:
        return self._change(
            [(r.key, releasing(r.job_id, r.keep_ms, r.run, r.generation)) for r in releases]
        )

    def start_run(self, job_id: str, key: str, run: RunStart) -> str | None:
        return self.begin_run(job_id, key, run).holder

    def begin_run(self, job_id: str, key: str, run: RunStart) -> RunBegun:
        outcome: list[RunBegun] = [RunBegun()]
        self._change([(key, starting_run(job_id, run, outcome))])
        begun = outcome[0]
        if begun.holder is not None and self._released(key, job_id, run.generation):
            # An operator released the job's hold before another job took the key: it
            # still runs, beside that job, unmarked. (Read apart, and only here: the
            # note was written before the holder could take the key, and a start that
            # finds its job's key held by another writes nothing.)
            return RunBegun()
        return begun

    def _released(self, key: str, job_id: str, generation: str | None) -> bool:
        released = [False]
        self._change([(release_note(key, job_id), reading_note(generation, released))])
        return released[0]

    def pass_on(
        self, job_id: str, key: str, run: str | None, lease_ms: int | None
    ) -> FollowUp | None:
        outcome: list[FollowUp | None] = [None]
        self._change([(key, passing_on(job_id, run, lease_ms, outcome))])
        return outcome[0]

    def pass_on_or_release(
        self, job_id: str, key: str, run: str | None, lease_ms: int | None, keep_ms: int | None
    ) -> FollowUp | bool:
        outcome: list[FollowUp | None] = [None]
        ending = releasing(job_id, keep_ms, run)
        changed = self._change([(key, passing_on(job_id, run, lease_ms, outcome, release=ending))])
        return outcome[0] or changed[0]

    def rollback(self, claim: Claim) -> None:
        self.rollback_many([claim])

    def rollback_many(self, claims: Sequence[Claim]) -> None:
        self._change(
            [(key, rolling_back(claim, key)) for claim in claims for key in claim_keys(claim)]
        )

    def renew(self, job_id: str, keys: Sequence[str], lease_ms: int) -> int:
        return self.renew_many([Hold(job_id, key) for key in keys], lease_ms)

    def renew_many(
        self, holds: Sequence[Hold], lease_ms: int | None, *, alive_ms: int | None = None
    ) -> int:
        return sum(self._change([(hold.key, renewing(hold, lease_ms, alive_ms)) for hold in holds]))

    def delete(self, key: str, *, job_id: str | None = None, spare_owed: bool = False) -> bool:
        if job_id is None:
            return self._change([(key, forgetting(None, spare_owed=spare_owed))])[0]
        forgotten: list[Record] = []
        changes = [
            (key, forgetting(job_id, forgotten, spare_owed=spare_owed)),
            (release_note(key, job_id), noting(forgotten)),
        ]
        return self._change(changes)[0]


def apply_changes(
    changes: Sequence[tuple[str, Change]], lookup: Lookup, now: int
) -> tuple[list[bool], Writes]:
    """Run compare-and-set ``changes`` in order over records read by ``lookup``.

    A later change of the same key sees what an earlier one made of it.
    Returns whether each change changed its record, and the writes to make.
    """
    writes: Writes = {}
    changed: list[bool] = []
    for key, change in changes:
        record = writes[key] if key in writes else lookup(key)
        result = change(record, now)
        changed.append(result is not UNCHANGED)
        if result is not UNCHANGED:
            writes[key] = result
    return changed, writes
