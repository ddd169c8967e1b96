"""The decision rules of the stores that run Python (``stores/_records.py``), called directly
where the store contract (``tests/contract``) cannot tell: what each store does with them is
held there, on every store."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from celery_unique.stores._records import (
    UNCHANGED,
    Record,
    Writes,
    decide,
    forgetting,
    noting,
    passing_on,
    reading_note,
    releasing,
    renewing,
    rolling_back,
    starting_run,
)
from celery_unique.stores.base import (
    GOES_ON,
    HAND_OVER_UNDONE,
    HANDED_OVER_MARK,
    HANDING_OVER,
    RUNNING,
    ActiveClaim,
    Claim,
    Decision,
    Effect,
    FollowUp,
    Hold,
    KeyKind,
    OnDuplicate,
    RunBegun,
    RunStart,
    Scope,
    Verdict,
    WindowClaim,
)


def test_a_record_cannot_be_changed_in_place() -> None:
    """A store keeps the records it hands to a change function: a change returns a new
    record (dataclasses.replace), and may never alter the one the store still holds."""
    record = Record("job", "task", KeyKind.ACTIVE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.job_id = "other"  # type: ignore[misc]


def test_a_rollback_names_its_job_by_value() -> None:
    """A store that reads records back (SQLite, Django) holds a job id equal to the
    claim's, never the same object: the rollback undoes the write all the same."""
    job_id = "".join(["job-", "1"])
    claim = Claim(job_id, "task", active=ActiveClaim("key", Scope.ACTIVE, None))
    stored = Record("".join(["job", "-1"]), "task", KeyKind.ACTIVE, Scope.ACTIVE)
    assert stored.job_id == job_id
    assert stored.job_id is not job_id
    assert rolling_back(claim, "key")(stored, 0) is None
    other = Record("job-2", "task", KeyKind.ACTIVE, Scope.ACTIVE)
    assert rolling_back(claim, "key")(other, 0) is UNCHANGED


@pytest.mark.parametrize(
    ("due", "starts_in_ms"), [(None, None), (100, None), (200, None), (300, 100)]
)
def test_a_planned_start_reads_as_the_time_left_until_it(
    due: int | None, starts_in_ms: int | None
) -> None:
    """A start that is due (now or past: the worker has not marked the run yet) is no
    start still to wait for."""
    record = Record("job", "task", KeyKind.ACTIVE, Scope.ACTIVE, due=due)
    assert record.held("key", 200).starts_in_ms == starts_in_ms


def test_a_handoff_names_the_running_job_by_value() -> None:
    """A task that chains to itself hands its key to the next job: the holder read back
    from a store is equal to the one the claim names, never the same object."""
    held = Record("".join(["job", "-1"]), "task", KeyKind.ACTIVE, Scope.ACTIVE, run="r1")
    claim = Claim(
        "job-2",
        "task",
        active=ActiveClaim("key", Scope.ACTIVE, None),
        handoff_from="".join(["job-", "1"]),
    )
    assert held.job_id is not claim.handoff_from
    (decision,), writes = decide([claim], {"key": held}.get, 0, all_or_nothing=True)
    assert (decision.verdict, decision.job_id) == (Verdict.CREATED, "job-2")
    handed = writes["key"]
    assert handed is not None
    assert (handed.job_id, handed.handed_from) == ("job-2", held.job_id)
    other = Record("job-9", "task", KeyKind.ACTIVE, Scope.ACTIVE, run="r9")
    (decision,), _ = decide([claim], {"key": other}.get, 0, all_or_nothing=True)
    assert (decision.verdict, decision.job_id) == (Verdict.REUSED_ACTIVE, "job-9")


def test_a_record_is_gone_at_its_expiry() -> None:
    record = Record("job", "task", KeyKind.ACTIVE, expires_at=100)
    assert (record.alive(99), record.alive(100)) == (True, False)
    assert Record("job", "task", KeyKind.ACTIVE).alive(10**15)


def test_a_renewal_holds_the_key_for_the_lease_from_now() -> None:
    record = Record("job", "task", KeyKind.ACTIVE, Scope.ACTIVE, expires_at=1_000)
    renewed = renewing(Hold("job", "key"), 5_000)(record, 500)
    assert isinstance(renewed, Record)
    assert renewed.expires_at == 5_500


# Ids, runs, generations and digests as a store reads them back (SQLite, Django, a worker's
# JSON): equal to the ones a call names, never the same objects. The memory store keeps
# the caller's own strings, so only these tests tell a comparison by value from one by
# identity.
def _copy(text: str) -> str:
    return "".join(list(text))


ACTIVE_KEY = "key:a"
WINDOW_KEY = "key:w"


def _held(job_id: str = "j1", **fields: object) -> Record:
    values: dict[str, object] = {"scope": Scope.ACTIVE, **fields}
    return Record(job_id, "task", KeyKind.ACTIVE, **values)  # type: ignore[arg-type]


def _remembered(job_id: str = "j1", fingerprint: str = "fp", policy: str = "p") -> Record:
    return Record(job_id, "task", KeyKind.WINDOW, fingerprint=fingerprint, policy=policy)


def _windowed(job_id: str, fingerprint: str = "fp", policy: str = "p") -> Claim:
    return Claim(
        job_id,
        "task",
        active=ActiveClaim(ACTIVE_KEY, Scope.ACTIVE, None),
        window=WindowClaim(WINDOW_KEY, 1_000, fingerprint, policy),
    )


def _nothing(key: str) -> Record | None:
    return None


def _decide_one(claim: Claim, records: dict[str, Record], now: int = 0) -> tuple[Decision, Writes]:
    (decision,), writes = decide([claim], records.get, now, all_or_nothing=True)
    return decision, writes


def test_a_window_and_an_active_key_of_one_job_are_reused_together() -> None:
    records = {
        WINDOW_KEY: _remembered(_copy("j1"), _copy("fp"), _copy("p")),
        ACTIVE_KEY: _held(_copy("j1")),
    }
    decision, writes = _decide_one(_windowed("j2", "fp", "p"), records)
    assert (decision.verdict, decision.job_id, decision.policy_drift) == (
        Verdict.REUSED_WINDOW,
        "j1",
        False,
    )
    assert writes == {}


@pytest.mark.parametrize("fingerprint", ["fp0", "fp2"])
def test_another_request_in_a_window_is_a_conflict(fingerprint: str) -> None:
    decision, writes = _decide_one(
        _windowed("j2", fingerprint), {WINDOW_KEY: _remembered("j1", "fp1")}
    )
    assert (decision.verdict, decision.conflicting_job_ids, writes) == (
        Verdict.CONFLICT,
        ("j1",),
        {},
    )


@pytest.mark.parametrize("policy", ["p0", "p2"])
def test_a_window_tells_a_policy_changed_since_as_drift(policy: str) -> None:
    decision, _ = _decide_one(
        _windowed("j2", "fp", policy), {WINDOW_KEY: _remembered("j1", policy="p1")}
    )
    assert (decision.verdict, decision.policy_drift) == (Verdict.REUSED_WINDOW, True)


@pytest.mark.parametrize("holder", ["j0", "j3"])
def test_a_window_remembering_another_job_than_the_active_holder_is_a_conflict(
    holder: str,
) -> None:
    records = {WINDOW_KEY: _remembered("j1"), ACTIVE_KEY: _held(holder)}
    decision, _ = _decide_one(_windowed("j2"), records)
    assert (decision.verdict, decision.conflicting_job_ids) == (
        Verdict.COMPOSITION_CONFLICT,
        ("j1", holder),
    )


@pytest.mark.parametrize("holder", ["j0", "j3"])
def test_a_new_window_names_the_job_holding_the_active_key(holder: str) -> None:
    decision, writes = _decide_one(_windowed("j2"), {ACTIVE_KEY: _held(holder)})
    assert (decision.verdict, decision.job_id) == (Verdict.REUSED_ACTIVE, holder)
    window = writes[WINDOW_KEY]
    assert window is not None
    assert window.job_id == holder


@pytest.mark.parametrize("handoff_from", ["j0", "j3"])
def test_only_the_holder_named_hands_its_key_off(handoff_from: str) -> None:
    claim = Claim(
        "j2", "task", active=ActiveClaim(ACTIVE_KEY, Scope.ACTIVE, None), handoff_from=handoff_from
    )
    decision, writes = _decide_one(claim, {ACTIVE_KEY: _held("j1", run="r1")})
    assert (decision.verdict, decision.job_id) == (Verdict.REUSED_ACTIVE, "j1")
    assert writes == {}


@pytest.mark.parametrize("on_duplicate", [OnDuplicate.REUSE, OnDuplicate.LATEST])
def test_only_a_debounced_job_is_created_with_a_planned_start(on_duplicate: OnDuplicate) -> None:
    """A debounce given to a task that does not debounce plans nothing."""
    active = ActiveClaim(ACTIVE_KEY, Scope.ACTIVE, None, on_duplicate, debounce_ms=500)
    decision, writes = _decide_one(Claim("j1", "task", active=active), {}, now=1_000)
    created = writes[ACTIVE_KEY]
    assert created is not None
    assert (decision.verdict, decision.starts_at_ms, created.due) == (Verdict.CREATED, None, None)


@pytest.mark.parametrize("task", ["a-task", "z-task"])
def test_a_duplicate_of_another_task_leaves_the_holder_its_arguments(task: str) -> None:
    held = _held(on_duplicate=OnDuplicate.LATEST, arguments="old")
    active = ActiveClaim(ACTIVE_KEY, Scope.ACTIVE, None, OnDuplicate.LATEST, arguments="new")
    decision, writes = _decide_one(Claim("j2", task, active=active), {ACTIVE_KEY: held})
    assert (decision.verdict, decision.effect, writes) == (Verdict.REUSED_ACTIVE, None, {})


def test_a_duplicate_of_the_same_task_replaces_the_holders_arguments() -> None:
    held = Record(
        "j1", _copy("task"), KeyKind.ACTIVE, Scope.ACTIVE, on_duplicate=OnDuplicate.LATEST
    )
    active = ActiveClaim(ACTIVE_KEY, Scope.ACTIVE, None, OnDuplicate.LATEST, arguments="new")
    decision, writes = _decide_one(Claim("j2", "task", active=active), {ACTIVE_KEY: held})
    assert decision.effect is Effect.ARGUMENTS_REPLACED
    assert writes[ACTIVE_KEY] == dataclasses.replace(held, arguments="new")


def _debounced(debounce_ms: int, lease_ms: int | None = None) -> Claim:
    active = ActiveClaim(
        ACTIVE_KEY, Scope.ACTIVE, lease_ms, OnDuplicate.DEBOUNCE, "new", debounce_ms=debounce_ms
    )
    return Claim("j2", "task", active=active)


@pytest.mark.parametrize(("due", "moved_to"), [(1_000, 1_500), (2_000, 2_000), (None, 1_500)])
def test_a_debounced_duplicate_moves_the_start_to_its_debounce_from_now_never_earlier(
    due: int | None, moved_to: int
) -> None:
    held = _held(on_duplicate=OnDuplicate.DEBOUNCE, due=due)
    decision, writes = _decide_one(_debounced(1_000), {ACTIVE_KEY: held}, now=500)
    assert (decision.effect, decision.starts_at_ms) == (Effect.POSTPONED, moved_to)
    postponed = writes[ACTIVE_KEY]
    assert postponed is not None
    assert (postponed.due, postponed.arguments) == (moved_to, "new")


def test_a_debounced_duplicate_moves_the_start_no_later_than_the_cap() -> None:
    held = _held(on_duplicate=OnDuplicate.DEBOUNCE, due=1_000, cap=1_200, expires_at=5_000)
    decision, writes = _decide_one(_debounced(1_000, lease_ms=10_000), {ACTIVE_KEY: held}, 500)
    postponed = writes[ACTIVE_KEY]
    assert postponed is not None
    assert (decision.starts_at_ms, postponed.due, postponed.expires_at) == (1_200, 1_200, 5_000)


@pytest.mark.parametrize(
    ("expires_at", "lease_until"), [(5_000, 10_500), (20_000, 20_000), (None, None)]
)
def test_an_uncapped_debounced_duplicate_pushes_the_lease_to_its_own(
    expires_at: int | None, lease_until: int | None
) -> None:
    held = _held(on_duplicate=OnDuplicate.DEBOUNCE, due=1_000, expires_at=expires_at)
    _, writes = _decide_one(_debounced(1_000, lease_ms=10_000), {ACTIVE_KEY: held}, 500)
    postponed = writes[ACTIVE_KEY]
    assert postponed is not None
    assert postponed.expires_at == lease_until


# releasing (Store.release_many)


@pytest.mark.parametrize("run", ["r0", "r2"])
def test_only_the_run_marking_the_key_hands_it_over(run: str) -> None:
    record = _held(run="r1")
    assert releasing("j1", HANDING_OVER, run)(record, 0) is UNCHANGED
    handed = releasing("j1", HANDING_OVER, _copy("r1"))(record, 0)
    assert isinstance(handed, Record)
    assert handed.run == HANDED_OVER_MARK + "r1"


@pytest.mark.parametrize("run", ["r0", "r2"])
def test_only_the_run_that_handed_the_key_over_takes_it_back(run: str) -> None:
    record = _held(run=HANDED_OVER_MARK + "r1")
    assert releasing("j1", HAND_OVER_UNDONE, run)(record, 0) is UNCHANGED
    undone = releasing("j1", HAND_OVER_UNDONE, _copy("r1"))(record, 0)
    assert isinstance(undone, Record)
    assert undone.run == "r1"


@pytest.mark.parametrize("job_id", ["j0", "j2"])
def test_a_release_ends_only_its_own_jobs_hold(job_id: str) -> None:
    assert releasing(job_id, 0)(_held("j1"), 0) is UNCHANGED
    assert releasing(_copy("j1"), 0)(_held("j1"), 0) is None


@pytest.mark.parametrize("generation", ["g0", "g2"])
def test_a_release_ends_only_the_hold_of_the_dispatch_it_names(generation: str) -> None:
    record = _held(generation="g1")
    assert releasing("j1", 0, None, generation)(record, 0) is UNCHANGED
    assert releasing("j1", 0, None, _copy("g1"))(record, 0) is None
    assert releasing("j1", 0, None, None)(record, 0) is None


def test_a_release_of_a_run_ends_the_hold_its_run_marks() -> None:
    assert releasing("j1", 0, _copy("r1"))(_held(run="r1", alive_until=1_000), 500) is None


@pytest.mark.parametrize("run", ["r0", "r2", None])
def test_a_run_vouched_alive_keeps_the_key_from_another_delivery_until_then(
    run: str | None,
) -> None:
    record = _held(run="r1", alive_until=1_000)
    assert releasing("j1", 0, run)(record, 999) is UNCHANGED
    assert releasing("j1", 0, run)(record, 1_000) is None


@pytest.mark.parametrize("run", ["r0", "r2", None])
def test_a_key_handed_over_by_a_run_is_released_by_any_other(run: str | None) -> None:
    record = _held(run=HANDED_OVER_MARK + "r1")
    assert releasing("j1", 0, run)(record, 0) is None
    assert releasing("j1", 0, _copy("r1"))(record, 0) is UNCHANGED


# starting_run (Store.begin_run)


def _start(run: str = "r1", lease_ms: int | None = None, **fields: object) -> RunStart:
    return RunStart(run, Scope.ACTIVE, "task", lease_ms, **fields)  # type: ignore[arg-type]


def _begin(record: Record, job_id: str, start: RunStart, now: int) -> tuple[object, RunBegun]:
    outcome = [RunBegun()]
    changed = starting_run(job_id, start, outcome)(record, now)
    return changed, outcome[0]


@pytest.mark.parametrize("job_id", ["j0", "j2"])
def test_a_start_finds_the_key_held_by_another_job(job_id: str) -> None:
    changed, begun = _begin(_held("j1"), job_id, _start(), 0)
    assert (changed, begun) == (UNCHANGED, RunBegun(holder="j1"))


def test_a_start_of_the_job_marks_its_key() -> None:
    changed, begun = _begin(_held("j1"), _copy("j1"), _start(), 0)
    assert begun == RunBegun()
    assert isinstance(changed, Record)
    assert changed.run == "r1"


def test_a_start_of_the_job_that_handed_its_key_on_finds_no_holder() -> None:
    """The job that handed its key to its successor runs on: no other job holds it."""
    record = _held("j2", handed_from="j1")
    changed, begun = _begin(record, _copy("j1"), _start(), 0)
    assert (changed, begun) == (UNCHANGED, RunBegun())


@pytest.mark.parametrize("now", [1_000, 1_500])
def test_a_start_waits_until_the_planned_start_and_no_longer(now: int) -> None:
    record = _held(due=1_000, on_duplicate=OnDuplicate.DEBOUNCE)
    start = _start(follows_duplicates=True)
    assert _begin(record, "j1", start, 999) == (UNCHANGED, RunBegun(wait_ms=1))
    changed, begun = _begin(record, "j1", start, now)
    assert begun == RunBegun()
    assert isinstance(changed, Record)
    assert (changed.run, changed.due) == ("r1", None)


def test_a_delivery_delivered_again_takes_its_own_mark_back() -> None:
    record = _held(run="r1", alive_until=1_000)
    changed, begun = _begin(record, "j1", _start(_copy("r1"), alive_ms=2_000), 500)
    assert begun == RunBegun()
    assert isinstance(changed, Record)
    assert changed.alive_until == 2_500


@pytest.mark.parametrize("run", ["r0", "r2"])
def test_a_start_waits_for_another_delivery_vouched_alive(run: str) -> None:
    record = _held(run="r1", alive_until=1_000)
    assert _begin(record, "j1", _start(run), 600) == (UNCHANGED, RunBegun(busy_ms=400))


@pytest.mark.parametrize(
    ("now", "expires_at", "lease_until"),
    [(1, 1_000, 1_001), (1, 1_001, 1_001), (1, 5_000, 5_000), (500, 1_200, 1_500)],
)
def test_a_start_pushes_the_lease_to_its_own_never_back(
    now: int, expires_at: int, lease_until: int
) -> None:
    changed, _ = _begin(_held(expires_at=expires_at), "j1", _start(lease_ms=1_000), now)
    assert isinstance(changed, Record)
    assert changed.expires_at == lease_until


# passing_on (Store.pass_on, pass_on_or_release)


def _pass_on(record: Record, job_id: str, now: int) -> tuple[object, FollowUp | None]:
    outcome: list[FollowUp | None] = [None]
    changed = passing_on(job_id, "r1", 5_000, outcome)(record, now)
    return changed, outcome[0]


def test_a_finished_run_passes_its_key_on_to_the_run_it_owes() -> None:
    record = _held(run="r1", owed="j9", arguments="new", expires_at=1_000)
    changed, follow_up = _pass_on(record, _copy("j1"), 500)
    assert follow_up == FollowUp("j9", "new", "task")
    assert isinstance(changed, Record)
    assert (changed.job_id, changed.owed, changed.run, changed.expires_at) == (
        "j9",
        None,
        None,
        5_500,
    )


def test_an_expired_hold_passes_nothing_on() -> None:
    record = _held(run="r1", owed="j9", expires_at=1_000)
    assert _pass_on(record, "j1", 1_000) == (UNCHANGED, None)


@pytest.mark.parametrize("job_id", ["j0", "j2"])
def test_only_the_holder_passes_its_key_on(job_id: str) -> None:
    assert _pass_on(_held(run="r1", owed="j9"), job_id, 0) == (UNCHANGED, None)


def test_a_finished_job_passes_nothing_on() -> None:
    assert _pass_on(_held(run="r1", owed="j9", finished=True), "j1", 0) == (UNCHANGED, None)


# rolling_back (Store.rollback_many)


def test_a_rollback_undoes_the_window_its_claim_wrote_beside_its_hold() -> None:
    """The generation names the dispatch's active hold; the window key (which sorts
    either side of the active one) has none, and goes with the claim."""
    for window_key in ("key:0", "key:z"):
        claim = Claim(
            "j1",
            "task",
            active=ActiveClaim(ACTIVE_KEY, Scope.ACTIVE, None, generation="g1"),
            window=WindowClaim(window_key, 1_000, "fp", "p"),
        )
        assert rolling_back(claim, window_key)(_remembered("j1"), 0) is None


@pytest.mark.parametrize("generation", ["g0", "g2"])
def test_a_rollback_leaves_a_hold_another_dispatch_of_the_job_wrote(generation: str) -> None:
    claim = Claim("j1", "task", active=ActiveClaim(ACTIVE_KEY, Scope.ACTIVE, None, generation="g1"))
    assert rolling_back(claim, ACTIVE_KEY)(_held(generation=generation), 0) is UNCHANGED
    assert rolling_back(claim, ACTIVE_KEY)(_held(generation=_copy("g1")), 0) is None


@pytest.mark.parametrize("job_id", ["j0", "j2"])
def test_a_rollback_leaves_another_jobs_hold(job_id: str) -> None:
    claim = Claim("j1", "task", active=ActiveClaim(ACTIVE_KEY, Scope.ACTIVE, None))
    assert rolling_back(claim, ACTIVE_KEY)(_held(job_id), 0) is UNCHANGED


# renewing (Store.renew_many)


def test_an_expired_hold_is_not_renewed() -> None:
    assert renewing(Hold("j1", ACTIVE_KEY), 5_000)(_held(expires_at=1_000), 1_000) is UNCHANGED


@pytest.mark.parametrize("job_id", ["j0", "j2"])
def test_only_the_holder_renews_its_hold(job_id: str) -> None:
    record = _held(expires_at=1_000)
    assert renewing(Hold(job_id, ACTIVE_KEY), 5_000)(record, 500) is UNCHANGED
    renewed = renewing(Hold(_copy("j1"), ACTIVE_KEY), 5_000)(record, 500)
    assert isinstance(renewed, Record)
    assert renewed.expires_at == 5_500


def test_a_renewal_as_long_as_the_lease_left_changes_nothing() -> None:
    assert renewing(Hold("j1", ACTIVE_KEY), 1_000)(_held(expires_at=1_500), 500) is UNCHANGED


@pytest.mark.parametrize("run", ["r0", "r2"])
def test_a_renewal_vouches_only_for_the_run_marking_the_key(run: str) -> None:
    record = _held(run="r1", alive_until=1_000)
    assert renewing(Hold("j1", ACTIVE_KEY, run), None, 2_000)(record, 500) is UNCHANGED
    renewed = renewing(Hold("j1", ACTIVE_KEY, _copy("r1")), None, 2_000)(record, 500)
    assert isinstance(renewed, Record)
    assert renewed.alive_until == 2_500


# noting (Store.delete by job id)


@pytest.mark.parametrize(
    "forgotten",
    [
        Record("j1", "task", KeyKind.WINDOW, expires_at=1_000),
        Record("j1", "task", KeyKind.ACTIVE, Scope.ACTIVE, finished=True, expires_at=1_000),
    ],
)
def test_only_an_unfinished_hold_released_leaves_a_note(forgotten: Record) -> None:
    assert noting([forgotten])(None, 0) is UNCHANGED


def test_a_hold_released_leaves_a_note_as_long_as_it_would_have_lived() -> None:
    note = noting([_held(expires_at=1_000, generation="g1")])(None, 500)
    assert note == Record(
        "j1", "task", KeyKind.ACTIVE, expires_at=1_000, since=500, generation="g1"
    )


@pytest.mark.parametrize("now", [1_000, 1_500])
def test_a_run_vouched_alive_until_now_no_longer_keeps_the_key_from_a_start(now: int) -> None:
    record = _held(run="r1", alive_until=1_000)
    changed, begun = _begin(record, "j1", _start("r2"), now)
    assert begun == RunBegun()
    assert isinstance(changed, Record)
    assert changed.run == "r2"


@pytest.mark.parametrize(("keep_ms", "kept_until"), [(None, None), (2_000, 2_500)])
def test_a_final_release_keeps_the_key_finished_for_as_long_as_asked(
    keep_ms: int | None, kept_until: int | None
) -> None:
    record = _held(run="r1", alive_until=1_000, expires_at=1_000)
    kept = releasing("j1", keep_ms, "r1")(record, 500)
    assert isinstance(kept, Record)
    assert (kept.finished, kept.expires_at, kept.run, kept.alive_until) == (
        True,
        kept_until,
        None,
        None,
    )


@pytest.mark.parametrize("run", ["r0", "r2"])
def test_only_the_delivery_that_passed_the_key_on_is_answered_again(run: str) -> None:
    record = _held(run="r1", owed="j9", arguments="new")
    passed = passing_on("j1", "r1", None, [None])(record, 0)
    assert isinstance(passed, Record)
    outcome: list[FollowUp | None] = [None]
    assert passing_on("j1", run, None, outcome)(passed, 0) is UNCHANGED
    assert outcome == [None]
    assert passing_on(_copy("j1"), _copy("r1"), None, outcome)(passed, 0) is UNCHANGED
    assert outcome == [FollowUp("j9", "new", "task")]


def test_a_new_hold_and_window_are_dated_by_the_wall_clock_and_live_on_the_stores() -> None:
    claim = _windowed("j1")
    claim = dataclasses.replace(claim, active=ActiveClaim(ACTIVE_KEY, Scope.ACTIVE, 3_000))
    (decision,), writes = decide([claim], _nothing, 500, all_or_nothing=True, wall=9_000)
    assert decision.verdict is Verdict.CREATED
    hold, window = writes[ACTIVE_KEY], writes[WINDOW_KEY]
    assert hold is not None
    assert window is not None
    assert (hold.job_id, window.job_id) == ("j1", "j1")
    assert (hold.since, hold.expires_at, window.since, window.expires_at) == (
        9_000,
        3_500,
        9_000,
        1_500,
    )
    (_,), writes = decide([claim], _nothing, 500, all_or_nothing=True)
    assert [record.since for record in writes.values() if record is not None] == [500, 500]


@pytest.mark.parametrize(("debounce_max_ms", "cap"), [(None, None), (2_000, 2_500), (100, 1_500)])
def test_a_debounced_job_is_planned_its_debounce_from_now_capped_no_sooner(
    debounce_max_ms: int | None, cap: int | None
) -> None:
    active = ActiveClaim(
        ACTIVE_KEY,
        Scope.ACTIVE,
        None,
        OnDuplicate.DEBOUNCE,
        debounce_ms=1_000,
        debounce_max_ms=debounce_max_ms,
    )
    (decision,), writes = decide(
        [Claim("j1", "task", active=active)], _nothing, 500, all_or_nothing=True, wall=9_000
    )
    created = writes[ACTIVE_KEY]
    assert created is not None
    assert (decision.starts_at_ms, created.due, created.cap) == (10_000, 1_500, cap)


# forgetting (Store.delete: an operator's release)


@pytest.mark.parametrize(
    ("fields", "spared"),
    [
        ({"on_duplicate": OnDuplicate.LATEST, "owed": "j9"}, True),
        ({"on_duplicate": OnDuplicate.LATEST, "arguments": "new"}, True),
        ({"on_duplicate": OnDuplicate.LATEST}, False),
        ({"on_duplicate": OnDuplicate.REUSE, "arguments": "new"}, False),
        ({"on_duplicate": OnDuplicate.LATEST, "arguments": "new", "finished": True}, False),
    ],
)
def test_a_release_sparing_what_duplicates_left_spares_only_a_hold_owing_it(
    fields: dict[str, Any], spared: bool
) -> None:
    record = _held(**fields)
    assert forgetting("j1", spare_owed=True)(record, 0) is (UNCHANGED if spared else None)
    assert forgetting("j1")(record, 0) is None


def test_a_window_key_released_by_an_operator_owes_nothing() -> None:
    record = Record("j1", "task", KeyKind.WINDOW, arguments="new", owed="j9")
    assert forgetting("j1", spare_owed=True)(record, 0) is None


def test_a_record_past_its_expiry_is_gone() -> None:
    assert not Record("job", "task", KeyKind.ACTIVE, expires_at=100).alive(5_000)


@pytest.mark.parametrize(
    ("handed_from", "begun", "owed"),
    [(None, RunBegun(arguments="new"), None), ("j0", RunBegun(), "j9")],
)
def test_a_start_is_the_run_its_duplicates_are_owed_unless_that_came_with_the_key(
    handed_from: str | None, begun: RunBegun, owed: str | None
) -> None:
    """A run owed to the duplicates of the job that handed the key over follows this run,
    which keeps its own arguments."""
    record = _held(
        on_duplicate=OnDuplicate.LATEST, owed="j9", arguments="new", handed_from=handed_from
    )
    changed, found = _begin(record, "j1", _start(follows_duplicates=True), 0)
    assert found == begun
    assert isinstance(changed, Record)
    assert (changed.run, changed.owed) == ("r1", owed)


def test_a_new_window_of_a_handoff_names_the_job_taking_the_key() -> None:
    claim = dataclasses.replace(_windowed("j2"), handoff_from="j1")
    decision, writes = _decide_one(claim, {ACTIVE_KEY: _held("j1", run="r1")})
    assert (decision.verdict, decision.job_id) == (Verdict.CREATED, "j2")
    window, hold = writes[WINDOW_KEY], writes[ACTIVE_KEY]
    assert window is not None
    assert hold is not None
    assert (window.job_id, hold.job_id, hold.handed_from) == ("j2", "j2", "j1")


@pytest.mark.parametrize(
    "fields",
    [
        {"on_duplicate": OnDuplicate.REUSE},
        {"finished": True},
        {"scope": Scope.QUEUED},
        {"kind": KeyKind.WINDOW},
    ],
)
def test_a_duplicate_leaves_alone_a_holder_that_does_not_follow_duplicates(
    fields: dict[str, object],
) -> None:
    values: dict[str, object] = {"on_duplicate": OnDuplicate.LATEST, "run": "r1", **fields}
    held = dataclasses.replace(_held(), **values)  # type: ignore[arg-type]
    active = ActiveClaim(ACTIVE_KEY, Scope.ACTIVE, None, OnDuplicate.LATEST, arguments="new")
    decision, writes = _decide_one(Claim("j2", "task", active=active), {ACTIVE_KEY: held})
    assert (decision.verdict, decision.job_id, decision.effect, writes) == (
        Verdict.REUSED_ACTIVE,
        "j1",
        None,
        {},
    )


@pytest.mark.parametrize(
    ("fields", "owed"), [({"run": "r1"}, "j2"), ({"owed": "j9", "handed_from": "j0"}, "j9")]
)
def test_a_duplicate_of_a_running_job_is_owed_one_run_after_it(
    fields: dict[str, Any], owed: str
) -> None:
    """A job that took over a run owed after the job that handed it the key runs first
    too: the run owed follows it."""
    held = _held(on_duplicate=OnDuplicate.DEBOUNCE, due=1_000, **fields)
    decision, writes = _decide_one(_debounced(1_000), {ACTIVE_KEY: held}, 500)
    assert decision.effect is Effect.RERUN_REQUESTED
    assert writes[ACTIVE_KEY] == dataclasses.replace(held, owed=owed, arguments="new")


@pytest.mark.parametrize(
    ("claimed", "holding"),
    [(OnDuplicate.DEBOUNCE, OnDuplicate.LATEST), (OnDuplicate.LATEST, OnDuplicate.DEBOUNCE)],
)
def test_only_a_debounced_duplicate_of_a_debounced_job_moves_its_start(
    claimed: OnDuplicate, holding: OnDuplicate
) -> None:
    held = _held(on_duplicate=holding, due=1_000)
    active = ActiveClaim(
        ACTIVE_KEY, Scope.ACTIVE, None, claimed, arguments="new", debounce_ms=1_000
    )
    decision, writes = _decide_one(Claim("j2", "task", active=active), {ACTIVE_KEY: held}, 500)
    assert (decision.effect, decision.starts_at_ms) == (Effect.ARGUMENTS_REPLACED, None)
    assert writes[ACTIVE_KEY] == dataclasses.replace(held, arguments="new")


def test_a_rollback_of_a_handoff_gives_the_key_back_and_forgets_the_window() -> None:
    claim = dataclasses.replace(_windowed("j2"), handoff_from="j1")
    given_back = rolling_back(claim, ACTIVE_KEY)(_held("j2", handed_from="j1"), 0)
    assert isinstance(given_back, Record)
    assert (given_back.job_id, given_back.handed_from) == ("j1", None)
    assert rolling_back(claim, WINDOW_KEY)(_remembered("j2"), 0) is None


@pytest.mark.parametrize("job_id", ["j1", "j2"])
def test_a_start_on_an_expired_hold_holds_the_key_afresh(job_id: str) -> None:
    record = _held(job_id, run="r0", alive_until=5_000, expires_at=1_000, owed="j9")
    changed, begun = _begin(record, "j1", _start(lease_ms=2_000), 1_000)
    assert begun == RunBegun()
    assert changed == Record(
        "j1",
        "task",
        KeyKind.ACTIVE,
        Scope.ACTIVE,
        expires_at=3_000,
        since=1_000,
        run="r1",
    )


def test_a_release_of_an_expired_hold_changes_nothing() -> None:
    assert releasing("j1", 0)(_held(expires_at=1_000), 1_000) is UNCHANGED
    assert releasing("j1", 0)(None, 1_000) is UNCHANGED


@pytest.mark.parametrize(
    "fields",
    [
        {"finished": True},
        {"run": "r1"},
        {"run": HANDED_OVER_MARK + "r1"},
        {"run": "r2", "alive_until": 1_000},
    ],
)
def test_a_run_marks_its_key_only_when_unfinished_and_not_marked_by_a_live_run(
    fields: dict[str, Any],
) -> None:
    assert releasing("j1", RUNNING, "r1")(_held(**fields), 500) is UNCHANGED


@pytest.mark.parametrize("fields", [{}, {"run": "r2", "alive_until": 500}])
def test_a_run_marks_its_jobs_key(fields: dict[str, Any]) -> None:
    marked = releasing("j1", RUNNING, "r1")(_held(**fields), 500)
    assert isinstance(marked, Record)
    assert (marked.run, marked.alive_until) == ("r1", None)


@pytest.mark.parametrize(
    "record",
    [
        Record("j1", "task", KeyKind.WINDOW, expires_at=1_000),
        Record("j1", "task", KeyKind.ACTIVE, Scope.EXISTS, finished=True, expires_at=1_000),
    ],
)
def test_a_renewal_leaves_a_window_and_a_finished_job_to_their_time(record: Record) -> None:
    assert renewing(Hold("j1", ACTIVE_KEY), 5_000)(record, 500) is UNCHANGED


@pytest.mark.parametrize("job_id", ["j0", "j2"])
def test_an_operator_release_naming_a_job_leaves_another_jobs_hold(job_id: str) -> None:
    assert forgetting(job_id)(_held("j1"), 0) is UNCHANGED
    assert forgetting(_copy("j1"))(_held("j1"), 0) is None


def test_an_operator_release_of_an_expired_hold_changes_nothing() -> None:
    for job_id in ("j1", None):
        assert forgetting(job_id)(_held(expires_at=1_000), 1_000) is UNCHANGED
        assert forgetting(job_id)(None, 1_000) is UNCHANGED


@pytest.mark.parametrize(
    ("note", "generation", "released"),
    [
        (Record("j1", "task", KeyKind.ACTIVE, expires_at=1_000, generation="g1"), "g1", True),
        (Record("j1", "task", KeyKind.ACTIVE, expires_at=1_000, generation="g1"), None, True),
        (Record("j1", "task", KeyKind.ACTIVE, expires_at=1_000, generation="g1"), "g2", False),
        (Record("j1", "task", KeyKind.ACTIVE, expires_at=500, generation="g1"), "g1", False),
        (None, "g1", False),
    ],
)
def test_a_release_note_releases_the_dispatch_it_names_while_it_lives(
    note: Record | None, generation: str | None, released: bool
) -> None:
    found = [not released]
    assert reading_note(generation, found)(note, 500) is UNCHANGED
    assert found == [released]


@pytest.mark.parametrize(
    ("on_duplicate", "owed"), [(OnDuplicate.LATEST, "j9"), (OnDuplicate.REUSE, None)]
)
def test_a_handoff_carries_the_run_owed_only_to_a_job_that_follows_duplicates(
    on_duplicate: OnDuplicate, owed: str | None
) -> None:
    claim = Claim(
        "j2",
        "task",
        active=ActiveClaim(ACTIVE_KEY, Scope.ACTIVE, None, on_duplicate),
        handoff_from="j1",
    )
    held = _held(run="r1", on_duplicate=OnDuplicate.LATEST, owed="j9", arguments="new")
    _, writes = _decide_one(claim, {ACTIVE_KEY: held})
    taken = writes[ACTIVE_KEY]
    assert taken is not None
    assert (taken.job_id, taken.owed, taken.arguments) == ("j2", owed, owed and "new")


def test_a_run_that_ended_while_its_job_goes_on_only_unmarks_the_key() -> None:
    record = _held(run="r1", alive_until=1_000)
    unmarked = releasing("j1", GOES_ON, "r1")(record, 500)
    assert unmarked == dataclasses.replace(record, run=None, alive_until=None)
    assert releasing("j1", GOES_ON, "r1")(_held(), 500) is UNCHANGED
