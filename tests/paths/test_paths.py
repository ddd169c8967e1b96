"""Every Celery delivery path in every scope, on a real worker: a key is held while its job can run.

A pass starts one ``celery worker`` subprocess (``--pool=prefork``, and one
pass with ``--pool=threads``) on one broker (Redis, RabbitMQ), then plays
every cell of the matrix at once, each in a thread of its own with a key of
its own: it dispatches the cell's job, drives it (kills its pool child,
revokes it, lets it expire...), and samples the store every few milliseconds
until the key is released; then it dispatches a probe under the same key.
For each cell it checks:

* the job ran as many times as Celery's semantics say;
* the key was held by the job at every sample until its release, and the
  release came at the point the scope names: the start (``queued``), the end
  of the last run or the moment the message was dropped (``active``), the
  same then kept for the retention (``exists``), or the lease (a message the
  broker dropped without telling anyone);
* for ``active`` and ``exists``, the release came after the job's last run
  ended (or its child was killed): two jobs never run under one key;
* the probe afterwards creates a new job.

A window pass per broker (``--pool=prefork``) plays the paths that send a job
on under its id with a twin task that declares a window key instead: the job
runs as often as Celery says, the key names it at every sample, and the same
request afterwards is that job.

What each pass observed is the table in ``docs/_generated/path-matrix.md``
(included in the concepts page): the test renders its own observations and
compares them with that file; ``UPDATE_PATH_MATRIX=1`` writes them instead.

The tables are Celery 5.7's. A few paths go otherwise on older Celery (the
version matrix plays the paths on Celery 5.3 too): each says how, since which
release and why (:class:`Older`); there the pass expects what that Celery does,
leaves those rows out of the comparison with the docs, and names them at the
end of the run. The docs list them below the tables.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import celery
import pytest

from celery_unique import Disposition, DuplicateMatch
from celery_unique.keys import keyspace
from celery_unique.stores import redis as redis_store
from tests.paths import _app
from tests.paths._pass import LEASE_S, RETENTION_S, Pass

pytestmark = [pytest.mark.slow, pytest.mark.alone]

REPO = Path(__file__).resolve().parents[2]
MATRIX_DOC = REPO / "docs" / "_generated" / "path-matrix.md"

#: How long after its start a run is killed or terminated.
CUT_AFTER_S = 0.3
#: How often each cell samples the store.
SAMPLE_S = 0.025
#: After the key is released, how long a cell keeps watching for more runs.
SETTLE_S = 2.0
#: A release counts as "at" an event when it follows it within this long: below
#: the 10 s a release waits at most for a pool child's exit (a wait that never
#: ends shows), above the few seconds a loaded machine's worker can be late.
PROMPT_S = 5.0
#: How long before its body starts the pool may report a job accepted (a child
#: busy with its preamble on a loaded machine).
ACCEPTED_S = 3.0
SCOPES = ("queued", "active", "exists")
#: The scopes a job that follows its duplicates can hold its key in.
FOLLOWING = ("active", "exists")
#: The Celery the worker runs (the test's own: one virtualenv), as (major, minor).
CELERY = (celery.VERSION.major, celery.VERSION.minor)


@dataclass(frozen=True)
class Older:
    """How a path goes on a Celery older than ``since``, whose change made it go as its
    :class:`Path_` says."""

    since: tuple[int, int]
    #: The row's title on the older Celery.
    title: str
    #: Runs of the job (under its id) the older Celery's semantics give.
    runs: int
    #: The change, and what the older Celery does instead.
    why: str


@dataclass(frozen=True)
class Path_:
    """One delivery path: how to dispatch and drive its job, and what Celery does with it."""

    name: str
    title: str
    #: Runs of the job (under its id) Celery's semantics give.
    runs: int
    #: What the test does to the job: "kill" its pool child, "terminate" it,
    #: "revoke" it while it waits, let it "expire" in a queue no worker reads.
    drive: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    #: Needs the prefork pool (time limits, killing a pool child).
    prefork_only: bool = False
    #: Dispatched to a task the worker does not know.
    unknown: bool = False
    #: The pool cuts the first run short after this long (its hard time limit).
    cut_after_s: float | None = None
    #: The scopes the path's options allow (``latest``/``debounce``: not ``queued``).
    scopes: tuple[str, ...] = ("queued", "active", "exists")
    #: How the path goes on older Celery, if otherwise.
    older: Older | None = None

    @property
    def documented(self) -> bool:
        """Whether the path goes here as the docs' tables show it (as on the newest Celery)."""
        return self.older is None or self.older.since <= CELERY

    def here(self) -> Path_:
        """The path as it goes on the Celery running the test."""
        if self.older is None or self.documented:
            return self
        return replace(self, title=self.older.title, runs=self.older.runs)


PATHS = (
    Path_("success", "succeeds", 1),
    Path_("failure", "fails", 1),
    Path_("fail_after_retry", "fails for good after a retry", 2),
    Path_("retry", "`retry(countdown)`, then succeeds", 2),
    Path_("autoretry", "`autoretry_for`, then succeeds", 2),
    Path_("reject_requeue", "`Reject(requeue=True)`, then succeeds (`acks_late`)", 2),
    Path_("reject_drop", "`Reject(requeue=False)`", 1),
    Path_("ignore", "`Ignore()`", 1),
    Path_("replace_unique", "`replace()` by a `UniqueTask`", 2),
    Path_("replace_plain", "`replace()` by a plain task", 2),
    Path_("replace_chain", "`replace()` by a chain (the job id goes to its last task)", 2),
    Path_(
        "replace_soft_limit",
        "`replace()` by a plain task, soft time limit once the replacement was sent",
        2,
        prefork_only=True,
    ),
    Path_(
        "replace_slow_mark",
        "`replace()` by a plain task, soft time limit while the store marks the hand-over "
        "(the job fails; nothing was sent)",
        1,
        prefork_only=True,
    ),
    Path_(
        "replace_then_raise",
        "`replace()` by a plain task, then an error in the body (a `finally`)",
        2,
    ),
    Path_(
        "replace_internal_error",
        "`replace()` by a plain task, then an error in Celery's code after the body "
        "(where a soft time limit can strike)",
        2,
    ),
    Path_("retry_then_raise", "`retry(countdown)`, then an error in the body (a `finally`)", 2),
    Path_(
        "retry_internal_error",
        "`retry(countdown)`, then an error in Celery's code after the body",
        2,
    ),
    Path_(
        "retry_hard_limit",
        "`retry(countdown)`, hard time limit once the next attempt was sent",
        2,
        prefork_only=True,
        cut_after_s=1,
    ),
    Path_(
        "retry_reported_late",
        "`retry(countdown)`, soft time limit after Celery's code, before the pool child "
        "reported the run",
        2,
        prefork_only=True,
    ),
    Path_(
        "replace_reported_late",
        "`replace()` by a plain task, soft time limit after Celery's code, before the pool "
        "child reported the run",
        2,
        prefork_only=True,
    ),
    Path_(
        "reject_requeue_reported_late",
        "`Reject(requeue=True)`, then succeeds (`acks_late`); soft time limit after Celery's "
        "code, before the pool child reported the run",
        2,
        prefork_only=True,
    ),
    Path_(
        "replace_hard_limit",
        "`replace()` by a plain task, hard time limit once the replacement was sent",
        2,
        prefork_only=True,
        cut_after_s=1,
    ),
    Path_(
        "revoke_waiting", "revoked while waiting for its countdown", 0, "revoke", {"countdown": 2}
    ),
    Path_(
        "revoke_running",
        "`revoke(terminate=True)` while running",
        1,
        "terminate",
        prefork_only=True,
    ),
    Path_(
        "expires_eta",
        "expires while waiting for its countdown",
        0,
        None,
        {"countdown": 1.5, "expires": 0.5},
    ),
    Path_("expires_queued", "expires in a queue no worker reads yet", 0, "expire", {"expires": 1}),
    Path_("soft_limit", "soft time limit", 1, prefork_only=True),
    Path_(
        "slow_mark",
        "soft time limit while the store marks the run, before the body (sent again)",
        1,
        prefork_only=True,
    ),
    Path_("hard_limit", "hard time limit", 1, prefork_only=True, cut_after_s=1),
    Path_(
        "hard_limit_late_ack", "hard time limit, `acks_late`", 1, prefork_only=True, cut_after_s=1
    ),
    Path_(
        "hard_limit_late_requeue",
        "hard time limit, `acks_late`, `acks_on_failure_or_timeout=False` (requeued), "
        "then succeeds",
        2,
        prefork_only=True,
        cut_after_s=1,
        older=Older(
            (5, 5),
            "hard time limit, `acks_late`, `acks_on_failure_or_timeout=False` (dropped)",
            1,
            "Celery 5.5 requeues the message of a run cut short by its hard time limit "
            "when `acks_on_failure_or_timeout` is off (celery/celery#9626); before, the "
            "worker rejects it without requeueing (`Request.on_failure`): the job ends there",
        ),
    ),
    Path_("killed", "pool child killed", 1, "kill", prefork_only=True),
    Path_(
        "killed_requeue",
        "pool child killed, `acks_late` + `reject_on_worker_lost` (requeued), then succeeds",
        2,
        "kill",
        prefork_only=True,
    ),
    Path_(
        "killed_retry",
        "pool child killed, `retry_on_worker_lost` (re-sent by the worker), then succeeds",
        2,
        "kill",
        prefork_only=True,
        older=Older(
            (5, 7),
            "pool child killed, `retry_on_worker_lost` (an option this Celery does not have)",
            1,
            "`retry_on_worker_lost` (`task_retry_on_worker_lost`) is new in Celery 5.7; "
            "before, the task option means nothing to Celery, and the job of a lost pool "
            'child fails (`WorkerLostError`) as the row "pool child killed" does',
        ),
    ),
    Path_("unknown", "unknown to the worker", 0, unknown=True),
    Path_(
        "latest",
        '`unique_on_duplicate="latest"`, succeeds',
        1,
        options={"unique_on_duplicate": "latest"},
        scopes=FOLLOWING,
    ),
    Path_(
        "latest_retry",
        '`unique_on_duplicate="latest"`, `retry(countdown)`, then succeeds',
        2,
        options={"unique_on_duplicate": "latest"},
        scopes=FOLLOWING,
    ),
    Path_(
        "latest_killed",
        '`unique_on_duplicate="latest"`, pool child killed',
        1,
        "kill",
        {"unique_on_duplicate": "latest"},
        prefork_only=True,
        scopes=FOLLOWING,
    ),
    Path_(
        "debounce",
        '`unique_on_duplicate="debounce"` (sent with its debounce as countdown), succeeds',
        1,
        options={"unique_on_duplicate": "debounce", "unique_debounce": 0.5},
        scopes=FOLLOWING,
    ),
)


@dataclass
class Observed:
    """What one cell saw."""

    path: Path_
    scope: str
    job_id: str
    dispatched: int
    #: (time, holder job id or None, finished) every SAMPLE_S until after the release.
    samples: list[tuple[int, str | None, bool]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    ends: list[dict[str, Any]] = field(default_factory=list)
    #: When the test cut the run short (kill, terminate), if it did.
    cut_at: int | None = None
    probe: str | None = None
    probe_start: int | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def released_at(self) -> int | None:
        """The first sample at which the job no longer held the key (or held it finished)."""
        for at, holder, finished in self.samples:
            if holder != self.job_id or finished:
                return at
        return None

    @property
    def last_held_at(self) -> int | None:
        """The last sample at which the job still held the key unfinished, before its release.

        The release came between this sample and :attr:`released_at`; a sampling
        thread the machine starved leaves a gap between the two, and only this
        one proves the key was still held."""
        released = self.released_at
        held = [
            at
            for at, holder, finished in self.samples
            if holder == self.job_id and not finished and (released is None or at < released)
        ]
        return max(held, default=None)

    @property
    def last_event(self) -> int | None:
        """The end of the job's last run (or the moment it was cut short).

        No earlier than the start of its last run: a run seen starting whose end
        the watch did not wait for must still find the key held."""
        events = self._run_events()
        ended = {record["run"] for record in self.ends}
        limit = self.path.cut_after_s
        if limit is not None:
            events += [
                record["start"] + int(limit * 1e9)
                for record in self.starts
                if record["run"] not in ended
            ]
        return max(events, default=None)

    def kind(self) -> str:
        """Where the release came, in words the docs use."""
        released = self.released_at
        if released is None:
            return "never released"
        lapsed = released - self.dispatched >= (LEASE_S - 1) * 1e9
        if lapsed and not self._just_after_a_run(released):
            return "lease"
        if not self.starts:
            return "dropped"
        if self.scope == "queued":
            # The worker's main process hears that the pool took the job a moment
            # before the body records its start.
            first = min(record["start"] for record in self.starts)
            if released < first - ACCEPTED_S * 1e9:
                return "early"
            return "late" if self._held_past(first) else "start"
        last = self.last_event
        if last is None or released < last:
            return "early"
        return "late" if self._held_past(last) else "end"

    def _just_after_a_run(self, moment: int) -> bool:
        """Whether a run started or ended (or was killed) at most :data:`PROMPT_S` before
        ``moment``: a release then is that run's, however long after the dispatch it
        came (Celery 5.3 may deliver a re-sent message many seconds late on a busy
        machine, the key renewed all the while). A lease frees a key nobody runs."""
        return any(0 <= moment - event <= PROMPT_S * 1e9 for event in self._run_events())

    def _run_events(self) -> list[int]:
        """When the job's runs started and ended, and when the test cut one short."""
        events = [record["end"] for record in self.ends]
        events += [record["start"] for record in self.starts]
        if self.cut_at is not None and self.path.drive in ("kill", "terminate"):
            events.append(self.cut_at)
        return events

    def _held_past(self, moment: int) -> bool:
        """Whether the key was seen held, unfinished, :data:`PROMPT_S` or more after ``moment``."""
        held = self.last_held_at
        return held is not None and held - moment >= PROMPT_S * 1e9


LABELS = {
    ("queued", "start"): "freed at the start",
    ("queued", "dropped"): "freed when dropped",
    ("queued", "lease"): "freed by the lease",
    ("active", "end"): "held to the end",
    ("active", "dropped"): "freed when dropped",
    ("active", "lease"): "freed by the lease",
    ("exists", "end"): f"kept {RETENTION_S:g} s after the end",
    ("exists", "dropped"): f"kept {RETENTION_S:g} s after the drop",
    ("exists", "lease"): "freed by the lease",
}


def expected_kind(path: Path_, scope: str, broker: str) -> str:
    """Where the release must come, by Celery's semantics and the scope's."""
    if path.drive == "expire" and broker == "rabbitmq":
        return "lease"  # RabbitMQ drops the expired message itself, and says nothing
    if path.runs == 0:
        return "dropped"
    return "start" if scope == "queued" else "end"


def sample(run: Pass, stored: str, seen: Observed) -> None:
    """One look at the key and the job's runs, in one round trip (store and marks: db 0)."""
    ns = run.spec["namespace"]
    with run.marks.pipeline(transaction=False) as pipe:
        pipe.get(stored)
        pipe.pttl(stored)
        pipe.lrange(f"{ns}:s:{seen.job_id}", 0, -1)
        pipe.lrange(f"{ns}:e:{seen.job_id}", 0, -1)
        value, ttl, starts, ends = pipe.execute()
    held = None if value is None else redis_store._held(stored, value, ttl)
    seen.samples.append(
        (time.monotonic_ns(), held.job_id if held else None, bool(held and held.finished))
    )
    seen.starts = [json.loads(raw) for raw in starts]
    seen.ends = [json.loads(raw) for raw in ends]


def play(run: Pass, path: Path_, scope: str) -> Observed:
    """Dispatch and drive one cell's job, watching its key until after its release."""
    key = f"{path.name}:{scope}:{uuid.uuid4().hex[:8]}"
    stored = run.storage_key(key)
    name = f"{_app.PREFIX}.{'unknown' if path.unknown else path.name}"
    options = dict(path.options)
    if path.drive == "expire":
        options["queue"] = run.spec["idle_queue"]
    dispatched = time.monotonic_ns()
    result = run.app.tasks[name].apply_async(
        kwargs={"key": key}, unique_while=scope, unique_prefix=False, **options
    )
    seen = Observed(path, scope, result.id, dispatched)
    if result.disposition is not Disposition.CREATED:
        seen.errors.append(f"the dispatch was {result.disposition}")
        return seen
    deadline = time.monotonic() + LEASE_S + 15
    released: float | None = None
    while time.monotonic() < deadline:
        sample(run, stored, seen)
        drive(run, path, seen)
        if released is None and seen.released_at is not None:
            released = time.monotonic()
        # Watch a while longer: runs that come after a release would show it was early.
        ran_all = len([r for r in seen.starts if r["job"] == seen.job_id]) >= path.runs
        if released is not None and ran_all and time.monotonic() - released > SETTLE_S:
            break
        time.sleep(SAMPLE_S)
    else:
        seen.errors.append("the key was never released, or the job never ran enough")
        return seen
    # The key is free (an exists key after its retention): a new dispatch creates.
    free_by = time.monotonic() + RETENTION_S + 10
    while run.store.get(stored) is not None and time.monotonic() < free_by:
        time.sleep(SAMPLE_S)
    probe = run.app.tasks[f"{_app.PREFIX}.probe"].apply_async(
        kwargs={"key": key}, unique_while=scope, unique_prefix=False
    )
    seen.probe = probe.id
    if probe.disposition is not Disposition.CREATED:
        seen.errors.append(f"the probe after the release was {probe.disposition}")
        return seen
    ran_by = time.monotonic() + 30
    while time.monotonic() < ran_by:
        starts, _ = run.runs(probe.id)
        if starts:
            seen.probe_start = starts[0]["start"]
            break
        time.sleep(SAMPLE_S)
    else:
        seen.errors.append("the probe never ran")
    return seen


def drive(run: Pass, path: Path_, seen: Observed) -> None:
    """Do to the job what its path says, once, when the time comes."""
    if path.drive is None or seen.cut_at is not None:
        return
    elapsed = (time.monotonic_ns() - seen.dispatched) / 1e9
    if path.drive in ("kill", "terminate"):
        first = [record for record in seen.starts if record["run"] == 1]
        if not first or time.monotonic_ns() - first[0]["start"] < CUT_AFTER_S * 1e9:
            return
        # Not before the worker heard the pool accept the job: a child killed
        # before that has the job run again elsewhere (billiard's rule), another path.
        if run.marks.get(f"{run.spec['namespace']}:accepted:{seen.job_id}") is None:
            return
        seen.cut_at = time.monotonic_ns()
        if path.drive == "kill":
            os.kill(first[0]["pid"], signal.SIGKILL)
        else:
            run.app.control.revoke(seen.job_id, terminate=True)
    elif path.drive == "revoke" and elapsed > 0.5:
        seen.cut_at = time.monotonic_ns()
        run.app.control.revoke(seen.job_id)
    elif path.drive == "expire" and elapsed > path.options["expires"] + 1:
        seen.cut_at = time.monotonic_ns()
        run.app.control.add_consumer(
            run.spec["idle_queue"], destination=[f"{run.worker.name}@{os.uname().nodename}"]
        )


def check(seen: Observed, broker: str) -> list[str]:
    """What is wrong with one cell's observations (nothing, if the library is right)."""
    problems = list(seen.errors)
    path, scope = seen.path, seen.scope
    if problems:
        problems.append(f"samples: {summary(seen)}")
    runs = [record for record in seen.starts if record["job"] == seen.job_id]
    if len(runs) != path.runs:
        problems.append(f"ran {len(runs)} times, Celery's semantics say {path.runs}")
    released = seen.released_at
    if released is None:
        return [*problems, "the key was never released"]
    before = [sample for sample in seen.samples if sample[0] < released]
    strays = {holder for _, holder, _ in before if holder != seen.job_id}
    if strays:
        problems.append(f"before its release the key was held by {strays}")
    kind, expected = seen.kind(), expected_kind(path, scope, broker)
    if kind != expected:
        problems.append(f"released at {kind!r}, expected at {expected!r}: {summary(seen)}")
    last = seen.last_event
    if scope != "queued" and last is not None and released < last:
        problems.append(
            f"released {(last - released) / 1e6:.0f} ms before the job's last run ended"
        )
    probe = seen.probe_start
    if scope != "queued" and probe is not None and last is not None and probe < last:
        problems.append("the probe ran before the job's last run ended")
    return problems


def summary(seen: Observed) -> str:
    """The cell's story in relative milliseconds, for a failure message."""

    def ms(at: int) -> int:
        return (at - seen.dispatched) // 1_000_000

    changes, last = [], None
    for at, holder, finished in seen.samples:
        state = (holder, finished)
        if state != last:
            changes.append(
                f"{ms(at)}:{'free' if holder is None else holder[:8]}{'/fin' if finished else ''}"
            )
            last = state
    runs = [f"run{r['run']}@{ms(r['start'])}" for r in seen.starts]
    ends = [f"end{r['run']}@{ms(r['end'])}" for r in seen.ends]
    cut = [] if seen.cut_at is None else [f"cut@{ms(seen.cut_at)}"]
    held = seen.last_held_at
    last_held = [] if held is None else [f"last-held@{ms(held)}"]
    return " ".join(changes + runs + ends + cut + last_held)


def render(observed: list[Observed], broker: str, pool: str) -> str:
    """The markdown table of one pass, as the docs show it."""
    rows = [
        f"**{broker} broker, `--pool={pool}`**",
        "",
        "| the job | runs | `queued` | `active` | `exists` |",
        "|---|---|---|---|---|",
    ]
    by_cell = {(seen.path.name, seen.scope): seen for seen in observed}
    for path in (path.here() for path in PATHS):
        cells = [by_cell.get((path.name, scope)) for scope in SCOPES]
        if not any(cells):
            continue
        runs = {len([r for r in c.starts if r["job"] == c.job_id]) for c in cells if c}
        labels = [
            LABELS.get((c.scope, c.kind()), c.kind()) if c else _not_played(path, scope)
            for c, scope in zip(cells, SCOPES, strict=True)
        ]
        rows.append(f"| {path.title} | {'/'.join(map(str, sorted(runs)))} | {' | '.join(labels)} |")
    return "\n".join(rows) + "\n"


def _not_played(path: Path_, scope: str) -> str:
    return "n/a (needs prefork)" if scope in path.scopes else "n/a (not allowed)"


def compare_with_docs(section: str, table: str) -> None:
    """The docs' table of this pass must be what the pass observed (or is rewritten).

    The docs show the newest Celery: on an older one, the rows of the paths that go
    otherwise there are left out of the comparison (each was checked against what
    that Celery does), and the docs cannot be rewritten from its run."""
    begin, end = f"<!-- {section} -->\n", f"<!-- /{section} -->\n"
    text = MATRIX_DOC.read_text() if MATRIX_DOC.exists() else ""
    if begin in text:
        head, rest = text.split(begin, 1)
        documented, tail = rest.split(end, 1)
    else:
        head, documented, tail = text, None, ""
    otherwise = [path for path in PATHS if not path.documented]
    if os.environ.get("UPDATE_PATH_MATRIX") == "1":
        assert not otherwise, (
            f"the docs show how the paths go on the newest Celery; on Celery "
            f"{CELERY[0]}.{CELERY[1]}, {', '.join(p.name for p in otherwise)} go otherwise"
        )
        MATRIX_DOC.parent.mkdir(parents=True, exist_ok=True)
        MATRIX_DOC.write_text(head + begin + table + end + tail)
        return
    if otherwise and documented is not None:
        table = without_rows(table, [path.here().title for path in otherwise])
        documented = without_rows(documented, [path.title for path in otherwise])
    assert documented == table, (
        f"docs/_generated/path-matrix.md ({section}) differs from what this run observed; "
        "rerun with UPDATE_PATH_MATRIX=1 if the change is intended:\n" + table
    )


def compare_older_with_docs(listed: str) -> None:
    """The docs' list of the paths that go otherwise on older Celery is ``listed`` (or is
    rewritten, with ``UPDATE_PATH_MATRIX=1``, whatever Celery runs: it is not observed)."""
    begin, end = "<!-- older-celery -->\n", "<!-- /older-celery -->\n"
    text = MATRIX_DOC.read_text()
    if os.environ.get("UPDATE_PATH_MATRIX") == "1":
        if begin in text:
            head, rest = text.split(begin, 1)
            tail = rest.split(end, 1)[1]
        else:
            head, tail = text, ""
        MATRIX_DOC.write_text(head + begin + listed + end + tail)
        return
    assert f"{begin}{listed}{end}" in text, (
        "docs/_generated/path-matrix.md does not list the paths that go otherwise on older "
        "Celery as PATHS says; rerun with UPDATE_PATH_MATRIX=1:\n" + listed
    )


def without_rows(table: str, titles: list[str]) -> str:
    """``table`` without the rows of the jobs titled ``titles``."""
    starts = tuple(f"| {title} |" for title in titles)
    return "".join(line for line in table.splitlines(keepends=True) if not line.startswith(starts))


#: The paths whose rows this run played with an older Celery's expectations, and how they
#: go there (named at the end of the run: tests/paths/conftest.py).
played_otherwise: dict[str, Older] = {}


def as_here(paths: list[Path_]) -> list[Path_]:
    """``paths`` as they go on the Celery running the test (noting those that go otherwise)."""
    for path in paths:
        if not path.documented and path.older is not None:
            played_otherwise[path.name] = path.older
    return [path.here() for path in paths]


def render_older() -> str:
    """The docs' list of the paths that go otherwise on older Celery (from :data:`PATHS`)."""
    rows = [
        "**On older Celery**",
        "",
        "| the job | before Celery | runs there | why |",
        "|---|---|---|---|",
    ]
    for path in PATHS:
        if path.older is not None:
            older = path.older
            since = f"{older.since[0]}.{older.since[1]}"
            rows.append(f"| {path.title} | {since} | {older.runs} | {older.why} |")
    return "\n".join(rows) + "\n"


#: What a window key does on every path it was played on: it names the job.
WINDOW_LABEL = "names the job for its window"


def play_window(run: Pass, path: Path_) -> Observed:
    """Dispatch and drive a window-keyed twin of a path's job, watching its window key
    until after its last run; then dispatch the same request again."""
    key = f"{path.name}:window:{uuid.uuid4().hex[:8]}"
    name = f"{_app.PREFIX}.window.{path.name}"
    stored = keyspace.storage_key(run.spec["namespace"], keyspace.WINDOW, name, key)
    task = run.app.tasks[name]
    dispatched = time.monotonic_ns()
    result = task.apply_async(kwargs={"key": key}, **path.options)
    seen = Observed(path, "window", result.id, dispatched)
    if result.disposition is not Disposition.CREATED:
        seen.errors.append(f"the dispatch was {result.disposition}")
        return seen
    deadline = time.monotonic() + LEASE_S + 15
    over: float | None = None
    while time.monotonic() < deadline:
        sample(run, stored, seen)
        drive(run, path, seen)
        if over is None and _last_run_over(seen):
            over = time.monotonic()
        # Watch a while longer: a run after the last one would show here.
        if over is not None and time.monotonic() - over > SETTLE_S:
            break
        time.sleep(SAMPLE_S)
    else:
        seen.errors.append("the job never ran enough, or its last run never ended")
        return seen
    again = task.apply_async(kwargs={"key": key}, **path.options)
    seen.probe = again.id
    if (again.disposition, again.duplicate_match) != (Disposition.REUSED, DuplicateMatch.WINDOW):
        seen.errors.append(f"the same request afterwards was {again.disposition}")
    return seen


def _last_run_over(seen: Observed) -> bool:
    """Whether the job ran as often as its path says, and its last run ended (or was cut)."""
    runs = [record["run"] for record in seen.starts if record["job"] == seen.job_id]
    if len(runs) < seen.path.runs:
        return False
    ended = {record["run"] for record in seen.ends}
    return max(runs) in ended or (len(runs) == 1 and seen.cut_at is not None)


def check_window(seen: Observed) -> list[str]:
    """What is wrong with one window cell's observations (nothing, if the library is right)."""
    problems = list(seen.errors)
    runs = [record for record in seen.starts if record["job"] == seen.job_id]
    if len(runs) != seen.path.runs:
        problems.append(f"ran {len(runs)} times, Celery's semantics say {seen.path.runs}")
    others = {holder for _, holder, _ in seen.samples if holder != seen.job_id}
    if others:
        problems.append(f"the window key named {others}, not the job")
    if seen.probe is not None and seen.probe != seen.job_id:
        problems.append(f"the same request afterwards was job {seen.probe}")
    if problems:
        problems.append(f"samples: {summary(seen)}")
    return problems


def render_window(observed: list[Observed], broker: str, pool: str) -> str:
    """The markdown table of one pass's window cells, as the docs show it."""
    rows = [
        f"**{broker} broker, `--pool={pool}`, window key**",
        "",
        "| the job | runs | window key |",
        "|---|---|---|",
    ]
    for seen in observed:
        runs = len([r for r in seen.starts if r["job"] == seen.job_id])
        label = "; ".join(check_window(seen)[:1]) or WINDOW_LABEL
        rows.append(f"| {seen.path.title} | {runs} | {label} |")
    return "\n".join(rows) + "\n"


@pytest.mark.parametrize("broker", ["redis", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def test_every_path_keeps_a_window_key_naming_its_job(
    matrix_pass: Callable[[str, str], Pass], broker: str
) -> None:
    """Each windowed path on a real prefork worker: the job runs as Celery says (a re-send
    under its id is never a conflict with its own window key), the key names it all along,
    and the same request afterwards is that job."""
    run = matrix_pass(broker, "prefork")
    paths = as_here([path for path in PATHS if path.name in _app.WINDOWED])
    with ThreadPoolExecutor(max_workers=len(paths)) as threads:
        observed = list(threads.map(lambda path: play_window(run, path), paths))
    table = render_window(observed, broker, "prefork")
    print(f"\n{table}")
    problems = [
        f"{seen.path.name} / window (job {seen.job_id}): {problem}"
        for seen in observed
        for problem in check_window(seen)
    ]
    failing = {seen.job_id for seen in observed if check_window(seen)}
    lines = [line for line in run.worker.log().splitlines() if any(j in line for j in failing)]
    assert not problems, "\n".join(problems) + "\n\nworker log:\n" + "\n".join(lines[-60:])
    compare_with_docs(f"{broker}-prefork-window", table)


@pytest.mark.parametrize(
    ("broker", "pool"),
    [
        ("redis", "prefork"),
        pytest.param("rabbitmq", "prefork", marks=pytest.mark.rabbitmq),
        ("redis", "threads"),
    ],
)
def test_every_path_holds_its_key_exactly_while_its_job_can_run(
    matrix_pass: Callable[[str, str], Pass], broker: str, pool: str
) -> None:
    """Each path x scope on a real worker: runs as Celery says, key held until its scope's point."""
    run = matrix_pass(broker, pool)
    only = os.environ.get("PATHS_ONLY")
    paths = as_here(
        [
            path
            for path in PATHS
            if (pool == "prefork" or not path.prefork_only)
            and (not only or path.name in only.split(","))
        ]
    )
    cells = [(path, scope) for path in paths for scope in SCOPES if scope in path.scopes]
    with ThreadPoolExecutor(max_workers=len(cells)) as threads:
        observed = list(threads.map(lambda cell: play(run, *cell), cells))
    table = render(observed, broker, pool)
    print(f"\n{table}")
    problems = [
        f"{seen.path.name} / {seen.scope} (job {seen.job_id}): {problem}"
        for seen in observed
        for problem in check(seen, broker)
    ]
    failing = {seen.job_id for seen in observed if check(seen, broker)}
    lines = [line for line in run.worker.log().splitlines() if any(j in line for j in failing)]
    assert not problems, "\n".join(problems) + "\n\nworker log:\n" + "\n".join(lines[-60:])
    compare_with_docs(f"{broker}-{pool}", table)


def test_the_docs_show_every_pass() -> None:
    """The generated page has a table for each pass the matrix runs."""
    text = MATRIX_DOC.read_text()
    sections = ("redis-prefork", "rabbitmq-prefork", "redis-threads")
    for section in (*sections, "redis-prefork-window", "rabbitmq-prefork-window"):
        assert f"<!-- {section} -->" in text, section


def test_the_docs_list_the_paths_that_go_otherwise_on_older_celery() -> None:
    """Below the tables (which show the newest Celery), the docs list each path that goes
    otherwise on an older Celery supported: how, since which release, and why
    (``UPDATE_PATH_MATRIX=1`` rewrites the list)."""
    compare_older_with_docs(render_older())


def test_a_release_just_after_a_late_run_is_the_runs_and_not_the_leases() -> None:
    """The classification itself: a key freed 0.3 s after a second run that came 19 s
    after the dispatch (renewed meanwhile) was freed at the end; one freed 15 s after
    the dispatch with no run near it was freed by the lease."""
    s = 1_000_000_000

    def seen(starts: list[float], ends: list[float], released: float) -> Observed:
        job = "job"
        samples = [(int(t * s), job, False) for t in (0.5, 5.0, 10.0, released - 0.1)]
        return Observed(
            path=PATHS[0],
            scope="active",
            job_id=job,
            dispatched=0,
            samples=[*samples, (int(released * s), None, False)],
            starts=[{"run": n, "start": int(t * s)} for n, t in enumerate(starts, 1)],
            ends=[{"run": n, "end": int(t * s)} for n, t in enumerate(ends, 1)],
        )

    assert seen([7.5, 19.6], [7.6, 19.9], released=20.2).kind() == "end"
    assert seen([1.0], [1.2], released=15.1).kind() == "lease"
    assert seen([], [], released=15.1).kind() == "lease"
