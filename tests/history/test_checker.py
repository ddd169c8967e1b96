"""The history checker catches a planted violation of each invariant, and passes clean histories."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.history.broker_log import lost_in_transport, message_states, removed_unacknowledged
from tests.history.chaos import Config, Outcome
from tests.history.checker import History, check

S = 1_000_000_000  # a second, in the histories' nanoseconds


def dispatch(
    t: float, *items: dict[str, Any], proc: str = "p0", took: float = 0.001
) -> dict[str, Any]:
    return {
        "e": "dispatch",
        "proc": proc,
        "t0": int(t * S),
        "t1": int((t + took) * S),
        "items": list(items),
    }


def created(
    job: str, key: str | None = "k", scope: str | None = "active", **extra: Any
) -> dict[str, Any]:
    return {"jid": job, "out": "created", "job": job, "key": key, "scope": scope, **extra}


def reused(job: str, key: str | None = "k", match: str = "active", **extra: Any) -> dict[str, Any]:
    return {"jid": "asked", "out": "reused", "job": job, "key": key, "match": match, **extra}


def failed(
    jid: str, key: str = "k", maybe_applied: bool = True, scope: str = "active"
) -> dict[str, Any]:
    return {
        "jid": jid,
        "out": "error",
        "job": None,
        "key": key,
        "scope": scope,
        "code": "backend_unavailable",
        "maybe_applied": maybe_applied,
    }


def run(
    job: str, start: float, end: float | None, outcome: str = "ok", n: int = 1, pid: int = 1
) -> list[dict[str, Any]]:
    events = [{"e": "start", "job": job, "run": n, "key": "k", "pid": pid, "t": int(start * S)}]
    if end is not None:
        events.append({"e": "end", "job": job, "run": n, "outcome": outcome, "t": int(end * S)})
    return events


def released(job: str, t: float) -> dict[str, Any]:
    return {"e": "released", "job": job, "key": "k", "reason": "finished", "t": int(t * S)}


def history(*parts: dict[str, Any] | list[dict[str, Any]]) -> History:
    events: list[dict[str, Any]] = [{"e": "config", "lease_s": 60, "t": 0}]
    for part in parts:
        events += part if isinstance(part, list) else [part]
    return History(events)


def violations(events: History) -> dict[str, int]:
    return {name: count for name, count in check(events).by_invariant().items() if count}


def test_a_clean_history_passes() -> None:
    """One job at a time per key, reuses while it may run, releases soon after it ends."""
    clean = history(
        dispatch(1.0, created("J1")),
        run("J1", 1.1, 1.5),
        dispatch(1.2, reused("J1")),
        released("J1", 1.51),
        dispatch(2.0, created("J2")),
        run("J2", 2.1, 2.3),
        released("J2", 2.31),
        {"e": "keys", "t": 10 * S, "held": []},
    )
    assert violations(clean) == {}


def test_i1_catches_two_jobs_running_at_once_under_an_active_key() -> None:
    """J2 was created while J1 held the key (active) and their runs overlap."""
    bad = history(
        dispatch(1.0, created("J1")),
        dispatch(1.1, created("J2")),
        run("J1", 1.2, 2.0),
        run("J2", 1.5, 1.8, pid=2),
        released("J1", 2.01),
        released("J2", 1.81),
    )
    assert violations(bad) == {"I1": 1}


def test_i1_allows_overlap_after_a_queued_key_was_freed() -> None:
    """A queued key is free once its job starts: a new job may run alongside."""
    fine = history(
        dispatch(1.0, created("J1", scope="queued")),
        run("J1", 1.2, 2.0),
        dispatch(1.3, created("J2", scope="active")),
        run("J2", 1.5, 1.8, pid=2),
        released("J2", 1.81),
    )
    assert violations(fine) == {}


def test_i1_a_copy_of_a_job_whose_release_landed_may_run_beside_a_queued_job() -> None:
    """J1 ended and freed its key at 1.21 s, but RabbitMQ lost its acknowledgement and
    delivered it again; J2, created on the free key 0.3 s later (sooner than a release
    is given to land), holds it only while queued: the copy finds it free once J2
    starts, and runs beside J2 by design. Were J2 active, the copy should have found
    the key J2's and not run."""

    def events(scope: str) -> History:
        return history(
            dispatch(1.0, created("J1")),
            run("J1", 1.1, 1.2),
            released("J1", 1.21),
            dispatch(1.5, created("J2", scope=scope), proc="p1"),
            run("J2", 2.0, 2.3, pid=2),
            run("J1", 2.1, 2.2, n=2, pid=3),
        )

    assert violations(events("queued")) == {}
    assert violations(events("active")) == {"I1": 1}


def operator_release(job: str, t: float, released: bool | None = True) -> dict[str, Any]:
    return {
        "e": "operator_release",
        "proc": "p9",
        "job": job,
        "key": "k",
        "t0": int(t * S),
        "t1": int((t + 0.001) * S),
        "released": released,
        "spared": released is False,
    }


def test_i1_allows_the_next_job_beside_one_whose_key_an_operator_released() -> None:
    """An operator's release frees the key and leaves its job running: a job created after
    it may run beside it, and after one whose answer was lost (it may have freed the key).
    Created before it, or after a release that was refused (the key kept for the job's
    duplicates), it may not."""

    def events(release_at: float, freed: bool | None = True) -> History:
        return history(
            dispatch(1.0, created("J1")),
            run("J1", 1.1, 2.0),
            operator_release("J1", release_at, freed),
            dispatch(1.3, created("J2"), proc="p1"),
            run("J2", 1.5, 1.8, pid=2),
            released("J1", 2.01),
            released("J2", 1.81),
        )

    assert violations(events(1.2)) == {}
    assert violations(events(1.4)) == {"I1": 1}
    assert violations(events(1.2, freed=False)) == {"I1": 1}
    assert violations(events(1.2, freed=None)) == {}
    assert check(events(1.2, freed=None)).counts["operator releases whose answer was lost"] == 1


def test_i2_catches_a_reuse_of_a_job_nobody_created() -> None:
    """A reuse naming a job no dispatch created (and no lost answer explains) is a phantom."""
    bad = history(dispatch(1.0, reused("ghost")))
    assert violations(bad) == {"I2": 1}


def test_i2_allows_the_phantom_of_a_lost_answer_until_it_is_undone() -> None:
    """A lost decision's job may be handed out until its process settled, not after."""
    until_undone = history(
        dispatch(1.0, failed("L1")),
        dispatch(1.2, reused("L1"), proc="p1"),
        {"e": "settled", "proc": "p0", "t": int(1.5 * S)},
    )
    assert violations(until_undone) == {}
    after = history(
        dispatch(1.0, failed("L1")),
        {"e": "settled", "proc": "p0", "t": int(1.5 * S)},
        dispatch(2.0, reused("L1"), proc="p1"),
    )
    assert violations(after) == {"I2": 1}


def test_a_job_delivered_though_its_answer_was_lost_was_created() -> None:
    """Store and broker on one server: a batch's script reserved L1 and enqueued it, and
    the answer was lost (never undone). Reuses of L1 are no phantoms once L1 is
    delivered, and L1 is held to every rule a created job is: it existed before the
    first reuse named it, so J2, created after L1 (queued) started, may run beside it,
    and L1 must end."""
    lost = [
        dispatch(1.0, failed("L1", scope="queued"), failed("L2"), took=2.0),
        dispatch(1.2, reused("L1"), proc="p1"),
        {"e": "received", "job": "L1", "t": int(1.4 * S)},
        *run("L1", 1.5, 2.5),
        released("L1", 1.51),
        dispatch(1.6, created("J2", scope="exists"), proc="p1"),
        *run("J2", 1.7, 1.9, pid=2),
        released("J2", 1.91),
    ]
    assert violations(history(*lost)) == {}
    assert check(history(*lost)).counts["jobs created though their answer was lost"] == 1
    assert violations(history(*lost[:2])) == {"I2": 1}, "never delivered: a phantom"
    unended = [event for event in lost if event.get("e") != "end" or event["job"] != "L1"]
    assert violations(history(*unended)) == {"I3": 1}


def test_i2_catches_a_finished_job_handed_out_long_after_its_end() -> None:
    """J1 ended at 1.5 s and its key was released at 9 s: a reuse at 8 s names a finished job."""
    bad = history(
        dispatch(1.0, created("J1")),
        run("J1", 1.1, 1.5),
        released("J1", 9.0),
        dispatch(8.0, reused("J1")),
    )
    assert violations(bad) == {"I2": 1}


def test_i2_allows_the_moment_between_the_end_and_the_release() -> None:
    """A reuse between a job's end and its release landing (promptly) is not a phantom."""
    fine = history(
        dispatch(1.0, created("J1")),
        run("J1", 1.1, 1.5),
        dispatch(1.52, reused("J1")),
        released("J1", 1.55),
    )
    assert violations(fine) == {}


def test_i2_allows_a_release_the_broker_held_up() -> None:
    """The job ended as the broker restarted: its acknowledgement, and so its release,
    waited for the broker; a reuse meanwhile is not a phantom. Without the fault it is."""

    def story(*faults: dict[str, Any]) -> History:
        return history(
            dispatch(1.0, created("J1")),
            run("J1", 1.1, 1.5),
            *faults,
            dispatch(3.6, reused("J1")),
            released("J1", 3.8),
        )

    restart = {"e": "fault", "kind": "broker_restart", "target": "broker"}
    assert violations(story({**restart, "t0": int(1.4 * S), "t1": int(1.9 * S)})) == {}
    assert violations(story()) == {"I2": 1}


def test_i2_allows_a_release_waiting_out_an_acknowledgement_never_confirmed() -> None:
    """The broker restarted as J1 ended, and was back within half a second, but the
    acknowledgement asked for meanwhile was never confirmed: the release waited the
    10 s the worker gives it (the message might have come back). A reuse then is not a
    phantom; nor is one after a release that took longer than that."""
    restart = {"e": "fault", "kind": "broker_restart", "target": "broker"}

    def story(release_at: float) -> History:
        return history(
            dispatch(1.0, created("J1")),
            run("J1", 1.1, 1.5),
            {**restart, "t0": int(1.51 * S), "t1": int(2.0 * S)},
            dispatch(8.0, reused("J1")),
            released("J1", release_at),
        )

    assert violations(story(11.51)) == {}
    assert violations(story(14.0)) == {"I2": 1}


def test_i2_allows_a_release_lost_with_its_worker_while_it_waited_for_the_broker() -> None:
    """J1 ended as the broker restarted; its release waited for the acknowledgement to be
    confirmed, and its worker was killed 8 s later, still waiting: the lease frees the
    key, and a reuse meanwhile is not a phantom. Without the broker fault the release
    was not waiting any more by then, and the reuse is one."""

    def story(*faults: dict[str, Any]) -> History:
        return history(
            {"e": "config", "lease_s": 60},
            dispatch(1.0, created("J1")),
            run("J1", 1.1, 1.5),
            *faults,
            {"e": "kill", "pids": [], "whole": True, "node": "n", "t": int(9.5 * S)},
            dispatch(30.0, reused("J1")),
        )

    restart = {"e": "fault", "kind": "broker_restart", "target": "broker"}
    assert violations(story({**restart, "t0": int(1.51 * S), "t1": int(2.0 * S)})) == {}
    assert violations(story()) == {"I2": 1}


def test_i2_allows_a_copy_dropped_behind_a_vouched_run_until_nobody_vouches_for_it() -> None:
    """J1's run ended and its worker lost track of it (no release of its own); a copy of
    its message, revoked, was dropped at 5 s while the run was still vouched for, so
    the copy's release lands once the vouching ran out (11.3 s) and it is sent again
    (within 2.7 s). Reuses until then are not phantoms; one later than that is."""

    def story(reuse_at: float) -> History:
        return history(
            dispatch(1.0, created("J1")),
            run("J1", 1.1, 1.3),
            {"e": "dropped", "job": "J1", "t": 5 * S},
            dispatch(reuse_at, reused("J1")),
            released("J1", 16.8),
        )

    assert violations(story(6.0)) == {}
    assert violations(story(15.9)) == {}
    assert violations(story(16.5)) == {"I2": 1}


def test_i3_catches_a_created_job_that_never_ran() -> None:
    """A created job with no final run and no drop: lost."""
    assert violations(history(dispatch(1.0, created("J1")))) == {"I3": 1}


def test_i3_catches_a_job_whose_requeued_run_never_came() -> None:
    """A run that ended by requeue is not an end: the job must run again."""
    bad = history(dispatch(1.0, created("J1")), run("J1", 1.1, 1.2, outcome="requeue"))
    assert violations(bad) == {"I3": 1}


def test_i4_catches_a_key_left_held_after_quiescence() -> None:
    """An unfinished active key held once everything drained is left behind."""
    bad = history(
        dispatch(1.0, created("J1")),
        run("J1", 1.1, 1.2),
        released("J1", 1.21),
        {
            "e": "keys",
            "t": 10 * S,
            "held": [{"key": "k", "kind": "active", "job": "J1", "finished": False}],
        },
    )
    assert violations(bad) == {"I4": 1}


def test_i4_leaves_to_the_lease_a_key_whose_run_died_with_its_node() -> None:
    """Its node killed mid-run, the copy delivered again was revoked and dropped unrun:
    the dead run's mark keeps the key until the lease; a child kill is no excuse."""

    def left(whole: bool, snapshot_s: float) -> History:
        return history(
            dispatch(1.0, created("J1")),
            run("J1", 1.1, None, pid=7),
            {"e": "kill", "pids": [3, 7], "whole": whole, "t": int(1.2 * S)},
            {"e": "dropped", "job": "J1", "t": int(8 * S)},
            {
                "e": "keys",
                "t": int(snapshot_s * S),
                "held": [{"key": "k", "kind": "active", "job": "J1", "finished": False}],
            },
        )

    assert violations(left(whole=True, snapshot_s=20)) == {}
    assert violations(left(whole=False, snapshot_s=20)) == {"I4": 1}
    assert violations(left(whole=True, snapshot_s=62)) == {"I4": 1}  # past the lease


def window(job: str, out: str, req: str, **extra: Any) -> dict[str, Any]:
    return {
        "jid": job,
        "out": out,
        "job": job,
        "key": None,
        "wkey": "w",
        "req": req,
        "window_ms": 5000,
        **extra,
    }


@pytest.mark.parametrize(
    ("second", "expected"),
    [
        (window("J1", "reused", "A", match="window"), {}),
        (window("J1", "conflict", "B"), {}),
        (window("J2", "created", "A"), {"I5": 1}),  # a second job inside the window
        (window("J1", "reused", "B", match="window"), {"I5": 1}),  # another request reused
        (window("J1", "conflict", "A"), {"I5": 1}),  # the same request refused
    ],
)
def test_i5_checks_what_a_window_key_answers_inside_its_window(
    second: dict[str, Any], expected: dict[str, int]
) -> None:
    """Same request: the same job; another request: a conflict naming it; no second job."""
    events = history(
        dispatch(1.0, window("J1", "created", "A")),
        run("J1", 1.1, 1.2),
        dispatch(3.0, second),
        run("J2", 3.1, 3.2),
    )
    assert violations(events) == expected


def test_i5_lets_a_new_job_in_once_the_window_ended() -> None:
    """After its window, a window key gives a new job; naming the old one then is a violation."""
    later = history(
        dispatch(1.0, window("J1", "created", "A")),
        run("J1", 1.1, 1.2),
        dispatch(7.0, window("J2", "created", "B")),
        run("J2", 7.1, 7.2),
    )
    assert violations(later) == {}
    stale = history(
        dispatch(1.0, window("J1", "created", "A")),
        run("J1", 1.1, 1.2),
        dispatch(7.0, window("J1", "reused", "A", match="window")),
    )
    assert violations(stale) == {"I5": 1}


def test_i3_a_run_that_ended_for_good_ends_the_job_whatever_a_copy_did_after() -> None:
    """A copy of the job's first message (redelivered by the broker) retried after the
    job's next attempt had succeeded; the attempt it sent was dropped as stale."""
    copy_retried = [
        dispatch(1.0, created("J1")),
        run("J1", 1.1, 1.2, outcome="retry", n=1),
        run("J1", 3.0, 3.3, outcome="ok", n=3),
        run("J1", 3.01, 3.4, outcome="retry", n=2),
        {"e": "unrun", "job": "J1", "state": "IGNORED", "t": int(3.5 * S)},
    ]
    assert violations(history(*copy_retried)) == {}
    # With no run that ended for good, the dropped attempt is a lost job.
    lost = [dispatch(1.0, created("J1")), run("J1", 1.1, 1.2, outcome="retry")]
    dropped = {"e": "unrun", "job": "J1", "state": "IGNORED", "t": int(1.3 * S)}
    assert violations(history(*lost, dropped)) == {"I3": 1}


def test_i3_counts_a_message_the_broker_log_shows_lost_apart() -> None:
    """A job whose message the Redis broker's log shows lost in transport is counted apart."""
    retried = [dispatch(1.0, created("J1")), run("J1", 1.1, 1.2, outcome="retry")]
    report = check(history(*retried, {"e": "transport_lost", "job": "J1"}))
    assert report.by_invariant()["I3"] == 0
    assert report.counts["messages lost by the Redis transport"] == 1
    assert violations(history(*retried, {"e": "transport_lost", "job": "J2"})) == {"I3": 1}


def test_i3_counts_a_requeue_the_broker_log_shows_dropped_apart() -> None:
    """Reject(requeue=True), then the transport deleted the message and pushed nothing back."""
    requeued = [dispatch(1.0, created("J1")), run("J1", 1.1, 1.2, outcome="requeue")]
    report = check(history(*requeued, {"e": "left_broker", "job": "J1"}))
    assert report.by_invariant()["I3"] == 0
    assert report.counts["messages lost by the Redis transport"] == 1
    assert violations(history(*requeued)) == {"I3": 1}
    # A message acknowledged after a run that went on (a retry) is no excuse.
    retried = [dispatch(1.0, created("J1")), run("J1", 1.1, 1.2, outcome="retry")]
    assert violations(history(*retried, {"e": "left_broker", "job": "J1"})) == {"I3": 1}


def test_the_broker_log_shows_messages_taken_off_a_list_and_never_delivered(
    tmp_path: Path,
) -> None:
    """Pushed, popped, never recorded unacknowledged: lost; recorded: delivered; still in
    its list at the end: waiting, not lost."""

    def resp(*args: str) -> bytes:
        out = f"*{len(args)}\r\n".encode()
        for arg in args:
            out += f"${len(arg.encode())}\r\n{arg}\r\n".encode()
        return out

    def message(job: str) -> str:
        return json.dumps({"body": "", "headers": {"id": job, "task": "t"}, "properties": {}})

    aof = resp("LPUSH", "q", message("lost"))
    aof += resp("LPUSH", "q", message("delivered")) + resp("RPOP", "q") + resp("RPOP", "q")
    aof += resp("HSET", "unacked", "tag-1", json.dumps([message("delivered"), "q", "q"]))
    aof += resp("LPUSH", "q", message("waiting"))  # never taken: waits to the end
    aof += resp("LPUSH", "p", message("requeued")) + resp("RPOP", "p")
    aof += resp("HSET", "unacked", "tag-2", json.dumps([message("requeued"), "p", "p"]))
    aof += resp("LPUSH", "p", message("requeued")) + resp("RPOP", "p")
    aof += resp("LPUSH", "p", message("acked")) + resp("RPOP", "p")
    aof += resp("HSET", "unacked", "tag-3", json.dumps([message("acked"), "p", "p"]))
    aof += resp("HDEL", "unacked", "tag-3")
    aof += resp("LPUSH", "p", message("restored")) + resp("RPOP", "p")
    aof += resp("HSET", "unacked", "tag-4", json.dumps([message("restored"), "p", "p"]))
    aof += resp("HDEL", "unacked", "tag-4") + resp("RPUSH", "p", message("restored"))
    aof += resp("LPUSH", "p", message("later")) + resp("RPOP", "p")  # the restored one
    (tmp_path / "appendonly.aof.1.incr.aof").write_bytes(aof)
    states = message_states(tmp_path)
    assert lost_in_transport(states) == {"lost", "requeued", "restored"}
    assert removed_unacknowledged(states) == {"acked"}
    assert (states["waiting"], states["later"]) == ("pushed", "pushed")


def test_i3_a_delivery_timed_out_before_its_body_is_an_end() -> None:
    """Retried, and the retry's delivery hit its hard time limit before the body began."""
    retried = [dispatch(1.0, created("J1")), run("J1", 1.1, 1.2, outcome="retry")]
    timed_out = {"e": "timed_out", "job": "J1", "t": int(2.0 * S)}
    assert violations(history(*retried, timed_out)) == {}
    assert violations(history(*retried)) == {"I3": 1}


def test_i3_a_killed_run_goes_on_unless_its_time_limit_fired_first() -> None:
    """A killed pool child's message is requeued: the job must run again, unless the
    main process timed the run out first (then it was acknowledged, and it ended)."""
    kill = {"e": "kill", "pids": [7], "whole": False, "t": int(1.3 * S)}
    never_again = history(dispatch(1.0, created("J1")), run("J1", 1.1, None, pid=7), kill)
    assert violations(never_again) == {"I3": 1}
    requeued = history(
        dispatch(1.0, created("J1")),
        run("J1", 1.1, None, pid=7),
        kill,
        run("J1", 2.0, 2.2, n=2, pid=8),
        released("J1", 2.21),
    )
    assert violations(requeued) == {}
    timed_out = history(
        dispatch(1.0, created("J1")),
        run("J1", 1.1, None, pid=7),
        kill,
        {"e": "timed_out", "job": "J1", "t": int(1.9 * S)},
        released("J1", 1.95),
    )
    assert violations(timed_out) == {}


# -- I6, I7: jobs that follow their duplicates ("latest", "debounce") -----------------


def follows(job: str, nonce: str, **extra: Any) -> dict[str, Any]:
    return created(job, policy="latest", nonce=nonce, **extra)


def duplicate(job: str, jid: str, nonce: str, effect: str) -> dict[str, Any]:
    return {**reused(job), "jid": jid, "policy": "latest", "nonce": nonce, "effect": effect}


def run_with(job: str, nonce: str, asked: float, start: float, end: float) -> list[dict[str, Any]]:
    first, last = run(job, start, end)
    return [{**first, "nonce": nonce, "asked": int(asked * S)}, last]


def followed(job: str, of: str, t: float) -> dict[str, Any]:
    return {"e": "followed", "job": job, "of": of, "t": int(t * S)}


def test_duplicates_of_a_running_job_followed_by_one_run_with_the_last_arguments_pass() -> None:
    clean = history(
        dispatch(1.0, follows("J1", "n1")),
        run_with("J1", "n1", 1.05, 1.1, 2.0),
        dispatch(1.5, duplicate("J1", "F1", "n2", "rerun")),
        dispatch(1.6, duplicate("J1", "F2", "n3", "rerun")),
        followed("F1", "J1", 2.01),
        run_with("F1", "n3", 2.05, 2.1, 2.5),
    )
    assert violations(clean) == {}


def test_two_owed_runs_for_one_job_are_caught() -> None:
    twice = history(
        dispatch(1.0, follows("J1", "n1")),
        run_with("J1", "n1", 1.05, 1.1, 2.0),
        dispatch(1.5, duplicate("J1", "F1", "n2", "rerun")),
        followed("F1", "J1", 2.01),
        followed("F1", "J1", 2.02),
        run_with("F1", "n2", 2.05, 2.1, 2.5),
    )
    assert violations(twice).get("I6") == 1


def test_an_owed_run_never_published_is_caught() -> None:
    lost = history(
        dispatch(1.0, follows("J1", "n1")),
        run_with("J1", "n1", 1.05, 1.1, 2.0),
        dispatch(1.5, duplicate("J1", "F1", "n2", "rerun")),
    )
    assert violations(lost).get("I6") == 1


def test_an_owed_run_delivered_though_its_publish_went_unrecorded_was_published() -> None:
    """The publish of F1 raised after its message went out (the broker went down as it
    was sent): no worker recorded publishing it, but a worker received it and ran it."""
    unrecorded = [
        dispatch(1.0, follows("J1", "n1")),
        run_with("J1", "n1", 1.05, 1.1, 2.0),
        dispatch(1.5, duplicate("J1", "F1", "n2", "rerun")),
        {"e": "received", "job": "F1", "t": int(2.02 * S)},
        run_with("F1", "n2", 2.05, 2.1, 2.5),
    ]
    assert violations(history(*unrecorded)) == {}
    # Delivered twice, or its publish recorded after all, it is one owed run.
    again = {"e": "received", "job": "F1", "t": int(2.6 * S)}
    assert violations(history(*unrecorded, again)) == {}
    assert violations(history(*unrecorded, followed("F1", "J1", 2.3))) == {}


def test_an_owed_run_named_after_a_duplicate_whose_answer_was_lost_holds_its_chains_key() -> None:
    """The store asked first (RabbitMQ): D1's decision made it the run J1 owes, and its
    answer was lost, so no dispatch recorded it; J1's worker published the run, and its
    publish went unrecorded too. A delivery of D1 can only be that run: it holds J1's key
    in J1's scope (exists), kept after its end, so a dispatch handed D1 then is no
    phantom. (Taken for a job D1's own dispatch created, in its own scope, active, that
    dispatch would be one.)"""
    events = [
        dispatch(1.0, follows("J1", "n1", scope="exists")),
        run_with("J1", "n1", 1.05, 1.1, 2.0),
        dispatch(1.5, {**failed("D1"), "policy": "latest", "nonce": "n2"}, took=0.1),
        {"e": "received", "job": "D1", "t": int(2.02 * S)},
        run_with("D1", "n2", 2.05, 2.1, 2.5),
        released("D1", 2.51),
        dispatch(3.5, reused("D1")),
    ]
    assert violations(history(*events)) == {}
    counts = check(history(*events)).counts
    assert (counts["owed runs published"], counts["jobs created though their answer was lost"]) == (
        1,
        0,
    )


def test_a_run_handed_the_duplicates_arguments_is_the_run_it_was_owed() -> None:
    """The run asked before the duplicate by the clients' clocks, but the store started it
    after the duplicate's decision: it ran with the duplicate's arguments (n2), so nothing
    more is owed. With the old arguments (n1) the owed run is lost."""
    late_start = history(
        dispatch(1.0, follows("J1", "n1")),
        run_with("J1", "n2", 1.05, 1.1, 2.0),
        dispatch(1.06, duplicate("J1", "F1", "n2", "rerun")),
    )
    assert violations(late_start) == {}
    lost = history(
        dispatch(1.0, follows("J1", "n1")),
        run_with("J1", "n1", 1.05, 1.1, 2.0),
        dispatch(1.06, duplicate("J1", "F1", "n2", "rerun")),
    )
    assert violations(lost).get("I6") == 1


def test_a_run_with_stale_arguments_is_caught() -> None:
    """n3 returned (replacing n2's arguments) before the run asked: running with n2 is stale."""
    stale = history(
        dispatch(1.0, follows("J1", "n1")),
        dispatch(1.1, duplicate("J1", "D2", "n2", "replaced")),
        dispatch(1.2, duplicate("J1", "D3", "n3", "replaced")),
        run_with("J1", "n2", 1.3, 1.31, 1.5),
    )
    assert violations(stale) == {"I7": 1}
    fresh = history(
        dispatch(1.0, follows("J1", "n1")),
        dispatch(1.1, duplicate("J1", "D2", "n2", "replaced")),
        dispatch(1.2, duplicate("J1", "D3", "n3", "replaced")),
        run_with("J1", "n3", 1.3, 1.31, 1.5),
    )
    assert violations(fresh) == {}


def test_a_run_killed_as_it_recorded_its_start_ends_with_the_kill() -> None:
    """The orchestrator records a kill just before its signal lands: a run that recorded
    its start in between ended there, not at the end of the history."""
    killed = history(
        dispatch(1.0, created("J1")),
        {"e": "kill", "pids": [7], "whole": True, "node": "n", "t": int(1.1 * S)},
        run("J1", 1.1001, None, pid=7),
        dispatch(5.0, created("J2")),
        run("J2", 5.1, 5.5),
    )
    assert "I1" not in violations(killed)


def test_i1_a_run_its_worker_timed_out_ended_within_moments() -> None:
    """A run that did not mean to outlast the task's hard limit did (held up by a paused
    store): the main process timed it out and the pool killed it. A job created later
    runs beside nothing; one running before the kill could land is an overlap."""
    first = [
        dispatch(1.0, created("J1")),
        run("J1", 1.1, None, pid=7),
        {"e": "timed_out", "job": "J1", "t": int(1.9 * S)},
        released("J1", 2.5),
    ]
    later = [dispatch(4.5, created("J2")), run("J2", 4.6, 4.8, pid=8), released("J2", 4.85)]
    assert violations(history(*first, *later)) == {}
    during = [dispatch(2.6, created("J2")), run("J2", 2.7, 2.9, pid=8), released("J2", 2.95)]
    assert violations(history(*first, *during)) == {"I1": 1}
    never_timed_out = history(first[0], first[1], *later)
    assert violations(never_timed_out).get("I1") == 1


def test_i2_an_owed_run_holds_its_key_in_the_scope_at_the_head_of_its_chain() -> None:
    """An owed run of an ``exists`` key keeps it after its end (retention), even when the
    record of the owed run before it was lost with its worker: the duplicates that asked
    for each run lead back to the job that created the key."""
    asked = {"scope": "active"}
    events = [
        dispatch(1.0, follows("J1", "n1", scope="exists")),
        run_with("J1", "n1", 1.05, 1.1, 1.5),
        dispatch(1.2, {**duplicate("J1", "F1", "n2", "rerun"), **asked}),
        run_with("F1", "n2", 1.55, 1.6, 1.8),
        # The worker that published F1 died before it recorded doing so.
        {"e": "kill", "pids": [9], "whole": True, "node": "n1", "t": int(1.52 * S)},
        dispatch(1.7, {**duplicate("F1", "F2", "n3", "rerun"), **asked}),
        followed("F2", "F1", 1.9),
        run_with("F2", "n3", 1.95, 2.0, 2.1),
        released("F2", 2.12),
        dispatch(3.0, reused("F2")),
    ]
    assert "I2" not in violations(history(*events))
    # Were the key the duplicates' scope (active), the reuse at 3.0 s would be a phantom.
    events[0] = dispatch(1.0, follows("J1", "n1", scope="active"))
    assert violations(history(*events)).get("I2") == 1


def test_a_job_whose_failed_publish_landed_holds_its_key_from_its_delivery() -> None:
    """A publish cut by a broker restart raised, and its keys were rolled back, but the
    message landed: the worker that got it took the free key and ran it. From its
    delivery it is a job like any (reuses may name it; an exists key keeps it after
    its end); before that, once the rollback landed, a reuse naming it is a phantom."""
    cut = {**failed("U1", scope="exists", maybe_applied=False), "code": "publish_failed"}
    landed = [
        dispatch(1.0, cut),
        {"e": "settled", "proc": "p0", "t": int(1.1 * S)},
        {"e": "received", "job": "U1", "t": int(2.0 * S)},
        *run("U1", 2.1, 2.2),
        released("U1", 2.21),
        dispatch(2.15, reused("U1"), proc="p1"),
        dispatch(3.0, reused("U1"), proc="p1"),
    ]
    assert violations(history(*landed)) == {}
    assert check(history(*landed)).counts["uncertain publishes that ran"] == 1
    too_early = [*landed, dispatch(1.5, reused("U1"), proc="p2")]
    assert violations(history(*too_early)) == {"I2": 1}
    never_ran = [event for event in landed if event.get("job") != "U1" or event["e"] == "dispatch"]
    assert violations(history(*never_ran)) == {"I2": 2}


def test_a_failed_publish_that_landed_leaves_its_window_to_the_next_request() -> None:
    """Its rollback freed its window key, which its run does not take back: the next
    dispatch of the window creates a job, and no window holds two jobs."""
    cut = {
        **failed("U1", maybe_applied=False),
        "code": "publish_failed",
        "wkey": "w",
        "req": "r1",
        "window_ms": 60_000,
    }
    events = [
        dispatch(1.0, cut),
        dispatch(1.05, window("U1", "reused", "r1"), proc="p1"),
        {"e": "settled", "proc": "p0", "t": int(1.1 * S)},
        dispatch(1.5, window("J2", "created", "r1"), proc="p1"),
        *run("J2", 1.6, 1.7, pid=2),
        released("J2", 1.71),
        {"e": "received", "job": "U1", "t": int(2.0 * S)},
        *run("U1", 2.1, 2.2),
        released("U1", 2.21),
    ]
    assert violations(history(*events)) == {}


def test_a_run_whose_broker_never_emptied_is_not_ok_whatever_its_history() -> None:
    """A job sent round and round (each round one run, one copy sent again) breaks no
    invariant of the history, but the run never settles: it fails, and says why."""
    clean = history(dispatch(1.0, created("J1")), run("J1", 1.1, 1.2), released("J1", 1.3))
    report = check(clean)
    assert not report.violations
    settled = Outcome(Config(seconds=1, seed=1), report, Counter(), 1.0, clean)
    assert settled.ok
    stuck = Outcome(Config(seconds=1, seed=1), report, Counter(), 1.0, clean, drained=False)
    assert not stuck.ok
    assert "the broker still held messages 90 s after the faults" in stuck.failures()
