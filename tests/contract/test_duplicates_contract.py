"""The store contract for ``unique_on_duplicate`` ("latest", "debounce"), held against every store.

A duplicate that meets an unstarted job leaves its arguments (and, for
debounce, a later start); one that meets a running job owes one run, handed
the key when the job ends (``pass_on``). Arguments are opaque to stores.
"""

from __future__ import annotations

import time

import pytest

from celery_unique.stores.base import (
    ActiveClaim,
    Claim,
    Effect,
    FollowUp,
    OnDuplicate,
    Release,
    RunStart,
    Scope,
    Store,
    Verdict,
)

A = "unique:v1:{ns}:a:tasks.reindex\x1fcustomer:42"
LONG = 60_000
#: A store's clock read as ms since the epoch may round the other way than this host's.
CLOCK_SLACK_MS = 1


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def claim(
    job: str,
    arguments: str,
    policy: OnDuplicate = OnDuplicate.LATEST,
    scope: Scope = Scope.ACTIVE,
    debounce: int | None = None,
    debounce_max: int | None = None,
    task: str = "tasks.reindex",
    generation: str | None = None,
) -> Claim:
    return Claim(
        job,
        task,
        ActiveClaim(A, scope, LONG, policy, arguments, debounce, debounce_max, generation),
    )


def begin(store: Store, job: str, run: str):
    return store.begin_run(
        job, A, RunStart(run, Scope.ACTIVE, "tasks.reindex", LONG, follows_duplicates=True)
    )


def test_a_duplicate_of_an_unstarted_job_leaves_its_arguments_for_the_run(store: Store) -> None:
    assert store.decide([claim("j1", "args-1")])[0].verdict is Verdict.CREATED
    reused = store.decide([claim("d1", "args-2")])[0]
    assert (reused.verdict, reused.job_id, reused.effect) == (
        Verdict.REUSED_ACTIVE,
        "j1",
        Effect.ARGUMENTS_REPLACED,
    )
    store.decide([claim("d2", "args-3")])
    begun = begin(store, "j1", "r1")
    assert (begun.holder, begun.arguments, begun.wait_ms) == (None, "args-3", None)
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.run, held.owed) == ("j1", "r1", None)


def test_duplicates_of_a_running_job_owe_exactly_one_run_with_the_last_arguments(
    store: Store,
) -> None:
    store.decide([claim("j1", "args-1")])
    begin(store, "j1", "r1")
    for number in range(2, 6):
        decision = store.decide([claim(f"d{number}", f"args-{number}")])[0]
        assert (decision.job_id, decision.effect) == ("j1", Effect.RERUN_REQUESTED)
    held = store.get(A)
    assert held is not None
    assert (held.owed, held.arguments) == ("d2", "args-5")

    assert store.pass_on("j1", A, "r1", LONG) == FollowUp("d2", "args-5", "tasks.reindex")
    # Asked again (its answer lost): the same run, not another.
    assert store.pass_on("j1", A, "r1", LONG) == FollowUp("d2", "args-5", "tasks.reindex")
    # Asked by another delivery of j1 (a copy the broker delivered again): nothing,
    # or the owed run would be published twice.
    assert store.pass_on("j1", A, "r1-copy", LONG) is None
    # The job's own release finds the key moved on.
    assert store.release_many([Release("j1", A, 0, "r1")]) == [False]
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.run, held.owed) == ("d2", None, None)

    begun = begin(store, "d2", "r2")
    assert (begun.holder, begun.arguments) == (None, "args-5")
    assert store.pass_on("d2", A, "r2", LONG) is None  # nothing owed any more
    assert store.pass_on("j1", A, "r1", LONG) is None  # the follow-up started: j1 is done
    assert store.release_many([Release("d2", A, 0, "r2")]) == [True]
    assert store.get(A) is None


def test_a_duplicate_while_the_follow_up_waits_gives_it_newer_arguments(store: Store) -> None:
    store.decide([claim("j1", "args-1")])
    begin(store, "j1", "r1")
    store.decide([claim("d1", "args-2")])
    assert store.pass_on("j1", A, "r1", LONG) == FollowUp("d1", "args-2", "tasks.reindex")
    decision = store.decide([claim("d2", "args-3")])[0]
    assert (decision.job_id, decision.effect) == ("d1", Effect.ARGUMENTS_REPLACED)
    assert begin(store, "d1", "r2").arguments == "args-3"


def test_no_run_owed_or_another_delivery_running_passes_nothing_on(store: Store) -> None:
    store.decide([claim("j1", "args-1")])
    begin(store, "j1", "r1")
    assert store.pass_on("j1", A, "r1", LONG) is None
    begin(store, "j1", "r9")  # a second delivery of j1 runs now
    store.decide([claim("d1", "args-2")])
    assert store.pass_on("j1", A, "r1", LONG) is None
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.run, held.owed) == ("j1", "r9", "d1")


def test_a_run_that_starts_after_the_duplicate_is_the_run_it_was_owed(store: Store) -> None:
    """A retry (or a delivery again) starts with the latest arguments: nothing more is owed."""
    store.decide([claim("j1", "args-1")])
    begin(store, "j1", "r1")
    store.decide([claim("d1", "args-2")])
    store.release_many([Release("j1", A, -1, "r1")])  # the run retries: it goes on
    begun = begin(store, "j1", "r2")
    assert begun.arguments == "args-2"
    held = store.get(A)
    assert held is not None
    assert held.owed is None
    assert store.pass_on("j1", A, "r2", LONG) is None


def test_only_a_debounced_job_is_postponed_and_its_cap_bounds_its_lease(store: Store) -> None:
    store.decide([claim("j1", "args-1")])  # latest: no planned start to move
    plain = store.decide([claim("d1", "args-2", OnDuplicate.DEBOUNCE, debounce=400)])[0]
    assert (plain.effect, plain.starts_at_ms) == (Effect.ARGUMENTS_REPLACED, None)
    B = A + "-b"
    debounced = Claim(
        "j2",
        "tasks.reindex",
        ActiveClaim(B, Scope.ACTIVE, 1_000, OnDuplicate.DEBOUNCE, "a", 300, 500),
    )
    store.decide([debounced])
    expiry = store.get(B).expires_in_ms  # type: ignore[union-attr]
    again = Claim(
        "d2",
        "tasks.reindex",
        ActiveClaim(B, Scope.ACTIVE, 60_000, OnDuplicate.DEBOUNCE, "b", 300, 500),
    )
    assert store.decide([again])[0].effect is Effect.POSTPONED
    held = store.get(B)
    assert held is not None
    assert held.expires_in_ms is not None
    assert expiry is not None
    assert held.expires_in_ms <= expiry  # capped: the duplicate's longer lease is not taken


def test_an_uncapped_debounce_takes_the_longer_lease_of_its_duplicate(store: Store) -> None:
    """Without a cap nothing bounds the planned start, so the hold lasts at least the
    latest duplicate's lease past it: the job is not lost while its start moves on."""
    debounced = Claim(
        "j1",
        "tasks.reindex",
        ActiveClaim(A, Scope.ACTIVE, 1_000, OnDuplicate.DEBOUNCE, "a", 300),
    )
    store.decide([debounced])
    again = Claim(
        "d1",
        "tasks.reindex",
        ActiveClaim(A, Scope.ACTIVE, LONG, OnDuplicate.DEBOUNCE, "b", 300),
    )
    assert store.decide([again])[0].effect is Effect.POSTPONED
    held = store.get(A)
    assert held is not None
    assert held.expires_in_ms is not None
    assert held.expires_in_ms > LONG - 5_000


def test_a_follow_up_that_could_not_be_published_gives_the_key_back(store: Store) -> None:
    store.decide([claim("j1", "args-1")])
    begin(store, "j1", "r1")
    store.decide([claim("d1", "args-2")])
    assert store.pass_on("j1", A, "r1", LONG) == FollowUp("d1", "args-2", "tasks.reindex")
    store.rollback(
        Claim("d1", "tasks.reindex", ActiveClaim(A, Scope.ACTIVE, None), handoff_from="j1")
    )
    held = store.get(A)
    assert held is not None
    assert held.job_id == "j1"
    assert store.release_many([Release("j1", A, 0, "r1")]) == [True]
    assert store.get(A) is None


def test_undoing_a_lost_decision_leaves_the_run_owed_under_its_id(store: Store) -> None:
    """A duplicate's decision owed it a run, and its answer was lost: the dispatch undoes
    what it may have created, late (the store was away). Meanwhile the running job
    ended and handed the key to the run owed under that duplicate's id: the undo must
    leave it, or the published run finds its key gone (or taken) and never runs."""
    store.decide([claim("j1", "args-1", generation="g1")])
    begin(store, "j1", "r1")
    lost = claim("d1", "args-2", generation="g2")
    assert store.decide([lost])[0].effect is Effect.RERUN_REQUESTED
    assert store.pass_on("j1", A, "r1", LONG) == FollowUp("d1", "args-2", "tasks.reindex")
    store.rollback_many([lost])
    held = store.get(A)
    assert held is not None
    assert held.job_id == "d1"
    assert begin(store, "d1", "r2").holder is None
    store.rollback_many([lost])  # repeated, as an undo is, once the run started
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.run) == ("d1", "r2")
    # Had the decision created the key instead, the same undo frees it.
    assert store.release_many([Release("d1", A, 0, "r2", generation="g1")]) == [True]
    assert store.decide([lost])[0].verdict is Verdict.CREATED
    store.rollback_many([lost])
    assert store.get(A) is None


def test_debounce_plans_the_start_and_each_duplicate_moves_it_up_to_the_cap(store: Store) -> None:
    # Timings with slack for a loaded database server: each step below may take
    # a few hundred milliseconds, and the planned start must not pass meanwhile.
    before = now_ms()
    created = store.decide(
        [claim("j1", "args-1", OnDuplicate.DEBOUNCE, debounce=1200, debounce_max=1800)]
    )[0]
    assert created.verdict is Verdict.CREATED
    assert created.starts_at_ms is not None
    assert (
        before + 1200 - CLOCK_SLACK_MS <= created.starts_at_ms <= now_ms() + 1200 + CLOCK_SLACK_MS
    )
    early = begin(store, "j1", "r0")
    assert early.wait_ms is not None
    assert 0 < early.wait_ms <= 1200
    # The time left until the planned start, on the store's clock.
    assert early.wait_ms >= 1200 - (now_ms() - before) - CLOCK_SLACK_MS
    assert store.get(A).run is None  # type: ignore[union-attr]  # not marked: it did not run

    time.sleep(0.9)
    moved = store.decide([claim("d1", "args-2", OnDuplicate.DEBOUNCE, debounce=1200)])[0]
    assert moved.effect is Effect.POSTPONED
    # 1200 ms after the duplicate would be 2100 ms after the first dispatch: capped at 1800.
    assert moved.starts_at_ms is not None
    starts_in = moved.starts_at_ms - now_ms()
    assert 0 < starts_in <= 900 + CLOCK_SLACK_MS
    held = store.get(A)
    assert held is not None
    assert isinstance(held.starts_in_ms, int)  # whole milliseconds, as explain shows them
    assert held.starts_in_ms <= 900

    time.sleep(starts_in / 1000 + 0.05)
    begun = begin(store, "j1", "r1")
    assert (begun.wait_ms, begun.arguments) == (None, "args-2")
    held = store.get(A)
    assert held is not None
    assert (held.run, held.starts_in_ms) == ("r1", None)
    running = store.decide([claim("d2", "args-3", OnDuplicate.DEBOUNCE, debounce=400)])[0]
    assert running.effect is Effect.RERUN_REQUESTED


def test_in_batch_duplicates_follow_in_order(store: Store) -> None:
    decisions = store.decide([claim("j1", "args-1"), claim("d1", "args-2"), claim("d2", "args-3")])
    assert [d.verdict for d in decisions] == [Verdict.CREATED, *[Verdict.REUSED_ACTIVE] * 2]
    assert [d.effect for d in decisions] == [None, *[Effect.ARGUMENTS_REPLACED] * 2]
    assert begin(store, "j1", "r1").arguments == "args-3"


def test_plain_duplicates_around_a_following_one_in_a_batch(store: Store) -> None:
    """A plain reuse asks only who holds the key; the duplicate after it still follows the
    whole hold, and the one after that sees what it left."""
    store.decide([claim("j1", "args-1")])
    plain = [Claim(job, "tasks.reindex", ActiveClaim(A, Scope.ACTIVE, LONG)) for job in "pq"]
    decisions = store.decide([plain[0], claim("d1", "args-2"), plain[1]])
    assert [(d.verdict, d.job_id, d.effect) for d in decisions] == [
        (Verdict.REUSED_ACTIVE, "j1", None),
        (Verdict.REUSED_ACTIVE, "j1", Effect.ARGUMENTS_REPLACED),
        (Verdict.REUSED_ACTIVE, "j1", None),
    ]
    assert begin(store, "j1", "r1").arguments == "args-2"


def test_a_job_whose_dispatch_did_not_choose_to_follow_is_never_owed_a_run(store: Store) -> None:
    """Its worker will not pass its key on: a duplicate asking for more is a plain reuse."""
    store.decide([claim("j1", "args-1", OnDuplicate.REUSE)])
    queued = store.decide([claim("d1", "args-2")])[0]
    assert (queued.job_id, queued.effect) == ("j1", None)
    begin(store, "j1", "r1")
    running = store.decide([claim("d2", "args-3")])[0]
    assert (running.job_id, running.effect) == ("j1", None)
    held = store.get(A)
    assert held is not None
    assert (held.owed, held.arguments) == (None, None)
    assert store.pass_on("j1", A, "r1", LONG) is None


def test_only_an_unfinished_hold_of_the_same_task_follows(store: Store) -> None:
    # reuse: nothing stored.
    store.decide([claim("j1", "args-1")])
    plain = store.decide([claim("d1", "args-2", OnDuplicate.REUSE)])[0]
    assert plain.effect is None
    # another task sharing the key never hands its arguments to this job.
    other = store.decide([claim("d2", "args-3", task="tasks.other")])[0]
    assert (other.job_id, other.effect) == ("j1", None)
    assert begin(store, "j1", "r1").arguments is None
    # a finished (retained) job is reused as it is.
    store.release_many([Release("j1", A, LONG, "r1")])
    finished = store.decide([claim("d3", "args-4", scope=Scope.EXISTS)])[0]
    assert (finished.job_id, finished.effect) == ("j1", None)


def test_a_duplicate_after_the_run_ended_is_owed_the_run_the_end_of_the_hold_hands_over(
    store: Store,
) -> None:
    """The run's mark stays until the hold ends: a duplicate between the first hand-over
    step (nothing owed yet) and the end of the hold owes the run that end hands over."""
    store.decide([claim("j1", "args-1")])
    begin(store, "j1", "r1")
    assert store.pass_on("j1", A, "r1", LONG) is None  # nothing owed when the run ended
    late = store.decide([claim("d1", "args-2")])[0]
    assert (late.job_id, late.effect) == ("j1", Effect.RERUN_REQUESTED)
    assert store.pass_on_or_release("j1", A, "r1", LONG, 0) == FollowUp(
        "d1", "args-2", "tasks.reindex"
    )
    # Asked again (its answer lost): the same run; a copy of j1 gets nothing.
    assert store.pass_on_or_release("j1", A, "r1", LONG, 0) == FollowUp(
        "d1", "args-2", "tasks.reindex"
    )
    assert store.pass_on_or_release("j1", A, "r1-copy", LONG, 0) is False
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.run, held.owed) == ("d1", None, None)
    assert begin(store, "d1", "r2").arguments == "args-2"


@pytest.mark.parametrize(("scope", "kept"), [(Scope.ACTIVE, False), (Scope.EXISTS, True)])
def test_the_end_of_a_hold_that_owes_nothing_releases_it_as_its_scope_says(
    store: Store, scope: Scope, kept: bool
) -> None:
    store.decide([claim("j1", "args-1", scope=scope)])
    store.begin_run("j1", A, RunStart("r1", scope, "tasks.reindex", LONG, follows_duplicates=True))
    keep = LONG if kept else 0
    assert store.pass_on_or_release("j1", A, "r1", LONG, keep) is True
    assert store.pass_on_or_release("j1", A, "r1", LONG, keep) is False  # once
    held = store.get(A)
    if kept:
        assert held is not None
        assert (held.job_id, held.finished, held.run) == ("j1", True, None)
        after = store.decide([claim("d1", "args-2", scope=scope)])[0]
        assert (after.job_id, after.effect) == ("j1", None)  # finished: reused as it is
    else:
        assert held is None
        assert store.decide([claim("d1", "args-2")])[0].verdict is Verdict.CREATED


def test_a_successor_the_running_job_hands_its_key_to_keeps_the_run_owed(store: Store) -> None:
    """Self-rescheduling: the run owed to a duplicate goes with the key to the successor,
    which runs with its own arguments; the owed run follows it, with the latest ones."""
    store.decide([claim("j1", "args-1")])
    begin(store, "j1", "r1")
    assert store.decide([claim("d1", "args-2")])[0].effect is Effect.RERUN_REQUESTED
    successor = Claim(
        "k1",
        "tasks.reindex",
        ActiveClaim(A, Scope.ACTIVE, LONG, OnDuplicate.LATEST, "next-page"),
        handoff_from="j1",
    )
    assert store.decide([successor])[0].verdict is Verdict.CREATED
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.owed, held.arguments) == ("k1", "d1", "args-2")
    # A duplicate while the successor waits adds to the run owed after it.
    waiting = store.decide([claim("d2", "args-3")])[0]
    assert (waiting.job_id, waiting.effect) == ("k1", Effect.RERUN_REQUESTED)
    assert begin(store, "k1", "r2").arguments is None  # its own arguments
    # The job that handed its key over ends: nothing of the key is its to pass on.
    assert store.pass_on_or_release("j1", A, "r1", LONG, 0) is False
    assert store.pass_on_or_release("k1", A, "r2", LONG, 0) == FollowUp(
        "d1", "args-3", "tasks.reindex"
    )
    assert begin(store, "d1", "r3").arguments == "args-3"


#: Job ids a caller may choose that look like what a store might use as a marker.
ODD_IDS = ["<d1", "<", "^d1", "-", "+", "v", "d1<j1", "\u00e9<\u2603"]


@pytest.mark.parametrize("owed", ODD_IDS)
def test_any_job_id_is_owed_and_handed_its_run_exactly(store: Store, owed: str) -> None:
    store.decide([claim("j1", "args-1")])
    begin(store, "j1", "r1")
    assert store.decide([claim(owed, "args-2")])[0].effect is Effect.RERUN_REQUESTED
    held = store.get(A)
    assert held is not None
    assert held.owed == owed
    assert store.pass_on("j1", A, "r1", LONG) == FollowUp(owed, "args-2", "tasks.reindex")
    assert store.pass_on("j1", A, "r1", LONG) == FollowUp(owed, "args-2", "tasks.reindex")
    assert store.pass_on("j1", A, "r1-copy", LONG) is None
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.owed) == (owed, None)
    begun = begin(store, owed, "r2")
    assert (begun.holder, begun.arguments) == (None, "args-2")
    assert store.pass_on("j1", A, "r1", LONG) is None  # the owed run started


@pytest.mark.parametrize("holder", ODD_IDS)
def test_any_job_id_passes_its_key_on_exactly(store: Store, holder: str) -> None:
    store.decide([claim(holder, "args-1")])
    begin(store, holder, "r1")
    store.decide([claim("d1", "args-2")])
    assert store.pass_on(holder, A, "r1", LONG) == FollowUp("d1", "args-2", "tasks.reindex")
    assert store.pass_on(holder, A, "r1", LONG) == FollowUp("d1", "args-2", "tasks.reindex")
    assert begin(store, holder, "r9").holder == "d1"  # a copy of it is stale


def test_debounce_planned_starts_never_go_back_and_stop_exactly_at_the_cap(store: Store) -> None:
    created = store.decide(
        [claim("j1", "a0", OnDuplicate.DEBOUNCE, debounce=100, debounce_max=300)]
    )[0]
    assert created.starts_at_ms is not None
    cap = created.starts_at_ms - 100 + 300
    planned = [created.starts_at_ms]
    deadline = time.monotonic() + 10
    while planned.count(cap) < 3 and time.monotonic() < deadline:
        moved = store.decide(
            [claim("d", "a", OnDuplicate.DEBOUNCE, debounce=100, debounce_max=300)]
        )[0]
        assert moved.effect is Effect.POSTPONED
        assert moved.starts_at_ms is not None
        planned.append(moved.starts_at_ms)
        time.sleep(0.01)
    assert planned == sorted(planned)
    # Every capped receipt names the cap, to the millisecond.
    assert planned[-3:] == [cap] * 3


def test_a_debounced_start_planned_later_is_never_moved_earlier(store: Store) -> None:
    """A job published with a countdown longer than its debounce starts no sooner: a
    duplicate with the plain debounce is told that start, not one before it."""
    created = store.decide(
        [claim("j1", "a0", OnDuplicate.DEBOUNCE, debounce=5_000, debounce_max=8_000)]
    )[0]
    duplicate = store.decide(
        [claim("d1", "a1", OnDuplicate.DEBOUNCE, debounce=3_000, debounce_max=8_000)]
    )[0]
    assert duplicate.effect is Effect.POSTPONED
    assert duplicate.starts_at_ms == created.starts_at_ms


def test_an_operator_release_spares_what_duplicates_left_unless_told_to_drop_it(
    store: Store,
) -> None:
    """While a latest key holds a duplicate's arguments (the job's next run, the first or
    one after a retry or a requeue, starts with them) or a run owed, it is kept when asked
    to spare that; a job no duplicate met is released; asked not to spare, any is."""
    store.decide([claim("j0", "args-0")])
    begin(store, "j0", "r0")
    assert store.delete(A, job_id="j0", spare_owed=True) is True  # nothing left it

    store.decide([claim("j1", "args-1")])
    store.decide([claim("d1", "args-2")])
    assert store.delete(A, job_id="j1", spare_owed=True) is False
    assert begin(store, "j1", "r1").arguments == "args-2"  # still there, and used
    assert store.delete(A, job_id="j1", spare_owed=True) is False  # a requeue needs them
    assert begin(store, "j1", "r1b").arguments == "args-2"
    assert store.release_many([Release("j1", A, 0, "r1b")]) == [True]

    store.decide([claim("j2", "args-3")])
    begin(store, "j2", "r2")
    assert store.decide([claim("d2", "args-4")])[0].effect is Effect.RERUN_REQUESTED
    assert store.delete(A, job_id="j2", spare_owed=True) is False
    assert store.pass_on("j2", A, "r2", LONG) == FollowUp("d2", "args-4", "tasks.reindex")

    store.decide([claim("j3", "args-5")])  # the owed run d2 holds it, not started
    assert store.delete(A, job_id="d2", spare_owed=True) is False
    assert store.delete(A, job_id="d2") is True
    assert store.get(A) is None


def test_a_reuse_key_is_released_whether_or_not_asked_to_spare(store: Store) -> None:
    store.decide([claim("j1", "args-1", policy=OnDuplicate.REUSE)])
    assert store.delete(A, job_id="j1", spare_owed=True) is True
