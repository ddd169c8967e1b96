"""The store contract (celery_unique.stores.base.Store), held against every store."""

from __future__ import annotations

import time

from celery_unique.keys import keyspace
from celery_unique.stores.base import (
    GOES_ON,
    HAND_OVER_UNDONE,
    HANDING_OVER,
    RUNNING,
    ActiveClaim,
    Claim,
    Hold,
    KeyKind,
    Release,
    RunBegun,
    RunStart,
    Scope,
    Store,
    Verdict,
    WindowClaim,
)

A = "unique:v1:{ns}:a:tasks.recalc\x1ftenant:7"
B = "unique:v1:{ns}:a:tasks.recalc\x1ftenant:8"
W = "unique:v1:{ns}:w:tasks.order\x1freq-1"
LONG = 60_000


def active(
    job: str,
    key: str = A,
    scope: Scope = Scope.QUEUED,
    lease: int | None = LONG,
    handoff: str | None = None,
) -> Claim:
    return Claim(
        job_id=job, task="tasks.recalc", active=ActiveClaim(key, scope, lease), handoff_from=handoff
    )


def windowed(
    job: str,
    fp: str = "fp1",
    policy: str = "p1",
    ms: int = LONG,
    key: str = W,
    with_active: str | None = None,
) -> Claim:
    return Claim(
        job_id=job,
        task="tasks.order",
        window=WindowClaim(key, ms, fp, policy),
        active=ActiveClaim(with_active, Scope.ACTIVE, LONG) if with_active else None,
    )


def decide(store: Store, claim: Claim):
    return store.decide([claim])[0]


def test_first_claim_creates_and_second_reuses(store: Store) -> None:
    """A held active key hands later dispatches the first job's id."""
    assert decide(store, active("j1")).verdict is Verdict.CREATED
    second = decide(store, active("j2"))
    assert (second.verdict, second.job_id) == (Verdict.REUSED_ACTIVE, "j1")


def test_same_job_id_again_is_a_reuse(store: Store) -> None:
    """A claim under the id that already holds a key is that job again: reused, never resent."""
    decide(store, active("j1"))
    again = decide(store, active("j1"))
    assert (again.verdict, again.job_id) == (Verdict.REUSED_ACTIVE, "j1")
    decide(store, windowed("w1"))
    again = decide(store, windowed("w1"))
    assert (again.verdict, again.job_id) == (Verdict.REUSED_WINDOW, "w1")


def test_release_frees_the_key(store: Store) -> None:
    """After release the next claim creates a new job."""
    decide(store, active("j1"))
    assert store.release("j1", A) is True
    assert store.get(A) is None
    assert decide(store, active("j2")).verdict is Verdict.CREATED


def test_release_by_another_job_changes_nothing(store: Store) -> None:
    """Release is compare-and-delete: a stale job cannot free a newer job's key."""
    decide(store, active("j1"))
    assert store.release("j0", A) is False
    held = store.get(A)
    assert held is not None
    assert held.job_id == "j1"


def test_release_is_idempotent(store: Store) -> None:
    """Releasing twice (two signals, two processes) is harmless."""
    decide(store, active("j1"))
    assert store.release("j1", A) is True
    assert store.release("j1", A) is False


def test_retention_keeps_a_finished_key_then_forgets_it(store: Store) -> None:
    """An exists-scope key outlives its job by the retention, then frees itself."""
    decide(store, active("j1", scope=Scope.EXISTS))
    assert store.release("j1", A, keep_ms=1_000) is True
    held = store.get(A)
    assert held is not None
    assert held.finished
    assert held.expires_in_ms is not None
    assert held.expires_in_ms <= 1_000
    assert decide(store, active("j2", scope=Scope.EXISTS)).job_id == "j1"
    time.sleep(1.2)
    assert decide(store, active("j3", scope=Scope.EXISTS)).verdict is Verdict.CREATED


def test_repeated_final_release_does_not_extend_retention(store: Store) -> None:
    """A second final signal does not push the retention further."""
    decide(store, active("j1", scope=Scope.EXISTS))
    store.release("j1", A, keep_ms=3_000)
    time.sleep(0.5)
    assert store.release("j1", A, keep_ms=3_000) is False
    held = store.get(A)
    assert held is not None
    assert held.expires_in_ms is not None
    # Extended, it would read about 3,000 ms again.
    assert held.expires_in_ms <= 2_600


def test_retention_none_keeps_the_key_without_expiry(store: Store) -> None:
    """keep_ms=None keeps the finished key until someone deletes it."""
    decide(store, active("j1", scope=Scope.EXISTS))
    store.release("j1", A, keep_ms=None)
    held = store.get(A)
    assert held is not None
    assert (held.finished, held.expires_in_ms) == (True, None)


def test_lease_expiry_frees_the_key(store: Store) -> None:
    """A key whose lease runs out without renewal is free again."""
    decide(store, active("j1", lease=600))
    assert decide(store, active("j2", lease=600)).job_id == "j1"
    time.sleep(0.8)
    assert decide(store, active("j3")).verdict is Verdict.CREATED


def test_no_lease_means_no_expiry(store: Store) -> None:
    """A claim without a lease is held until released."""
    decide(store, active("j1", lease=None))
    held = store.get(A)
    assert held is not None
    assert held.expires_in_ms is None


def test_renew_pushes_the_lease_of_the_holder_only(store: Store) -> None:
    """Renewal extends only unfinished keys the job still holds."""
    decide(store, active("j1", lease=600))
    assert store.renew("j1", [A], 5_000) == 1
    assert store.renew("j0", [A], 5_000) == 0
    time.sleep(0.8)
    assert decide(store, active("j2")).job_id == "j1"


def test_renew_never_shortens_and_skips_finished_keys(store: Store) -> None:
    """A renewal shorter than the lease left changes nothing, nor does one of a finished key."""
    decide(store, active("j1", scope=Scope.EXISTS, lease=10_000))
    assert store.renew("j1", [A], 100) == 0
    store.release("j1", A, keep_ms=10_000)
    assert store.renew("j1", [A], 50_000) == 0


def test_window_reuses_the_same_request(store: Store) -> None:
    """The same window key and fingerprint returns the first job."""
    assert decide(store, windowed("j1")).verdict is Verdict.CREATED
    again = decide(store, windowed("j2"))
    assert (again.verdict, again.job_id, again.policy_drift) == (
        Verdict.REUSED_WINDOW,
        "j1",
        False,
    )


def test_window_with_a_different_request_conflicts_and_writes_nothing(store: Store) -> None:
    """A different fingerprint is a conflict naming the existing job; the claim writes nothing."""
    decide(store, windowed("j1"))
    conflict = decide(store, windowed("j2", fp="fp2", with_active=B))
    assert conflict.verdict is Verdict.CONFLICT
    assert conflict.conflicting_job_ids == ("j1",)
    assert store.get(B) is None


def test_window_policy_difference_is_drift(store: Store) -> None:
    """Only the policy differs: reused, flagged as drift."""
    decide(store, windowed("j1", policy="p1"))
    drift = decide(store, windowed("j2", policy="p2"))
    assert (drift.verdict, drift.job_id, drift.policy_drift) == (
        Verdict.REUSED_WINDOW,
        "j1",
        True,
    )


def test_window_does_not_slide(store: Store) -> None:
    """Reuse inside the window does not extend it; after it a new job is created."""
    decide(store, windowed("j1", ms=1_000))
    time.sleep(0.6)
    assert decide(store, windowed("j2", ms=1_000)).job_id == "j1"
    time.sleep(0.6)
    assert decide(store, windowed("j3", ms=1_000)).verdict is Verdict.CREATED


def test_window_key_is_not_released(store: Store) -> None:
    """Release is for active keys; window keys are forgotten only by time."""
    decide(store, windowed("j1"))
    assert store.release("j1", W) is False
    assert decide(store, windowed("j2")).job_id == "j1"


def test_new_window_key_links_to_the_active_holder(store: Store) -> None:
    """A new window key meeting a held active key is linked to that job, beyond its end."""
    decide(store, active("x", key=B, scope=Scope.ACTIVE))
    linked = decide(store, windowed("y", with_active=B))
    assert (linked.verdict, linked.job_id) == (Verdict.REUSED_ACTIVE, "x")
    held = store.get(W)
    assert held is not None
    assert held.job_id == "x"
    store.release("x", B)
    retry = decide(store, windowed("z", with_active=B))
    assert (retry.verdict, retry.job_id) == (Verdict.REUSED_WINDOW, "x")


def test_window_and_active_key_on_different_jobs_conflict(store: Store) -> None:
    """Window key -> X while the active key is held by Y: composition conflict, nothing written."""
    decide(store, windowed("x"))
    decide(store, active("y", key=B, scope=Scope.ACTIVE))
    clash = decide(store, windowed("z", with_active=B))
    assert clash.verdict is Verdict.COMPOSITION_CONFLICT
    assert clash.conflicting_job_ids == ("x", "y")
    held = store.get(B)
    assert held is not None
    assert held.job_id == "y"


def test_both_keys_new_create_one_job(store: Store) -> None:
    """Neither key known: a new job, both keys set."""
    created = decide(store, windowed("j1", with_active=B))
    assert created.verdict is Verdict.CREATED
    assert {store.get(W).job_id, store.get(B).job_id} == {"j1"}  # type: ignore[union-attr]


def test_batch_items_see_earlier_items(store: Store) -> None:
    """Within a batch, a later item matching an earlier one reuses the earlier item's job."""
    decisions = store.decide([active("j1"), active("j2"), active("j3", key=B)])
    assert [(d.verdict, d.job_id) for d in decisions] == [
        (Verdict.CREATED, "j1"),
        (Verdict.REUSED_ACTIVE, "j1"),
        (Verdict.CREATED, "j3"),
    ]


def test_batch_with_a_conflict_writes_nothing(store: Store) -> None:
    """All or nothing: one conflicting item and no item's key is written."""
    decide(store, windowed("old"))
    decisions = store.decide([active("j1"), windowed("j2", fp="other")])
    assert decisions[1].verdict is Verdict.CONFLICT
    assert store.get(A) is None


def test_batch_continue_on_conflict_writes_the_others(store: Store) -> None:
    """Without all-or-nothing, the conflicting item is skipped and the rest proceed."""
    decide(store, windowed("old"))
    decisions = store.decide(
        [active("j1"), windowed("j2", fp="other"), active("j3", key=B)], all_or_nothing=False
    )
    assert [d.verdict for d in decisions] == [Verdict.CREATED, Verdict.CONFLICT, Verdict.CREATED]
    assert store.get(A) is not None
    assert store.get(B) is not None


def test_rollback_frees_what_the_claim_took(store: Store) -> None:
    """A failed publish rolls back both keys of its claim."""
    claim = windowed("j1", with_active=B)
    decide(store, claim)
    store.rollback(claim)
    assert store.get(W) is None
    assert store.get(B) is None


def test_rollback_leaves_other_jobs_keys(store: Store) -> None:
    """Rolling back a claim never frees a key that points at another job."""
    decide(store, active("j1"))
    store.rollback(active("j2"))
    held = store.get(A)
    assert held is not None
    assert held.job_id == "j1"


def test_rollback_of_one_dispatch_of_a_job_id_leaves_a_later_dispatch_of_it(
    store: Store,
) -> None:
    """A caller's id dispatched again: undoing the first decision (its answer was lost,
    the undo ran late) spares the key the second one created."""
    first = Claim("j1", "tasks.recalc", ActiveClaim(A, Scope.QUEUED, LONG, generation="g1"))
    decide(store, first)
    store.rollback(first)
    assert store.get(A) is None
    second = Claim("j1", "tasks.recalc", ActiveClaim(A, Scope.QUEUED, LONG, generation="g2"))
    assert decide(store, second).verdict is Verdict.CREATED
    store.rollback(first)
    held = store.get(A)
    assert held is not None
    assert held.job_id == "j1"
    store.rollback(second)
    assert store.get(A) is None


def test_handoff_moves_the_key_to_the_successor(store: Store) -> None:
    """A running job dispatching its successor with the same key passes the key on."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    successor = decide(store, active("j2", scope=Scope.ACTIVE, handoff="j1"))
    assert (successor.verdict, successor.job_id) == (Verdict.CREATED, "j2")
    assert store.release("j1", A) is False
    held = store.get(A)
    assert held is not None
    assert held.job_id == "j2"


def test_handoff_rollback_returns_the_key(store: Store) -> None:
    """If the successor cannot be published, the key goes back to the running job."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    claim = active("j2", scope=Scope.ACTIVE, handoff="j1")
    decide(store, claim)
    store.rollback(claim)
    held = store.get(A)
    assert held is not None
    assert held.job_id == "j1"


def test_handoff_from_another_job_is_a_duplicate(store: Store) -> None:
    """Only the holder can hand a key on; anyone else is deduplicated."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    assert decide(store, active("j2", scope=Scope.ACTIVE, handoff="j9")).job_id == "j1"


def test_get_scan_delete_and_stats(store: Store) -> None:
    """Operators read keys by prefix and kind, delete them, and count them."""
    decide(store, active("j1"))
    decide(store, active("j2", key=B, scope=Scope.EXISTS))
    decide(store, windowed("j3"))
    held = store.get(A)
    assert held is not None
    assert (held.kind, held.job_id, held.task, held.scope) == (
        KeyKind.ACTIVE,
        "j1",
        "tasks.recalc",
        Scope.QUEUED,
    )
    assert {h.key for h in store.scan(kind=KeyKind.ACTIVE)} == {A, B}
    assert [h.key for h in store.scan(prefix="unique:v1:{ns}:w:")] == [W]
    stats = store.stats()
    assert (stats.active, stats.window) == (2, 1)
    assert store.delete(A, job_id="other") is False
    assert store.delete(A) is True
    assert store.get(A) is None


def test_a_claim_mixing_shared_and_task_keys_reads_back_its_task(store: Store) -> None:
    """A key shared across tasks names no task: every key of the claim reads back the
    task that wrote it (``list --task`` and the reaper's retention go by it)."""
    shared = keyspace.storage_key("ns", keyspace.ACTIVE, "", "tenant:7")
    decide(store, windowed("j1", with_active=shared))
    held = {key: store.get(key) for key in (W, shared)}
    assert {key: h and (h.job_id, h.task) for key, h in held.items()} == {
        W: ("j1", "tasks.order"),
        shared: ("j1", "tasks.order"),
    }
    assert {h.key: h.task for h in store.scan()} == {W: "tasks.order", shared: "tasks.order"}


def test_a_batch_of_more_keys_than_a_statement_binds_sees_every_held_key(store: Store) -> None:
    """However many keys a batch decides, each held one is read: none is taken twice."""
    keys = [f"unique:v1:{{ns}}:a:tasks.recalc\x1ftenant:{n}" for n in range(600)]
    store.decide([active(f"first-{n}", key=key) for n, key in enumerate(keys)])
    again = store.decide([active(f"again-{n}", key=key) for n, key in enumerate(keys)])
    assert [(d.verdict, d.job_id) for d in again] == [
        (Verdict.REUSED_ACTIVE, f"first-{n}") for n in range(len(keys))
    ]


def test_keys_are_opaque(store: Store) -> None:
    """Any valid key text round-trips: unicode, braces, glob and SQL metacharacters."""
    odd = "unique:v1:{ns}:a:t\x1fкey {x} *?[] '%_\"; DROP"
    decide(store, active("j1", key=odd))
    held = store.get(odd)
    assert held is not None
    assert held.job_id == "j1"
    assert [h.key for h in store.scan(prefix="unique:v1:{ns}:a:t\x1f")] == [odd]


def test_renew_many_renews_each_hold_for_its_own_job(store: Store) -> None:
    """One batch renewal pushes every listed hold and skips holds of other jobs."""
    decide(store, active("j1", lease=600))
    decide(store, active("j2", key=B, lease=600))
    assert store.renew_many([Hold("j1", A), Hold("j2", B), Hold("j9", A)], 5_000) == 2
    time.sleep(0.8)
    assert decide(store, active("x")).job_id == "j1"
    assert decide(store, active("y", key=B)).job_id == "j2"


#: Job ids Celery accepts that a record layout could trip over: separators of
#: every kind, a thousand bytes and more, characters outside the BMP. (Ids with
#: control characters never reach a store: dispatches refuse them with
#: ``invalid_job_id``, see ``tests/integration/test_nothing_touched.py``.)
HOSTILE_JOB_IDS = [
    "a:b{c}d%e\\f|g,h;i=j k",
    "ünïcödé-√-€-日本語",
    "\U0001f600-\U00010348-emoji-and-gothic",
    "x" * 1500,
    "é" * 600,
    "}:a:tasks.recalc",
    "' OR 1=1 --",
]


def test_hostile_job_ids_are_held_released_and_rolled_back_exactly(store: Store) -> None:
    """Every store keeps any job id without control characters exactly, through its whole life."""
    for n, job in enumerate(HOSTILE_JOB_IDS):
        key = f"{A}-{n}"
        created = decide(store, active(job, key=key))
        assert (created.verdict, created.job_id) == (Verdict.CREATED, job)
        again = decide(store, active("other", key=key))
        assert (again.verdict, again.job_id) == (Verdict.REUSED_ACTIVE, job)
        held = store.get(key)
        assert held is not None
        assert held.job_id == job
        assert [h.job_id for h in store.scan(prefix=key)] == [job]
        assert store.renew_many([Hold(job, key)], LONG * 2) == 1
        assert store.release("other", key) is False
        assert store.release_many([Release(job, key, 0)]) == [True]
        assert store.get(key) is None
        created = decide(store, active(job, key=key, handoff=None))
        store.rollback(active(job, key=key))
        assert store.get(key) is None
        window = decide(store, windowed(job, key=f"{W}-{n}"))
        assert (window.verdict, window.job_id) == (Verdict.CREATED, job)
        conflict = decide(store, windowed("other", fp="other", key=f"{W}-{n}"))
        assert (conflict.verdict, conflict.conflicting_job_ids) == (Verdict.CONFLICT, (job,))


def test_release_many_reports_each_release(store: Store) -> None:
    """Many releases in one call: each says whether it changed its key, exists keys are kept."""
    decide(store, active("j1"))
    decide(store, active("j2", key=B, scope=Scope.EXISTS))
    changed = store.release_many(
        [Release("j1", A, 0), Release("nobody", B, 0), Release("j2", B, LONG), Release("j1", A, 0)]
    )
    assert changed == [True, False, True, False]
    assert store.get(A) is None
    kept = store.get(B)
    assert kept is not None
    assert kept.finished


def test_rollback_many_undoes_only_what_each_claim_wrote(store: Store) -> None:
    """Rolling back claims frees their keys, skips keys others hold, and may be repeated."""
    first, second = active("j1"), windowed("j2", key=W)
    decide(store, first)
    decide(store, second)
    decide(store, active("j3", key=B))
    never = active("j4", key=B)
    for _ in range(2):
        store.rollback_many([first, second, never])
    assert store.get(A) is None
    assert store.get(W) is None
    held = store.get(B)
    assert held is not None
    assert held.job_id == "j3"


# -- runs: a key follows the delivery that runs its job -----------------------------


def start(store: Store, job: str, run: str, key: str = A, lease: int | None = LONG) -> str | None:
    return store.start_run(job, key, RunStart(run, Scope.ACTIVE, "tasks.recalc", lease))


def vouched_start(store: Store, job: str, run: str, alive_ms: int) -> RunBegun:
    start = RunStart(run, Scope.ACTIVE, "tasks.recalc", LONG, alive_ms=alive_ms)
    return store.begin_run(job, A, start)


def test_a_run_marks_the_key_its_job_holds(store: Store) -> None:
    decide(store, active("j1", scope=Scope.ACTIVE))
    assert start(store, "j1", "r1") is None
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.run) == ("j1", "r1")


def test_a_copy_of_a_job_whose_key_moved_on_is_told_the_holder(store: Store) -> None:
    """A delivery of j1 after j2 took the key must not run: the store names j2."""
    decide(store, active("j2", scope=Scope.ACTIVE))
    assert start(store, "j1", "r1") == "j2"
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.run) == ("j2", None)


def test_a_run_takes_a_key_nobody_holds(store: Store) -> None:
    """Its lease ran out, or another delivery of the job released it: the run holds it again."""
    assert start(store, "j1", "r1", lease=LONG) is None
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.run, held.kind, held.finished) == ("j1", "r1", KeyKind.ACTIVE, False)
    assert held.expires_in_ms is not None
    assert held.expires_in_ms > LONG - 5_000
    assert decide(store, active("j2")).job_id == "j1"


def test_a_run_of_a_finished_job_unfinishes_its_key(store: Store) -> None:
    decide(store, active("j1", scope=Scope.EXISTS))
    store.release("j1", A, keep_ms=None)
    assert start(store, "j1", "r2") is None
    held = store.get(A)
    assert held is not None
    assert not held.finished
    assert held.run == "r2"
    assert held.expires_in_ms is not None  # a lease again, not the retention


def test_the_end_of_one_delivery_leaves_the_key_to_the_one_running(store: Store) -> None:
    """Two copies of one message: the first to end must not free the key the other runs under."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    assert start(store, "j1", "r1") is None
    assert start(store, "j1", "r2") is None
    assert store.release_many([Release("j1", A, 0, "r1")]) == [False]
    assert store.release_many([Release("j1", A, 0, None)]) == [False]  # a copy that never ran
    assert store.get(A) is not None
    assert store.release_many([Release("j1", A, 0, "r2")]) == [True]
    assert store.get(A) is None


def test_a_run_that_goes_on_keeps_the_key_and_ends_its_mark(store: Store) -> None:
    decide(store, active("j1", scope=Scope.ACTIVE))
    start(store, "j1", "r1")
    assert store.release_many([Release("j1", A, GOES_ON, "r2")]) == [False]
    assert store.release_many([Release("j1", A, GOES_ON, "r1")]) == [True]
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.run, held.finished) == ("j1", None, False)
    # Once no run is marked, a message of the job that never ran may release it.
    assert store.release_many([Release("j1", A, 0, None)]) == [True]


def test_a_final_release_of_the_running_delivery_ends_its_mark(store: Store) -> None:
    decide(store, active("j1", scope=Scope.EXISTS))
    start(store, "j1", "r1")
    assert store.release_many([Release("j1", A, LONG, "r1")]) == [True]
    held = store.get(A)
    assert held is not None
    assert held.finished
    assert held.run is None


def test_a_job_that_handed_its_key_over_runs_on_without_it(store: Store) -> None:
    """Self-rescheduling: j1 gave its key to j2 while it ran; j1's retry still runs."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    decide(store, active("j2", scope=Scope.ACTIVE, handoff="j1"))
    assert start(store, "j1", "r1") is None
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.run) == ("j2", None)
    assert start(store, "j3", "r3") == "j2"


def test_a_key_handed_over_to_a_replacement_outlives_the_replaced_run(store: Store) -> None:
    """replace(): the run marks the key handed over before sending the replacement;
    whatever ends that run then (a hard time limit) leaves the key to the replacement."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    start(store, "j1", "r1")
    assert store.release_many([Release("j1", A, HANDING_OVER, "r2")]) == [False]
    assert store.release_many([Release("j1", A, HANDING_OVER, "r1")]) == [True]
    late = [
        Release("j1", A, RUNNING, "r1"),
        Release("j1", A, GOES_ON, "r1"),
        Release("j1", A, 0, "r1"),
    ]
    assert store.release_many(late) == [False, False, False]
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.run) == ("j1", "^r1")
    # The replacement starts as the job's next run, and its end frees the key.
    assert start(store, "j1", "r2") is None
    assert store.release_many([Release("j1", A, 0, "r2")]) == [True]
    assert store.get(A) is None


def test_a_replacement_dropped_unrun_frees_a_handed_over_key(store: Store) -> None:
    decide(store, active("j1", scope=Scope.ACTIVE))
    start(store, "j1", "r1")
    store.release_many([Release("j1", A, HANDING_OVER, "r1")])
    assert store.release_many([Release("j1", A, 0, None)]) == [True]  # revoked, never ran
    assert store.get(A) is None


def test_a_hand_over_undone_gives_the_key_back_to_the_run(store: Store) -> None:
    """No replacement was sent: the run's own end frees the key again."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    start(store, "j1", "r1")
    store.release_many([Release("j1", A, HANDING_OVER, "r1")])
    assert store.release_many([Release("j1", A, HAND_OVER_UNDONE, "r2")]) == [False]
    assert store.release_many([Release("j1", A, HAND_OVER_UNDONE, "r1")]) == [True]
    assert store.release_many([Release("j1", A, 0, "r1")]) == [True]
    assert store.get(A) is None


def test_a_run_keeps_the_key_until_its_own_release(store: Store) -> None:
    """The lease a run starts with is pushed like any other hold."""
    decide(store, active("j1", scope=Scope.ACTIVE, lease=200))
    start(store, "j1", "r1", lease=LONG)
    time.sleep(0.3)
    held = store.get(A)
    assert held is not None
    assert held.job_id == "j1"


def test_a_late_mark_of_a_run_replaces_an_ended_runs_mark_and_takes_nothing(store: Store) -> None:
    """The worker's own mark of a run that started (sent after the fact, in order with
    its other writes) marks a key its job holds, and nothing else."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    start(store, "j1", "r1")
    assert store.release_many([Release("j1", A, RUNNING, "r2")]) == [True]
    held = store.get(A)
    assert held is not None
    assert held.run == "r2"
    assert store.release_many([Release("j1", A, RUNNING, "r2")]) == [False]  # marked already
    assert store.release_many([Release("j1", A, 0, "r2")]) == [True]
    assert store.release_many([Release("j1", A, RUNNING, "r3")]) == [False]  # not held: no take
    assert store.get(A) is None
    decide(store, active("j2", scope=Scope.EXISTS))
    assert store.release_many([Release("j1", A, RUNNING, "r4")]) == [False]  # another job's
    store.release("j2", A, keep_ms=LONG)
    assert store.release_many([Release("j2", A, RUNNING, "r5")]) == [False]  # finished


# -- a run its worker vouches for: a copy of its message waits ------------------------


def test_a_copy_waits_while_the_run_it_copies_is_vouched_alive(store: Store) -> None:
    """A second delivery of j1 while r1 runs on a live worker is not marked: it is told how
    long r1 is vouched for, and r1's own end still frees the key."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    assert vouched_start(store, "j1", "r1", LONG) == RunBegun()
    begun = vouched_start(store, "j1", "r2", 5_000)
    assert begun.holder is None
    assert begun.busy_ms is not None
    assert LONG - 5_000 < begun.busy_ms <= LONG
    held = store.get(A)
    assert held is not None
    assert held.run == "r1"
    assert store.release_many([Release("j1", A, 0, "r2")]) == [False]  # the copy's end
    assert store.get(A) is not None
    assert store.release_many([Release("j1", A, 0, "r1")]) == [True]
    assert store.get(A) is None


def test_a_copy_takes_the_mark_of_a_run_no_longer_vouched_for(store: Store) -> None:
    """The run's worker stopped renewing (it died): once the vouching ran out, the copy runs."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    vouched_start(store, "j1", "r1", 150)
    time.sleep(0.25)
    assert vouched_start(store, "j1", "r2", 5_000) == RunBegun()
    held = store.get(A)
    assert held is not None
    assert held.run == "r2"
    assert store.release_many([Release("j1", A, 0, "r1")]) == [False]


def test_a_renewal_vouches_again_for_the_run_that_marks_the_key_only(store: Store) -> None:
    decide(store, active("j1", scope=Scope.ACTIVE))
    vouched_start(store, "j1", "r1", 300)
    # Another run of the job, or of another job, vouches for nothing.
    store.renew_many([Hold("j1", A, "r9"), Hold("j9", A, "r1")], LONG, alive_ms=LONG)
    assert store.renew_many([Hold("j1", A, "r1")], None, alive_ms=2_000) == 1
    time.sleep(0.4)
    begun = vouched_start(store, "j1", "r2", 5_000)
    assert begun.busy_ms is not None
    assert 0 < begun.busy_ms <= 2_000
    time.sleep(0.4)
    store.renew_many([Hold("j1", A, "r9")], LONG, alive_ms=LONG)
    assert vouched_start(store, "j1", "r3", 300).busy_ms is not None


def test_the_end_of_a_vouched_run_lets_a_copy_in(store: Store) -> None:
    """Retried or requeued (its job goes on): a copy of the message may run at once."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    vouched_start(store, "j1", "r1", LONG)
    assert store.release_many([Release("j1", A, GOES_ON, "r1")]) == [True]
    assert vouched_start(store, "j1", "r2", LONG) == RunBegun()
    # Handed over to a replacement: the replacement starts as the job's next run.
    assert store.release_many([Release("j1", A, HANDING_OVER, "r2")]) == [True]
    assert vouched_start(store, "j1", "r3", LONG) == RunBegun()


def test_a_late_mark_of_a_copy_leaves_a_vouched_run_alone(store: Store) -> None:
    """The worker's after-the-fact mark of a copy that waited takes nothing from the run."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    vouched_start(store, "j1", "r1", LONG)
    assert store.release_many([Release("j1", A, RUNNING, "r2")]) == [False]
    assert store.release_many([Release("j1", A, GOES_ON, "r2")]) == [False]
    held = store.get(A)
    assert held is not None
    assert held.run == "r1"


def test_a_run_no_longer_vouched_for_keeps_the_key_from_no_other_delivery(store: Store) -> None:
    """r1's worker lost track of it (cut off from its broker while its pool ran the job),
    so r1's release never comes. Once nobody vouches for r1, the end of another delivery
    of the job (a copy sent again for later, then revoked and dropped unrun) frees the
    key."""
    decide(store, active("j1", scope=Scope.ACTIVE))
    # Vouched for long enough that the two releases below come within it on a
    # loaded machine (a store on MariaDB beside a busy test run took over 150 ms).
    vouched_start(store, "j1", "r1", 1_000)
    assert store.release_many([Release("j1", A, 0, None)]) == [False]  # r1 is vouched for
    assert store.release_many([Release("j1", A, GOES_ON, "r2")]) == [False]
    held = store.get(A)
    assert held is not None
    assert held.run == "r1"
    time.sleep(1.1)
    assert store.release_many([Release("j1", A, 0, None)]) == [True]
    assert store.get(A) is None


# Keys spread over hash slots (unique_key_spread="key"): on Redis Cluster each
# multi-key call is split by slot; every store must give the same answers.


def spread(key: str, kind: str = keyspace.ACTIVE) -> str:
    """``tasks.sync``'s ``key`` laid out with a hash tag of its own."""
    return keyspace.storage_key(
        "ns", kind, "tasks.sync", key, tag=keyspace.key_tag("tasks.sync", key)
    )


def synced(job: str, key: str) -> Claim:
    return Claim(job_id=job, task="tasks.sync", active=ActiveClaim(key, Scope.ACTIVE, LONG))


def test_a_batch_of_spread_keys_sees_earlier_items_of_each_key(store: Store) -> None:
    """200 keys, then a duplicate of each of the first 100: each duplicate reuses its key's
    job, whatever slot its key is in."""
    keys = [spread(f"k{n}") for n in range(200)]
    claims = [synced(f"j{n}", key) for n, key in enumerate(keys)]
    claims += [synced(f"dup{n}", keys[n]) for n in range(100)]
    decisions = store.decide(claims)
    assert [d.verdict for d in decisions[:200]] == [Verdict.CREATED] * 200
    assert [(d.verdict, d.job_id) for d in decisions[200:]] == [
        (Verdict.REUSED_ACTIVE, f"j{n}") for n in range(100)
    ]
    assert [store.get(key).job_id for key in keys] == [f"j{n}" for n in range(200)]  # type: ignore[union-attr]


def test_a_batch_of_spread_keys_refused_anywhere_writes_nothing(store: Store) -> None:
    """All or nothing: one window conflict, and no other item's key is held afterwards."""
    window = spread("req-1", keyspace.WINDOW)
    store.decide([Claim("w0", "tasks.sync", window=WindowClaim(window, LONG, "fp1", "p"))])
    keys = [spread(f"k{n}") for n in range(60)]
    refused = Claim("w1", "tasks.sync", window=WindowClaim(window, LONG, "fp2", "p"))
    decisions = store.decide([synced(f"j{n}", key) for n, key in enumerate(keys)] + [refused])
    assert decisions[-1].verdict is Verdict.CONFLICT
    assert [key for key in keys if store.get(key) is not None] == []
    assert store.get(window).job_id == "w0"  # type: ignore[union-attr]


def test_a_batch_of_spread_keys_going_on_after_a_conflict_keeps_the_others(store: Store) -> None:
    """Without all-or-nothing, a conflict leaves every other item's key written."""
    window = spread("req-1", keyspace.WINDOW)
    store.decide([Claim("w0", "tasks.sync", window=WindowClaim(window, LONG, "fp1", "p"))])
    keys = [spread(f"k{n}") for n in range(60)]
    refused = Claim("w1", "tasks.sync", window=WindowClaim(window, LONG, "fp2", "p"))
    claims = [synced(f"j{n}", key) for n, key in enumerate(keys)] + [refused]
    decisions = store.decide(claims, all_or_nothing=False)
    assert [d.verdict for d in decisions] == [Verdict.CREATED] * 60 + [Verdict.CONFLICT]
    assert all(store.get(key) is not None for key in keys)


def test_renewals_releases_and_rollbacks_of_spread_keys(store: Store) -> None:
    """Each call on many keys reaches every key it names, once."""
    keys = [spread(f"k{n}") for n in range(90)]
    claims = [synced(f"j{n}", key) for n, key in enumerate(keys)]
    store.decide(claims)
    holds = [Hold(f"j{n}", key) for n, key in enumerate(keys)]
    assert store.renew_many([*holds, Hold("someone-else", keys[0])], 3_600_000) == 90
    assert all(store.get(key).expires_in_ms > LONG for key in keys)  # type: ignore[union-attr,operator]
    released = store.release_many([Release(f"j{n}", key) for n, key in enumerate(keys[:30])])
    assert released == [True] * 30
    assert store.release_many([Release("j0", keys[0]), Release("j31", keys[31])]) == [False, True]
    store.rollback_many(claims)
    assert [key for key in keys if store.get(key) is not None] == []


# -- an operator's release never drops the job; releases name their dispatch ---------


def dispatched(
    job: str, generation: str, scope: Scope = Scope.ACTIVE, lease: int | None = LONG
) -> Claim:
    claim = ActiveClaim(A, scope, lease, generation=generation)
    return Claim(job_id=job, task="tasks.recalc", active=claim)


def begin(store: Store, job: str, run: str, generation: str | None) -> RunBegun:
    start = RunStart(run, Scope.ACTIVE, "tasks.recalc", LONG, generation=generation)
    return store.begin_run(job, A, start)


def test_a_job_an_operator_released_still_runs_beside_the_next_holder(store: Store) -> None:
    """Dispatch j1, an operator releases its key, j2 is created: j1's delivery runs
    (unmarked, beside j2), where a copy of a job that ran already would be told j2."""
    decide(store, dispatched("j1", "g1"))
    assert store.delete(A, job_id="j1") is True
    assert decide(store, dispatched("j2", "g2")).verdict is Verdict.CREATED
    assert begin(store, "j1", "r1", "g1") == RunBegun()
    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.run) == ("j2", None)
    # Its retry is delivered again later: still the released job, still runs.
    assert begin(store, "j1", "r2", "g1") == RunBegun()
    # Its end leaves j2's key alone.
    assert store.release_many([Release("j1", A, 0, "r2", "g1")]) == [False]
    assert store.get(A) is not None


def test_a_copy_of_a_job_that_ran_is_still_stale_after_another_release(store: Store) -> None:
    """The note names the released job and dispatch: a job released by its own end, or
    another dispatch of the released job's id, is still a copy that must not run."""
    decide(store, dispatched("j1", "g1"))
    assert store.release_many([Release("j1", A, 0, None, "g1")]) == [True]
    decide(store, dispatched("j2", "g2"))
    assert store.delete(A, job_id="j2") is True
    decide(store, dispatched("j3", "g3"))
    assert begin(store, "j1", "r1", "g1").holder == "j3"
    assert begin(store, "j2", "r2", "g-other").holder == "j3"
    assert begin(store, "j2", "r2", "g2") == RunBegun()


def test_release_notes_are_not_held_keys(store: Store) -> None:
    decide(store, dispatched("j1", "g1"))
    store.delete(A, job_id="j1")
    assert list(store.scan()) == []
    assert list(store.scan(kind=KeyKind.ACTIVE)) == []
    assert store.stats().active == 0


def test_a_release_names_the_dispatch_it_ends(store: Store) -> None:
    """``queued`` with a caller's task_id: the first run's end must not free the key the
    same id took again meanwhile (a third dispatch would create a second queued job)."""
    decide(store, dispatched("t", "g1", Scope.QUEUED))
    assert store.release_many([Release("t", A, 0, None, "g1")]) == [True]  # it starts
    assert decide(store, dispatched("t", "g2", Scope.QUEUED)).verdict is Verdict.CREATED
    assert store.release_many([Release("t", A, 0, None, "g1")]) == [False]  # it ends
    assert decide(store, dispatched("t", "g3", Scope.QUEUED)).verdict is Verdict.REUSED_ACTIVE
    assert store.release_many([Release("t", A, 0, None, "g2")]) == [True]
    assert store.get(A) is None


def test_a_release_without_a_generation_ends_any_dispatch(store: Store) -> None:
    """Headers and keys written before generations existed still release."""
    decide(store, dispatched("t", "g1"))
    assert store.release_many([Release("t", A, 0)]) == [True]
    decide(store, active("t", scope=Scope.ACTIVE))
    assert store.release_many([Release("t", A, 0, None, "g9")]) == [True]


def test_an_operators_release_by_job_of_a_key_that_leaves_no_note_says_so(store: Store) -> None:
    """Only an unfinished active hold leaves a release note; releasing a window key or a
    finished key its job holds says True all the same."""
    decide(store, windowed("j1"))
    assert store.delete(W, job_id="j1") is True
    assert store.get(W) is None
    decide(store, active("j2", scope=Scope.EXISTS))
    assert store.release("j2", A, keep_ms=LONG) is True
    held = store.get(A)
    assert held is not None
    assert held.finished
    assert store.delete(A, job_id="j2") is True
    assert store.get(A) is None


def test_an_operators_release_of_a_missing_or_expired_key_releases_nothing(store: Store) -> None:
    assert store.delete(A) is False
    assert store.delete(A, job_id="j1") is False
    decide(store, active("j1", lease=50))
    time.sleep(0.1)
    assert store.delete(A) is False
    assert store.delete(A, job_id="j1") is False


def test_a_start_lengthens_a_lease_and_leaves_a_hold_without_one_as_it_is(store: Store) -> None:
    """The run's lease only pushes an expiry that would come sooner: a hold that never
    expires keeps never expiring, and a start without a lease keeps the expiry there is."""
    decide(store, active("j1", scope=Scope.ACTIVE, lease=None))
    assert start(store, "j1", "r1", lease=LONG) is None  # its own key: no other holder
    held = store.get(A)
    assert held is not None
    assert held.expires_in_ms is None
    decide(store, active("j2", key=B, scope=Scope.ACTIVE, lease=LONG))
    assert start(store, "j2", "r2", key=B, lease=None) is None
    held = store.get(B)
    assert held is not None
    assert held.expires_in_ms is not None
    assert held.expires_in_ms > LONG - 5_000


def test_release_takes_its_arguments_by_name(store: Store) -> None:
    """As Store declares them: job_id and key by position or by name, keep_ms by name only;
    the same for an operator's release (delete)."""
    decide(store, active("j1"))
    assert store.release(job_id="j1", key=A, keep_ms=0) is True
    assert store.get(A) is None
    decide(store, active("j2"))
    assert store.delete(key=A, job_id="j2") is True
    assert store.get(A) is None
