"""The publish gate on its own: read the store's answer once, let out only what it created.

The gate is what keeps a job off the broker without a decision, so each of its
rules is pinned here with a fake runtime and store (the gate reads nothing
else of them): one reading of the answer, fail-closed unless fail-open, the
outage noted and ended once, what a failed publish must undo, and which open
gate a job passes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from celery_unique.dispatch.gate import (
    Gate,
    NotPublished,
    gate_for,
    gated,
    pass_gate,
    store_answered,
    tolerate_outage,
)
from celery_unique.exceptions import BackendUnavailable
from celery_unique.stores.base import Claim, DecidedAlready, Decision, Verdict
from tests.unit.fakes import CREATED, AnsweringStore, FakeRuntime

REUSED = Decision(Verdict.REUSED_ACTIVE, "holder")


def counting(answer: Decision | BaseException) -> tuple[Callable[[], Decision], list[int]]:
    """An ``ask`` that answers ``answer`` (or raises it), and the list its calls go into."""
    calls: list[int] = []

    def ask() -> Decision:
        calls.append(1)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return ask, calls


def asked_gate(rt: FakeRuntime | None = None, job_id: str = "job") -> Gate:
    """A gate whose question is asked as the job leaves (the co-located way)."""
    return Gate(job_id, rt or FakeRuntime(), None, claim=Claim(job_id, "task"))  # type: ignore[arg-type]


# Fail-open and the outage


def test_fail_closed_tolerates_no_outage() -> None:
    rt = FakeRuntime(fail_open=False)
    assert tolerate_outage(rt, BackendUnavailable("down")) is False  # type: ignore[arg-type]
    assert rt.outage is False


def test_fail_open_notes_an_outage_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    rt = FakeRuntime(fail_open=True)
    with caplog.at_level(logging.WARNING, logger="celery_unique"):
        assert tolerate_outage(rt, BackendUnavailable("down")) is True  # type: ignore[arg-type]
        assert tolerate_outage(rt, BackendUnavailable("down")) is True  # type: ignore[arg-type]
    assert rt.outage is True
    assert [r.getMessage() for r in caplog.records] == [
        "uniqueness store unavailable, publishing without uniqueness (fail-open): down"
    ]


def test_an_answer_ends_the_outage_once(caplog: pytest.LogCaptureFixture) -> None:
    rt = FakeRuntime(fail_open=True, outage=True)
    with caplog.at_level(logging.WARNING, logger="celery_unique"):
        store_answered(rt)  # type: ignore[arg-type]
        store_answered(rt)  # type: ignore[arg-type]
    assert rt.outage is False
    assert [r.getMessage() for r in caplog.records] == [
        "uniqueness store reachable again; uniqueness restored"
    ]
    quiet = FakeRuntime()
    store_answered(quiet)  # type: ignore[arg-type]
    assert quiet.outage is False


# Reading the answer


def test_the_answer_is_read_once() -> None:
    gate = asked_gate()
    ask, calls = counting(CREATED)
    assert gate.let_out(ask) is CREATED
    assert gate.let_out(ask) is CREATED
    assert gate.resolve(ask) is CREATED
    assert calls == [1]


def test_the_answer_is_this_claims_own() -> None:
    """The store answers a list, one decision per claim: the gate's is the first."""
    mine, other = CREATED, Decision(Verdict.CREATED, "other")
    waiting = Gate("job", FakeRuntime(), None, DecidedAlready([mine, other]))  # type: ignore[arg-type]
    assert waiting.let_out() is mine
    rt = FakeRuntime(AnsweringStore(answers=[mine, other]))
    asking = asked_gate(rt)
    assert asking.let_out() is mine
    assert rt.store.asked == 1


def test_only_a_created_job_goes_out() -> None:
    gate = Gate("job", FakeRuntime(), None, decision=REUSED)  # type: ignore[arg-type]
    for _ in range(2):
        with pytest.raises(NotPublished):
            gate.let_out()
    assert not gate.passed
    assert not gate.created()


def test_letting_out_is_what_marks_the_job_as_gone() -> None:
    gate = Gate("job", FakeRuntime(), None, decision=CREATED)  # type: ignore[arg-type]
    assert gate.resolve() is CREATED
    assert not gate.passed
    gate.let_out()
    assert gate.passed


def test_an_outage_closes_the_gate_for_good_unless_fail_open() -> None:
    rt = FakeRuntime(fail_open=False)
    gate = asked_gate(rt)
    ask, calls = counting(BackendUnavailable("down"))
    for _ in range(2):
        with pytest.raises(BackendUnavailable):
            gate.let_out(ask)
    assert calls == [1]
    assert not gate.passed
    assert rt.outage is False


def test_fail_open_lets_the_job_out_without_a_decision_and_notes_the_outage() -> None:
    rt = FakeRuntime(fail_open=True)
    gate = asked_gate(rt)
    ask, _ = counting(BackendUnavailable("down"))
    assert gate.let_out(ask) is None
    assert gate.passed
    assert rt.outage is True
    # The next answer ends the outage.
    asked_gate(rt, "next").let_out(counting(CREATED)[0])
    assert rt.outage is False


# After a failed publish: was the job created (its keys to be undone)?


def test_a_gate_never_asked_created_nothing_and_asks_nothing_after() -> None:
    rt = FakeRuntime()
    gate = asked_gate(rt)
    assert gate.created() is False
    assert gate.created() is False
    assert rt.store.asked == 0


def test_a_pending_answer_is_read_to_tell_whether_it_created_the_job() -> None:
    created = Gate("job", FakeRuntime(), None, DecidedAlready([CREATED]))  # type: ignore[arg-type]
    assert created.created() is True
    reused = Gate("job", FakeRuntime(), None, DecidedAlready([REUSED]))  # type: ignore[arg-type]
    assert reused.created() is False


class Unanswered(DecidedAlready):
    def __init__(self, error: BaseException) -> None:
        super().__init__([])
        self.error = error

    def wait(self) -> list[Decision]:
        raise self.error


@pytest.mark.parametrize("fail_open", [False, True])
def test_a_pending_answer_that_never_came_created_nothing(fail_open: bool) -> None:
    rt = FakeRuntime(fail_open=fail_open)
    gate = Gate("job", rt, None, Unanswered(BackendUnavailable("down")))  # type: ignore[arg-type]
    assert gate.created() is False


def test_a_gate_that_failed_created_nothing() -> None:
    gate = asked_gate()
    with pytest.raises(KeyError):
        gate.let_out(counting(KeyError("odd"))[0])  # type: ignore[arg-type]
    assert gate.created() is False


def test_what_fail_open_let_out_undecided_created_nothing() -> None:
    gate = asked_gate(FakeRuntime(fail_open=True))
    gate.let_out(counting(BackendUnavailable("down"))[0])
    assert gate.created() is False


# Which gate a job passes


def test_a_job_passes_its_own_gate_among_nested_ones() -> None:
    outer = Gate("job-a", FakeRuntime(), None, decision=CREATED)  # type: ignore[arg-type]
    inner = Gate("job-b", FakeRuntime(), None, decision=REUSED)  # type: ignore[arg-type]
    assert gate_for("job-a") is None
    with gated(outer), gated(inner):
        assert gate_for("job-b") is inner
        assert gate_for("job-a") is outer
        # Ids compare by value: one read from a message is not the gate's own object.
        assert gate_for("".join(["job-", "a"])) is outer
        assert gate_for("job-c") is None
        assert pass_gate("job-a") is outer
        assert outer.passed
        with pytest.raises(NotPublished):
            pass_gate("job-b")
    assert gate_for("job-a") is None


def test_gates_are_searched_whatever_the_order_of_their_ids() -> None:
    low = Gate("a", FakeRuntime(), None, decision=CREATED)  # type: ignore[arg-type]
    high = Gate("z", FakeRuntime(), None, decision=CREATED)  # type: ignore[arg-type]
    with gated(high), gated(low):
        assert gate_for("z") is high
    with gated(low), gated(high):
        assert gate_for("a") is low


def test_a_job_without_a_gate_passes_freely() -> None:
    assert pass_gate("nobody") is None
