"""Check a recorded history of dispatches, runs and releases against the library's invariants.

A *history* is every event the actors of a randomized run appended to their
files (one JSON object per line, times from ``time.monotonic_ns()``, which is
one clock for every process of a Linux machine):

``dispatch`` (a producer)
    ``proc``, ``t0``/``t1`` (invoked, returned), ``items``: one per job asked
    for (a single dispatch has one, a ``dispatch_many`` batch several), each
    with ``jid`` (the id the dispatch asked for), ``task``, ``key`` and
    ``scope`` (an active key, or ``None``), ``wkey``/``req``/``window_ms`` (a
    window key, which request, how long), ``out`` (``created``, ``reused``,
    ``conflict``, ``error``), ``job`` (the job it resolved to), ``match``
    (``active``/``window``), ``code`` and ``maybe_applied`` (errors).
``start`` / ``end`` (a task body)
    ``job``, ``run`` (1, 2, ... per job id), ``key``, ``pid``, ``t``; an end
    has ``outcome``: ``ok``, ``fail``, ``ignore``, ``reject``, ``soft_limit``
    (final), ``retry``, ``requeue``, ``replace`` (the job goes on). A run cut
    short (a killed pool child, a hard time limit) has no end.
``released`` (a worker's main process)
    ``job``, ``key``, ``t``: a release of the job's key reached the store and
    changed it.
``dropped`` (a worker's main process): ``job``, ``t``: discarded unrun (revoked, expired).
``unrun`` (a pool child): ``job``, ``state``, ``t``: a run ended before its body began
    (``FAILURE``: it failed there, for good; ``IGNORED``: a stale copy, not run).
``timed_out`` (a worker's main process): ``job``, ``t``: a run's hard time limit fired
    and its message was acknowledged (a child killed just before is not retried).
``settled`` (any process): ``proc``, ``t``: the process owed the store nothing any more.
``followed`` (a worker's main process): ``job``, ``of``, ``t``: it published the run that
    ``latest``/``debounce`` duplicates of job ``of`` owed it, as job ``job``.
``operator_release`` (a producer, as an operator): ``job``, ``key``, ``t0``/``t1``,
    ``released`` (the key was the job's and is freed: the job goes on, beside the next;
    ``None`` when the store did not answer: it may have been freed), ``spared`` (kept:
    the job owes its duplicates a run or their arguments).
``kill`` (the orchestrator): ``pids``, ``node``, ``t``, ``whole`` (the node) or a child.
``fault`` (the orchestrator): ``kind``, ``t0``, ``t1``: the store or broker was impaired.
``keys`` (the orchestrator, after quiescence): ``t``, ``held``: every key left in the store.
``transport_lost`` (the orchestrator, after quiescence): ``job``: the Redis broker's log
    shows the job's message popped and never recorded as unacknowledged.
``left_broker`` (the orchestrator, after quiescence): ``job``: the Redis broker's log
    shows the job's last delivery deleted from the unacknowledged ones, with no push
    after it (acknowledged; or, after ``Reject(requeue=True)``, a requeue kombu dropped).

:func:`check` verifies:

I1 at most one run per active key at a time
    Runs of two jobs under one key never overlap when the later-created job
    was created while the earlier one held the key in scope ``active`` or
    ``exists`` (a ``queued`` key is free once its job starts: overlap there
    is by design; so is overlap after an operator released the earlier job's
    key, which frees the key and never stops or drops its job).
I2 no phantom holder
    A dispatch handed an existing job (``reused``) names a job that was
    created, and that could still run when the dispatch began, or whose end
    was too recent for its release to have landed (the release latency is
    bounded, see :data:`RELEASE_WITHIN_NS`), or whose key is kept on purpose
    (``exists`` retention). Or it names the job of a dispatch whose answer was
    lost, before that dispatch's process had undone it (a job delivered
    though its answer was lost was created: store and broker on one server
    write the key and the message in one script, never undone). Or a release
    was lost with a killed worker, within the lease.
I3 every created job ends
    It ran to a final outcome, or was dropped unrun.
I4 nothing left behind
    After quiescence (and a lease after the last lost worker), no unfinished
    active key is held: every release, rollback and undo has landed. A key
    whose job's run died with its whole node is the lease's to free.
I5 window keys
    For a window's whole length, the same request gets the same job, and a
    different request a conflict naming that job.
I6 exactly one owed run
    A job ends with at most one run published for its duplicates, and with
    one when a duplicate was told a run was owed (unless its worker died).
I7 latest arguments
    A run of a job that follows its duplicates runs with the arguments of one
    of its key's dispatches, never older than one that had returned, with
    newer arguments for that job, before the run asked the store.

Dispatch items of jobs that follow their duplicates carry ``policy``
(``latest``/``debounce``) and ``nonce`` (the version of the arguments); their
outcomes ``effect`` (``replaced``, ``rerun``); a run's ``start`` its ``nonce``
and ``asked`` (when it went to the store for them).
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Outcomes of a run after which the job never runs again.
FINAL = frozenset({"ok", "fail", "ignore", "reject", "soft_limit", "hard_limit"})
#: Outcomes of a run after which the job goes on under its id.
GOES_ON = frozenset({"retry", "requeue", "replace"})
#: How long after a job's end its release may take to land in the store, when
#: the store is answering: the worker's main process settles the message, then
#: its background thread sends the release.
RELEASE_WITHIN_NS = 2_000_000_000
#: How long a run is vouched for after its last sign of life (the chaos apps' lease
#: of a minute: a round every 2.5 s, each vouching 10 s ahead), and how often the
#: release of a copy dropped unrun that the store refused then is sent again.
VOUCHED_NS = 10_000_000_000
RELEASE_AGAIN_NS = 2_700_000_000
#: How long a release waits for the broker to confirm its job's acknowledgement
#: (``celery_unique.worker.fates.ACK_WAIT_S``): until then the message may come
#: back, and the job run again.
ACK_WAIT_NS = 10_000_000_000
#: After an impairment of the store ends, how long owed writes may take to land.
AFTER_FAULT_NS = 5_000_000_000
#: How long after a kill is recorded its victim may still record events.
KILL_LANDS_NS = 500_000_000
#: A run the main process timed out is killed by the pool within this long.
TIMED_OUT_KILLED_NS = 2_000_000_000
#: Slack at the edges of a window (the store's clock against the actors').
WINDOW_SLACK_NS = 200_000_000

INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6", "I7")
DESCRIPTIONS = {
    "I1": "at most one run per active key at a time",
    "I2": "no phantom holder",
    "I3": "every created job ends",
    "I4": "nothing left behind",
    "I5": "window keys: same request same job, other request conflict",
    "I6": "exactly one owed run",
    "I7": "latest arguments",
}


@dataclass
class Violation:
    invariant: str
    message: str
    #: The events that show it, in time order.
    slice: list[dict[str, Any]] = field(default_factory=list)

    def render(self, origin: int) -> str:
        lines = [f"{self.invariant}: {self.message}"]
        for event in self.slice:
            lines.append("    " + _brief(event, origin))
        return "\n".join(lines)


@dataclass
class Run:
    job: str
    number: int
    key: str | None
    pid: int
    start: int
    end: int | None = None
    outcome: str | None = None
    #: When the run cannot have lasted longer (its child was killed), if it has no end.
    cut: int | None = None
    #: Its hard time limit, if it has one (a run cut by it has no end either).
    limit_s: float | None = None
    #: Its pool child was killed: the message is requeued (``reject_on_worker_lost``)
    #: and the job goes on, unless the main process timed the run out first.
    killed: bool = False
    #: The version of the arguments it ran with, and when it asked the store for them.
    nonce: str | None = None
    asked: int | None = None

    @property
    def until(self) -> int | None:
        return self.end if self.end is not None else self.cut


@dataclass
class Job:
    """A job some dispatch created."""

    id: str
    key: str | None
    scope: str | None
    created: int
    dispatch: dict[str, Any]
    item: dict[str, Any]
    runs: list[Run] = field(default_factory=list)
    dropped: int | None = None
    released: list[int] = field(default_factory=list)
    #: When a worker received one of its messages.
    received: list[int] = field(default_factory=list)
    #: When a worker's main process timed one of its runs out (hard time limit).
    timed_out: list[int] = field(default_factory=list)
    #: When a run of it failed before its body began.
    failed_unrun: list[int] = field(default_factory=list)
    #: The job whose duplicates owed this one (published by a worker), if any.
    follow_of: str | None = None
    #: Its dispatch failed to publish (and rolled its keys back), yet the message landed.
    published_uncertainly: bool = False

    def unheld_for(self, lease_ns: int, before: int) -> bool:
        """Whether, before ``before``, no worker held the job for long enough that its
        key's lease may have run out (renewed every third of it by a holding worker)."""
        touches = sorted(
            [self.created, *self.received, *(r.start for r in self.runs)]
            + [r.until for r in self.runs if r.until is not None]
        )
        touches = [t for t in touches if t <= before] + [before]
        limit = lease_ns * 2 // 3
        return any(b - a >= limit for a, b in itertools.pairwise(touches))

    def freed_before(self, later: Job) -> bool:
        """Whether the job had ended for good and freed its key before ``later`` was
        decided: its end was long enough before for its release to land, or the release
        landed before the dispatch that created ``later`` was invoked."""
        ended = self.first_end()
        if ended is None:
            return False
        if ended + RELEASE_WITHIN_NS < later.created:
            return True
        landed = self.released_after(ended)
        return landed is not None and landed < later.dispatch.get("t0", later.created)

    def released_after(self, end: int) -> int | None:
        """When the release of an end at ``end`` landed (an earlier run's may have come
        before), if it did."""
        return min((t for t in self.released if t >= end), default=None)

    def first_end(self) -> int | None:
        """When a run of the job first ended for good (a later run is a copy of its message)."""
        ends = [run.end for run in self.runs if run.outcome in FINAL and run.end is not None]
        return min(ends, default=None)

    def final_end(self) -> int | None:
        """When the job could no longer run; ``None`` if it never got there."""
        ends: list[int] = []
        # A run that ended for good is the job's end, even if a copy of one of its
        # messages (a broker's redelivery) started after it and went on, retrying:
        # the job ran to a final state.
        ends += [run.end for run in self.runs if run.outcome in FINAL and run.end is not None]
        if self.runs:
            last = max(self.runs, key=lambda run: (run.start, run.number))
            if last.outcome is None and last.end is None and last.cut is not None:
                timed_out = [t for t in self.timed_out if t >= last.start]
                if timed_out:
                    ends.append(max(last.cut, min(timed_out)))  # acknowledged at its time limit
                elif not last.killed:
                    ends.append(last.cut)  # cut short for good: a hard time limit
        if self.dropped is not None:
            ends.append(self.dropped)
        last_start = max((run.start for run in self.runs), default=0)
        ends += [t for t in self.failed_unrun if t > last_start]
        # A later delivery timed out before its body began (acknowledged then).
        latest = max((run.end or run.start for run in self.runs), default=0)
        ends += [t for t in self.timed_out if t > latest]
        return max(ends) if ends else None


@dataclass
class History:
    events: list[dict[str, Any]]

    @classmethod
    def load(cls, directory: Path) -> History:
        events: list[dict[str, Any]] = []
        for path in sorted(directory.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                # A process killed in the middle of a write leaves a partial last line.
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return cls(events)

    def of(self, kind: str) -> Iterator[dict[str, Any]]:
        return (event for event in self.events if event["e"] == kind)

    @property
    def origin(self) -> int:
        times = [_time(event) for event in self.events]
        return min(times) if times else 0


def _time(event: dict[str, Any]) -> int:
    return int(event.get("t0", event.get("t", 0)))


@dataclass
class Report:
    """What a checked history holds, and what is wrong with it."""

    violations: list[Violation]
    counts: dict[str, int]

    def by_invariant(self) -> dict[str, int]:
        found = dict.fromkeys(INVARIANTS, 0)
        for violation in self.violations:
            found[violation.invariant] += 1
        return found


class _Faults:
    """When the store or the broker was impaired (faults of their own, or of their servers).

    A release waits for the store, and, for an ``acks_late`` job, for the
    broker to take the acknowledgement first: either one impaired delays it.
    """

    def __init__(self, history: History) -> None:
        spans = sorted(
            (int(event["t0"]), int(event["t1"]), event["target"] == "broker")
            for event in history.of("fault")
            if event.get("target") in ("store", "broker")
        )
        self.spans = spans

    def settled_by(self, start: int, end: int) -> int:
        """The latest moment owed writes due in ``[start, end]`` may land.

        An acknowledgement asked for while the broker was impaired may never be
        confirmed: the release waits :data:`ACK_WAIT_NS` for it, however soon the
        broker is back.
        """
        latest = end
        for t0, t1, broker in self.spans:
            if t0 <= latest and t1 >= start:
                latest = max(latest, t1 + AFTER_FAULT_NS)
                if broker:
                    latest = max(latest, start + ACK_WAIT_NS + RELEASE_WITHIN_NS)
        return latest


def _told_a_run_is_owed(history: History) -> dict[str, dict[str, Any]]:
    """The items of the duplicates told a run is owed, by the id each asked for (the
    owed run's id, when it is the first such duplicate of its job)."""
    return {
        item["jid"]: item
        for dispatch in history.of("dispatch")
        for item in dispatch["items"]
        if item.get("effect") == "rerun"
    }


def _one_script(history: History) -> bool:
    """Whether store and broker were one Redis server (one script decides and enqueues)."""
    return any(event.get("broker") == "colocated" for event in history.of("config"))


def _owed_with_lost_answers(history: History) -> dict[str, str]:
    """Owed runs named after a duplicate whose dispatch lost its answer, by id, each with
    the job that held its key when that dispatch was decided (its predecessor).

    A ``latest``/``debounce`` duplicate's decision can be applied although its answer
    was lost: told nothing, it was made the run its key's holder owes, and that run
    carries its id. Where the store is asked before the broker, a dispatch publishes
    nothing without its answer, so a delivery of that id is such a run, never a job
    the dispatch created. (With store and broker one script, the script may have
    enqueued the job itself: :func:`_created_with_lost_answers`.)
    """
    if _one_script(history):
        return {}
    delivered = {e["job"] for kind in ("received", "start") for e in history.of(kind)}
    handed: dict[str, list[tuple[int, str]]] = defaultdict(list)
    lost: list[tuple[int, dict[str, Any]]] = []
    for dispatch in history.of("dispatch"):
        for item in dispatch["items"]:
            if item["out"] in ("created", "reused") and item.get("job"):
                handed[item["key"]].append((dispatch["t1"], item["job"]))
            elif (
                item["out"] == "error"
                and item.get("maybe_applied")
                and item.get("policy") in ("latest", "debounce")
                and item["jid"] in delivered
            ):
                lost.append((dispatch["t1"], item))
    for pairs in handed.values():
        pairs.sort()
    owed: dict[str, str] = {}
    for t1, item in lost:
        pairs = handed[item["key"]]
        # The last job handed out on that key by the time the dispatch returned.
        at = bisect.bisect_right(pairs, t1, key=lambda pair: pair[0])
        while at > 0 and pairs[at - 1][1] == item["jid"]:
            at -= 1
        if at > 0:
            owed[item["jid"]] = pairs[at - 1][1]
    return owed


def _with_unrecorded_hand_overs(history: History) -> History:
    """``history`` with a ``followed`` event for each owed run that a worker received
    though no worker recorded publishing it.

    A publish can raise after its message went out (the broker connection broke as
    kombu finished it): the worker then records nothing, and tries the hand-over
    again, which finds the key already the owed run's. An owed run takes the id of
    the first duplicate told it is owed, and nothing else publishes that id, so its
    delivery is the proof it was published (at the latest when first received).
    """
    recorded = {event["job"] for event in history.of("followed")}
    owed_by = {jid: item["job"] for jid, item in _told_a_run_is_owed(history).items()}
    for jid, predecessor in _owed_with_lost_answers(history).items():
        owed_by.setdefault(jid, predecessor)
    seen: dict[str, int] = {}
    for event in itertools.chain(history.of("received"), history.of("start")):
        job = event["job"]
        if job in owed_by and job not in recorded:
            seen[job] = min(seen.get(job, event["t"]), event["t"])
    if not seen:
        return history
    unrecorded = [
        {"e": "followed", "job": job, "of": owed_by[job], "t": t, "unrecorded": True}
        for job, t in seen.items()
    ]
    return History(history.events + unrecorded)


def _created_with_lost_answers(
    history: History, failed: dict[str, list[dict[str, Any]]]
) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    """Items of dispatches whose answer was lost, whose job was delivered all the same,
    with when the job existed at the latest.

    With store and broker on one server, one script reserves the keys and
    enqueues the messages: when its answer is lost the job may exist, with its
    key and its message, and is never undone. A delivery proves the script
    ran (a store asked first publishes nothing before its answer). It ran
    before its dispatch returned, and before anything named or delivered the job.
    """
    seen: dict[str, int] = {}
    # A delivery of an owed run (its publish recorded, or inferred by
    # _with_unrecorded_hand_overs) is that run's, not a job its dispatch created.
    owed = {event["job"] for event in history.of("followed")}
    for event in itertools.chain(history.of("received"), history.of("start")):
        if event["job"] not in owed:
            seen[event["job"]] = min(seen.get(event["job"], event["t"]), event["t"])
    for dispatch in history.of("dispatch"):
        for item in dispatch["items"]:
            if item["out"] == "reused" and item["job"] in seen:
                seen[item["job"]] = min(seen[item["job"]], dispatch["t1"])
    return [
        (min(dispatch["t1"], seen[item["jid"]]), dispatch, item)
        for dispatch in history.of("dispatch")
        for item in dispatch["items"]
        if item["out"] == "error"
        and item.get("code") == "backend_unavailable"
        and item.get("maybe_applied")
        and item["jid"] in seen
        and item["jid"] in failed
    ]


def _created_by_evidence(history: History, jobs: dict[str, Job]) -> None:
    """A job exists no later than the first sign of it: a dispatch it returned to late
    (its publish waited on a restarting broker) was decided before another process
    was handed it, an operator released its key, or a worker got its message."""
    seen: dict[str, int] = {}

    def saw(job_id: object, t: int, *, by_its_worker: bool = False) -> None:
        if not isinstance(job_id, str) or job_id not in jobs or t >= seen.get(job_id, t + 1):
            return
        # A failed publish that landed is a job only once a worker got it (what a store
        # said of it before is its failed dispatch's to explain).
        if by_its_worker or not jobs[job_id].published_uncertainly:
            seen[job_id] = t

    for dispatch in history.of("dispatch"):
        for item in dispatch["items"]:
            if item["out"] == "reused":
                saw(item.get("job"), dispatch["t1"])
    for event in history.of("operator_release"):
        saw(event["job"], event["t1"])
    for kind in ("received", "start", "released"):
        for event in history.of(kind):
            saw(event["job"], event["t"], by_its_worker=True)
    for job_id, t in seen.items():
        jobs[job_id].created = min(jobs[job_id].created, t)


def _add_uncertain_publishes_that_ran(
    history: History, jobs: dict[str, Job], failed: dict[str, list[dict[str, Any]]]
) -> None:
    """A publish cut by a broker restart may land although kombu raised: the dispatch
    reported the failure and rolled its keys back, and a worker later got the message.
    Its run takes the key (a worker marks the run of a job whose key is free) and holds
    it as a created job does, from no later than the delivery that ran: a job from then
    on, under every rule (it may be handed to duplicates, must end, must free its key).
    Before then, a reuse of it is a phantom unless its rollback had yet to land."""
    delivered: dict[str, int] = {}
    ran = {event["job"] for event in history.of("start")}
    for kind in ("received", "start"):
        for event in history.of(kind):
            job_id = event["job"]
            if job_id in failed and job_id not in jobs and job_id in ran:
                delivered[job_id] = min(delivered.get(job_id, event["t"]), event["t"])
    for job_id, at in delivered.items():
        item = failed[job_id][-1]
        # Decided, as far as the key goes, when its run took it.
        dispatch = {"proc": item["proc"], "t0": at, "t1": at, "items": [item]}
        jobs[job_id] = Job(
            job_id,
            item.get("key"),
            item.get("scope"),
            at,
            dispatch,
            item,
            published_uncertainly=True,
        )


def build_jobs(history: History) -> tuple[dict[str, Job], dict[str, list[dict[str, Any]]]]:
    """Created jobs by id, and the items of failed dispatches by the job id they asked for."""
    jobs: dict[str, Job] = {}
    failed: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for dispatch in history.of("dispatch"):
        for item in dispatch["items"]:
            if item["out"] == "created":
                jobs[item["job"]] = Job(
                    item["job"], item.get("key"), item.get("scope"), dispatch["t1"], dispatch, item
                )
            elif item["out"] == "error":
                failed[item["jid"]].append({**item, "proc": dispatch["proc"], "t1": dispatch["t1"]})
    for created, dispatch, item in _created_with_lost_answers(history, failed):
        job_id = item["jid"]
        jobs[job_id] = Job(job_id, item.get("key"), item.get("scope"), created, dispatch, item)
    _add_uncertain_publishes_that_ran(history, jobs, failed)
    asked_for = _told_a_run_is_owed(history)

    def held_as(job_id: str, depth: int = 0) -> tuple[str | None, str | None]:
        """The key and scope of the key ``job_id`` holds: its dispatch's, or, for an owed
        run (whose predecessor may be an owed run whose own record was lost), the job's
        at the head of the chain; else what the duplicate that asked for it said."""
        if job_id in jobs:
            return jobs[job_id].key, jobs[job_id].scope
        item = asked_for.get(job_id)
        if item is None:
            return None, None
        if depth < 100 and (item.get("job") in jobs or item.get("job") in asked_for):
            key, scope = held_as(item["job"], depth + 1)
            if scope is not None:
                return key, scope
        return item.get("key"), item.get("scope")

    for event in sorted(history.of("followed"), key=_time):
        ended = jobs.get(event["of"])
        # Its key and scope are its predecessor's (whose own dispatch may have lost
        # its answer): the chain of duplicates that asked for it says them too.
        key, scope = (ended.key, ended.scope) if ended else held_as(event["job"])
        jobs[event["job"]] = Job(
            event["job"],
            key,
            scope,
            event["t"],
            event,
            ended.item if ended else {},
            follow_of=event["of"],
        )
    _created_by_evidence(history, jobs)
    kills = sorted((int(e["t"]), set(e["pids"])) for e in history.of("kill"))
    runs: dict[tuple[str, int], Run] = {}
    for event in history.of("start"):
        run = Run(
            event["job"],
            event["run"],
            event.get("key"),
            event["pid"],
            event["t"],
            limit_s=event.get("limit_s"),
            nonce=event.get("nonce"),
            asked=event.get("asked"),
        )
        runs[(run.job, run.number)] = run
    for event in history.of("end"):
        run = runs.get((event["job"], event["run"]))
        if run is not None:
            run.end, run.outcome = event["t"], event["outcome"]
    timed_out: dict[str, list[int]] = defaultdict(list)
    for event in history.of("timed_out"):
        timed_out[event["job"]].append(int(event["t"]))
    for run in runs.values():
        if run.end is None:
            # A kill is recorded just before its signal lands: a run may still record
            # its start in between.
            run.cut = next(
                (t for t, pids in kills if t >= run.start - KILL_LANDS_NS and run.pid in pids),
                None,
            )
            run.killed = run.cut is not None
            if run.cut is None and run.limit_s is not None:
                # Cut by the pool at its hard time limit (and killed within a second or so).
                run.cut = int(run.start + (run.limit_s + 2) * 1e9)
            limited = [t for t in timed_out.get(run.job, ()) if t >= run.start]
            if run.cut is None and limited:
                # A run that did not mean to run past its limit did (held up by the store,
                # say): the main process timed it out, and the pool killed it then.
                run.cut = min(limited) + TIMED_OUT_KILLED_NS
        job = jobs.get(run.job)
        if job is not None:
            job.runs.append(run)
    for event in history.of("dropped"):
        job = jobs.get(event["job"])
        if job is not None:
            job.dropped = max(job.dropped or 0, event["t"])
    for event in history.of("released"):
        job = jobs.get(event["job"])
        # A queued key's release is the one at its job's start.
        if job is not None and (event.get("reason") != "started" or job.scope == "queued"):
            job.released.append(event["t"])
    for event in history.of("received"):
        job = jobs.get(event["job"])
        if job is not None:
            job.received.append(event["t"])
    for event in history.of("unrun"):
        job = jobs.get(event["job"])
        if job is not None and event["state"] == "FAILURE":
            job.failed_unrun.append(event["t"])
    for event in history.of("timed_out"):
        job = jobs.get(event["job"])
        if job is not None:
            job.timed_out.append(event["t"])
    return jobs, failed


def check(history: History) -> Report:
    """Every violation of I1..I7 in ``history``."""
    history = _with_unrecorded_hand_overs(history)
    jobs, failed = build_jobs(history)
    faults = _Faults(history)
    violations: list[Violation] = []
    lapses: set[str] = set()
    violations += _overlaps(history, jobs, lapses)
    violations += _phantoms(history, jobs, failed, faults)
    lost: set[str] = set()
    violations += _unended(history, jobs, lost)
    violations += _left_behind(history, jobs, faults)
    violations += _windows(history, jobs, failed)
    violations += _owed_runs(history, jobs, failed)
    violations += _latest_arguments(history, jobs)
    dispatches = list(history.of("dispatch"))
    items = [item for d in dispatches for item in d["items"]]
    counts = {
        "dispatches": len(items),
        "created": sum(item["out"] == "created" for item in items),
        "reused": sum(item["out"] == "reused" for item in items),
        "conflicts": sum(item["out"] == "conflict" for item in items),
        "errors": sum(item["out"] == "error" for item in items),
        "runs": sum(1 for _ in history.of("start")),
        "arguments replaced (latest/debounce)": sum(
            item.get("effect") == "replaced" for item in items
        ),
        "runs owed (latest/debounce)": sum(item.get("effect") == "rerun" for item in items),
        "owed runs published": sum(1 for _ in history.of("followed")),
        "operator releases": sum(e["released"] is True for e in history.of("operator_release")),
        "operator releases whose answer was lost": sum(
            e["released"] is None for e in history.of("operator_release")
        ),
        "operator releases kept for duplicates": sum(
            e["spared"] for e in history.of("operator_release")
        ),
        "lease lapses": len(lapses),
        "messages lost by the Redis transport": len(lost),
        "uncertain publishes that ran": sum(job.published_uncertainly for job in jobs.values()),
        "jobs created though their answer was lost": len(
            _created_with_lost_answers(history, failed)
        ),
    }
    return Report(violations, counts)


# -- I1 -------------------------------------------------------------------------------


def _overlaps(history: History, jobs: dict[str, Job], lapses: set[str]) -> list[Violation]:
    found: list[Violation] = []
    lease_ns = _lease_ns(history)
    closing = max((_time(event) for event in history.events), default=0)
    operator = _operator_releases(history)
    by_key: dict[str, list[tuple[int, int, Job]]] = defaultdict(list)
    for job in jobs.values():
        if job.key is None:
            continue
        for run in job.runs:
            # A run of unknown end counts as lasting to the end of the history.
            until = run.until if run.until is not None else closing
            by_key[job.key].append((run.start, until, job))
    for key, runs in by_key.items():
        runs.sort(key=lambda run: run[0])
        for i, (_start, until, job) in enumerate(runs):
            for other_start, other_until, other in runs[i + 1 :]:
                if other_start >= until:
                    break
                if other.id == job.id:
                    continue
                first, later = sorted((job, other), key=lambda j: j.created)
                if any(
                    t <= later.dispatch.get("t1", later.created) for t in operator.get(first.id, ())
                ):
                    continue  # an operator released its key: the next job runs beside it
                if first.freed_before(later):
                    # The earlier job had ended and freed its key when the later one
                    # was created: a copy of it the broker delivered again ran, which
                    # only the later job's hold could have stopped, and only if the
                    # copy checks the key (a queued job's runs do not).
                    if first.scope not in ("active", "exists"):
                        continue
                    holder = later
                else:
                    holder = first
                if holder.scope not in ("active", "exists"):
                    continue  # a queued key is free once its job starts
                if first.unheld_for(lease_ns, later.created):
                    lapses.add(first.id)  # no worker held it for a lease: documented
                    continue
                overlap = min(until, other_until) - other_start
                found.append(
                    Violation(
                        "I1",
                        f"jobs {first.id} and {later.id} ran at once under key {key!r} "
                        f"({first.scope}): {_ms(overlap)} of overlap",
                        _slice(history, {first.id, later.id}),
                    )
                )
    return found


def _operator_releases(history: History) -> dict[str, list[int]]:
    """When an operator's release of each job's key began, for the releases that freed it
    or may have (their answer was lost)."""
    released: dict[str, list[int]] = defaultdict(list)
    for event in history.of("operator_release"):
        if event["released"] is not False:
            released[event["job"]].append(event["t0"])
    return released


# -- I2 -------------------------------------------------------------------------------


def _phantoms(
    history: History,
    jobs: dict[str, Job],
    failed: dict[str, list[dict[str, Any]]],
    faults: _Faults,
) -> list[Violation]:
    found: list[Violation] = []
    settled: dict[str, list[int]] = defaultdict(list)
    for event in history.of("settled"):
        settled[event["proc"]].append(event["t"])
    for times in settled.values():
        times.sort()
    lease_ns = _lease_ns(history)
    node_kills = _node_kills(history)
    for dispatch in history.of("dispatch"):
        for item in dispatch["items"]:
            if item["out"] != "reused":
                continue
            name = item["job"]
            job = jobs.get(name)
            t0 = dispatch["t0"]
            if job is not None and job.published_uncertainly and dispatch["t1"] < job.created:
                job = None  # not a job yet: only its failed dispatch's pending undo explains it
            if job is None:
                if _undone_later(failed.get(name, ()), settled, t0):
                    continue
                if _owed_and_lost(history, name, t0, lease_ns):
                    continue
                found.append(
                    Violation(
                        "I2",
                        f"a dispatch was handed job {name}, which no dispatch created "
                        "(and no lost decision explains)",
                        _slice(history, {name}, around=t0),
                    )
                )
                continue
            if item.get("match") == "window":
                continue  # a window names its job for the whole window, by design (I5)
            end = job.final_end()
            if end is None or t0 <= end:
                continue  # it could still run
            if job.scope == "exists":
                continue  # kept on purpose after the end (its retention)
            landed = job.released_after(end)
            in_time = faults.settled_by(end, end + RELEASE_WITHIN_NS)
            if landed is not None and t0 < landed <= in_time:
                continue  # its release was on its way, and came in time
            if landed is None and t0 < in_time:
                # On its way: it landed later, or landed with its reply lost (no
                # release event then), which I4 and later reuses would show.
                continue
            if (
                landed is None
                and _release_died(end, node_kills, owed_until=in_time)
                and t0 < end + lease_ns
            ):
                continue  # the release died with its worker: the lease frees the key
            if _dropped_behind_a_vouched_run(job, end, t0):
                continue  # freed once nobody vouches for the other run any more
            found.append(
                Violation(
                    "I2",
                    f"a dispatch was handed job {name}, which had ended "
                    f"{_ms(t0 - end)} before (its release "
                    + ("never landed" if landed is None else f"landed {_ms(landed - end)} after")
                    + ")",
                    _slice(history, {name}, around=t0),
                )
            )
    return found


def _dropped_behind_a_vouched_run(job: Job, end: int, t0: int) -> bool:
    """Whether the job ended with a copy of its message dropped unrun (revoked) while
    the mark of an earlier run may still have been vouched for, and ``t0`` came before
    that copy's release could free the key.

    That run's own release may never come (its worker lost track of it, or died): the
    store refuses the copy's release while the run is vouched for (until
    :data:`VOUCHED_NS` after its last sign of life), and the copy's worker sends it
    again every :data:`RELEASE_AGAIN_NS` until nobody does.
    """
    if job.dropped != end:
        return False
    lives = [run.until for run in job.runs if run.until is not None and run.start < end]
    bound = max(lives, default=None)
    return bound is not None and t0 < bound + VOUCHED_NS + RELEASE_AGAIN_NS + RELEASE_WITHIN_NS


def _undone_later(
    failures: Iterable[dict[str, Any]], settled: dict[str, list[int]], t0: int
) -> bool:
    """Whether a dispatch that failed asked for this job, and its process settled after ``t0``.

    A process settles when it owes the store nothing: the undo of that lost
    decision has landed by then.
    """
    for failure in failures:
        times = settled.get(failure["proc"], [])
        after = bisect.bisect_left(times, failure["t1"])
        if after < len(times) and t0 < times[after]:
            return True
    return False


def _release_died(
    end: int, node_kills: list[int], crash_s: float = 1, owed_until: int | None = None
) -> bool:
    """Whether a worker died while the release of a job that ended at ``end`` was owed:
    until ``owed_until`` (by default :data:`RELEASE_WITHIN_NS` after the end; longer
    when the store or the broker was impaired, see :meth:`_Faults.settled_by`).

    (A crash is found a moment after it happened, so the window is generous:
    ``crash_s`` more.)
    """
    until = end + RELEASE_WITHIN_NS if owed_until is None else owed_until
    return any(end - 1e9 <= kill <= until + crash_s * 1e9 for kill in node_kills)


def _run_died_with_its_node(history: History, job: Job, at: int, lease_ns: int) -> bool:
    """Whether, a lease or less before ``at``, a run of ``job`` died with its whole node.

    The run's mark stays on the key until a copy of the message delivered again
    ends once nobody vouches for the dead run any more (it runs, or is dropped
    unrun and its release frees the key), or until the lease: a copy may not come
    before the history ends.
    """
    for event in history.of("kill"):
        if event.get("whole") and int(event["t"]) + lease_ns > at:
            pids = set(event["pids"])
            if any(run.pid in pids and run.start <= int(event["t"]) for run in job.runs):
                return True
    return False


def _node_kills(history: History) -> list[int]:
    return sorted(int(e["t"]) for e in history.of("kill") if e.get("whole"))


def _lease_ns(history: History) -> int:
    for event in history.of("config"):
        return int(float(event["lease_s"]) * 1e9)
    return 3600 * 10**9


# -- I3 -------------------------------------------------------------------------------


def _lost_by_broker(history: History, job: Job) -> bool:
    """Whether the broker's own log shows the job's message lost by kombu's Redis transport.

    Popped and never recorded as unacknowledged, or, after its last run asked
    for a requeue, deleted without a push. The orchestrator reads it from the
    broker's append-only file after the queues drained
    (:mod:`tests.history.broker_log`): such messages are excused, and counted
    apart. A RabbitMQ run has none.
    """
    if any(event["job"] == job.id for event in history.of("transport_lost")):
        return True
    # Its last run asked for a requeue (the library passes the request on as it
    # is), and the transport deleted the message without pushing it back.
    last = max(job.runs, key=lambda run: (run.start, run.number), default=None)
    return (
        last is not None
        and last.outcome == "requeue"
        and any(event["job"] == job.id for event in history.of("left_broker"))
    )


def _unended(history: History, jobs: dict[str, Job], lost: set[str]) -> list[Violation]:
    found: list[Violation] = []
    for job in jobs.values():
        if job.final_end() is None and _lost_by_broker(history, job):
            lost.add(job.id)
        elif job.final_end() is None:
            runs = (
                ", ".join(f"run {r.number}: {r.outcome or 'cut'}" for r in job.runs) or "never ran"
            )
            found.append(
                Violation(
                    "I3",
                    f"job {job.id} (key {job.key!r}, window {job.item.get('wkey')!r}) "
                    f"never reached an end ({runs})",
                    _slice(history, {job.id}),
                )
            )
    return found


# -- I4 -------------------------------------------------------------------------------


def _left_behind(history: History, jobs: dict[str, Job], faults: _Faults) -> list[Violation]:
    found: list[Violation] = []
    node_kills, lease_ns = _node_kills(history), _lease_ns(history)
    for snapshot in history.of("keys"):
        for held in snapshot["held"]:
            if held["kind"] != "active" or held["finished"]:
                continue
            job = jobs.get(held["job"])
            end = None if job is None else job.final_end()
            if (
                job is not None
                and end is not None
                and not job.released
                and _release_died(
                    end, node_kills, owed_until=faults.settled_by(end, end + RELEASE_WITHIN_NS)
                )
                and snapshot["t"] < end + lease_ns
            ):
                continue  # its release died with its worker: the lease will free it
            if job is not None and end is None and _lost_by_broker(history, job):
                continue  # its message was lost by the broker: the lease will free it
            if job is not None and _run_died_with_its_node(history, job, snapshot["t"], lease_ns):
                continue  # its run's mark stays: the lease will free it
            if job is None and _owed_and_lost(history, held["job"], snapshot["t"], lease_ns):
                continue  # an owed run its worker died before publishing: the lease frees it
            what = "a job no dispatch created" if job is None else f"job {held['job']}"
            if held.get("run") is not None or held.get("ttl_ms") is not None:
                what += f" (marked by run {held.get('run')}, {held.get('ttl_ms')} ms left)"
            found.append(
                Violation(
                    "I4",
                    f"after quiescence, active key {held['key']!r} is still held by {what}",
                    _slice(history, {held["job"]}),
                )
            )
    return found


def _owed_and_lost(history: History, job_id: str, at: int, lease_ns: int) -> bool:
    """Whether ``job_id`` is a run duplicates were owed whose publishing worker died after
    they asked for it (between taking the key over and publishing it, or before it
    recorded the publish), a lease or less before ``at``."""
    asked = [
        dispatch["t0"]
        for dispatch in history.of("dispatch")
        for item in dispatch["items"]
        if item.get("jid") == job_id and item.get("effect") == "rerun"
    ]
    if not asked:
        return False
    # The worker took the key over for it (dispatches are handed it from then on) and
    # died before it published it, or before it recorded doing so.
    return any(min(asked) <= kill and at < kill + lease_ns for kill in _node_kills(history))


# -- I5 -------------------------------------------------------------------------------


def _windows(
    history: History, jobs: dict[str, Job], failed: dict[str, list[dict[str, Any]]]
) -> list[Violation]:
    """I5, per window key, in the order dispatches returned.

    A window starts when its job's dispatch is decided (somewhere in that
    dispatch's ``[t0, t1]``) and lasts ``window_ms``: a new job may be created
    once it may have ended, and the job is named (reused, or by a conflict)
    only while it may still run. A window whose job was never created (the
    answer was lost, and undone) gives way to the next one.
    """
    found: list[Violation] = []
    per_key: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    for dispatch in history.of("dispatch"):
        for item in dispatch["items"]:
            if item.get("wkey") and item["out"] != "error":
                per_key[item["wkey"]].append((dispatch, item))
    for wkey, seen in per_key.items():
        seen.sort(key=lambda pair: pair[0]["t1"])
        holder: str | None = None
        request: Any = None
        # The window began when its job's creating dispatch was decided: not
        # before that dispatch was invoked, not after any dispatch naming the
        # job returned (one may return before the creating one does).
        earliest = latest = 0
        for dispatch, item in seen:
            job, t0, t1 = item.get("job"), dispatch["t0"], dispatch["t1"]
            window = int(item["window_ms"] * 1e6)
            may_have_ended = t1 >= earliest + window - WINDOW_SLACK_NS
            has_ended = t0 > latest + window + WINDOW_SLACK_NS
            # A failed publish that landed took back its active key as it ran, never
            # its window key: that went with the rollback.
            gives_way = (
                holder is None
                or holder not in jobs
                or jobs[holder].published_uncertainly
                or may_have_ended
            )
            if job == holder:
                if item["out"] == "created":
                    earliest = min(earliest, t0)
                if request is None and item["out"] != "conflict":
                    request = item["req"]  # first seen through a conflict, now known
                if has_ended and item["out"] != "created":
                    found.append(
                        Violation(
                            "I5",
                            f"window key {wkey!r} named job {job} "
                            f"{_ms(t0 - latest - window)} after its window ended",
                            _slice(history, {job}),
                        )
                    )
                elif item["out"] == "reused" and item["req"] != request:
                    found.append(
                        Violation(
                            "I5",
                            f"window key {wkey!r}: request {item['req']!r} was handed job "
                            f"{holder} of request {request!r} instead of a conflict",
                            _slice(history, {holder}),
                        )
                    )
                elif item["out"] == "conflict" and item["req"] == request:
                    found.append(
                        Violation(
                            "I5",
                            f"window key {wkey!r}: the same request {request!r} was refused "
                            f"as a conflict with job {job}",
                            _slice(history, {holder}),
                        )
                    )
                continue
            if gives_way:
                holder, request, earliest, latest = job, item["req"], t0, t1
                if item["out"] == "conflict":
                    request = None  # the holder's request is not this one; unknown yet
                continue
            found.append(
                Violation(
                    "I5",
                    f"window key {wkey!r} {item['out']} job {job} while job {holder} held it",
                    _slice(history, {job, holder}),
                )
            )
    return found


# -- reporting ------------------------------------------------------------------------------


#: Orchestrator events shown in a violation's slice when they fall within its span.
_CONTEXT = frozenset({"fault", "kill", "quiet"})
#: A slice shows its first and last events, at most this many of each.
_SLICE_ENDS = 40


# -- I6 -------------------------------------------------------------------------------


def _owed_runs(
    history: History, jobs: dict[str, Job], failed: dict[str, list[dict[str, Any]]]
) -> list[Violation]:
    """At most one run published per ended job; one when a duplicate was told it is owed."""
    found: list[Violation] = []
    published: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in history.of("followed"):
        published[event["of"]].append(event)
    asked: dict[str, list[str]] = defaultdict(list)
    #: The arguments (by nonce) of the duplicates told a run is owed, per job.
    told: dict[str, set[str]] = defaultdict(set)
    for dispatch in history.of("dispatch"):
        for item in dispatch["items"]:
            if item.get("effect") == "rerun":
                asked[item["job"]].append(item["jid"])
                if item.get("nonce"):
                    told[item["job"]].add(item["nonce"])
    node_kills = _node_kills(history)
    for ended, events in published.items():
        if len(events) > 1:
            found.append(
                Violation(
                    "I6",
                    f"job {ended} ended with {len(events)} runs published for its duplicates",
                    _slice(history, {ended, *(e["job"] for e in events)}),
                )
            )
        for event in events:
            if event["job"] not in asked.get(ended, ()) and event["job"] not in failed:
                found.append(
                    Violation(
                        "I6",
                        f"job {ended}'s owed run was published as {event['job']}, which no "
                        "duplicate of it asked for",
                        _slice(history, {ended, event["job"]}),
                    )
                )
    for ended, jids in asked.items():
        job = jobs.get(ended)
        end = None if job is None else job.final_end()
        if job is None or end is None or published.get(ended):
            continue
        last = max(job.runs, key=lambda run: (run.start, run.number), default=None)
        if last is None or last.end is None or _release_died(end, node_kills, crash_s=5):
            continue  # cut short with its worker: nobody saw the end (the lease frees the key)
        first_asked = min(
            d["t0"]
            for d in history.of("dispatch")
            for item in d["items"]
            if item.get("effect") == "rerun" and item["job"] == ended
        )
        if any(run.asked is not None and run.asked > first_asked for run in job.runs):
            continue  # a later run (a retry, a delivery again) ran with the latest arguments
        if any(run.nonce in told[ended] for run in job.runs):
            # A run was handed a duplicate's arguments as it started: the store ran its
            # start after that duplicate's decision (client clocks cannot tell), and
            # the run it was owed is that run.
            continue
        if job.dropped is not None and job.dropped >= end:
            # Its last message was dropped unrun (revoked, expired) by a worker that may
            # not have seen the previous run end elsewhere: the key, and the run owed
            # with it, are the lease's (documented).
            continue
        found.append(
            Violation(
                "I6",
                f"job {ended} ended ({last.outcome}) and no run was published for the "
                f"{len(jids)} duplicate(s) told a run was owed",
                _slice(history, {ended, *jids}),
            )
        )
    return found


# -- I7 -------------------------------------------------------------------------------


def _latest_arguments(history: History, jobs: dict[str, Job]) -> list[Violation]:
    """Each run of a following job runs with the newest arguments it could have seen."""
    found: list[Violation] = []
    given: dict[str, list[tuple[str, int, int]]] = defaultdict(list)  # job -> (nonce, t0, t1)
    nonces_by_key: dict[str | None, set[str]] = defaultdict(set)
    for dispatch in history.of("dispatch"):
        for item in dispatch["items"]:
            nonce = item.get("nonce")
            if nonce is None:
                continue
            nonces_by_key[item.get("key")].add(nonce)
            if (item["out"] == "created" and item.get("policy")) or item.get("effect"):
                given[item["job"]].append((nonce, dispatch["t0"], dispatch["t1"]))

    def candidates(job: Job) -> list[tuple[str, int, int]]:
        seen, own = set(), []
        current: Job | None = job
        while current is not None and current.id not in seen:
            seen.add(current.id)
            own += given.get(current.id, [])
            current = jobs.get(current.follow_of) if current.follow_of else None
        return own

    passed_on = {event["of"]: int(event["t"]) for event in history.of("followed")}
    for job in jobs.values():
        if not (job.item.get("policy") or job.follow_of):
            continue
        offered = candidates(job)
        ended = [run.end for run in job.runs if run.outcome in FINAL and run.end is not None] + (
            [passed_on[job.id]] if job.id in passed_on else []
        )
        for run in job.runs:
            if run.nonce is None or run.asked is None:
                continue
            if any(t < run.asked for t in ended):
                # A copy of a job that had ended (delivered again by the broker): it
                # took a key nobody held, and its message's own arguments.
                continue
            if run.nonce not in nonces_by_key.get(job.key, set()):
                found.append(
                    Violation(
                        "I7",
                        f"run {run.number} of job {job.id} ran with arguments {run.nonce!r}, "
                        f"which no dispatch of key {job.key!r} gave",
                        _slice(history, {job.id}),
                    )
                )
                continue
            used = [c for c in offered if c[0] == run.nonce]
            if not used:
                continue  # a dispatch whose answer was lost: its order is unknown
            _, _, used_t1 = max(used, key=lambda c: c[2])
            newer = [c for c in offered if c[1] > used_t1 and c[2] < run.asked]
            if newer:
                found.append(
                    Violation(
                        "I7",
                        f"run {run.number} of job {job.id} ran with arguments {run.nonce!r}; "
                        f"{newer[-1][0]!r}, dispatched after them, had returned "
                        f"{_ms(run.asked - newer[-1][2])} before the run asked for its own",
                        _slice(history, {job.id}),
                    )
                )
    return found


def _slice(
    history: History, jobs: set[str | None], around: int | None = None
) -> list[dict[str, Any]]:
    """The events about ``jobs`` (and, with ``around``, the dispatch at that time), with
    the faults and kills around them: what a reader needs to see why it went wrong."""
    picked = []
    for event in history.events:
        if event.get("job") in jobs or (
            event["e"] == "dispatch"
            and (
                any(item.get("job") in jobs or item.get("jid") in jobs for item in event["items"])
                or event.get("t0") == around
            )
        ):
            picked.append(event)
    if picked:
        begin = min(_time(event) for event in picked) - 1_000_000_000
        end = max(int(event.get("t1", _time(event))) for event in picked) + 1_000_000_000
        picked.extend(
            event
            for event in history.events
            if event["e"] in _CONTEXT
            and int(event.get("t1", _time(event))) >= begin
            and _time(event) <= end
        )
    picked.sort(key=_time)
    if len(picked) > 2 * _SLICE_ENDS:
        cut = len(picked) - 2 * _SLICE_ENDS
        picked = [
            *picked[:_SLICE_ENDS],
            {"e": "elided", "t": _time(picked[_SLICE_ENDS]), "events": cut},
            *picked[-_SLICE_ENDS:],
        ]
    return picked


def _ms(ns: int | float) -> str:
    return f"{ns / 1e6:.0f} ms"


def _brief(event: dict[str, Any], origin: int) -> str:
    at = f"{(_time(event) - origin) / 1e9:9.3f}s"
    if event["e"] == "dispatch":
        parts = [
            f"{i['out']}{'(' + i['match'] + ')' if i.get('match') else ''} "
            f"{(i.get('job') or i.get('jid') or '')[:8]} key={i.get('key')} "
            f"w={i.get('wkey')}/{i.get('req')} {i.get('code') or ''}".rstrip()
            for i in event["items"]
        ]
        return f"{at} {event['proc']} dispatch [{'; '.join(parts)}]"
    rest = {k: v for k, v in event.items() if k not in ("e", "t", "t0")}
    if "job" in rest:
        rest["job"] = str(rest["job"])[:8]
    return f"{at} {event['e']} {rest}"
