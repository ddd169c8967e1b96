"""The keys a process found held: which answers it remembers, for how many keys, and whose
entry goes first. What the dispatch does with them is in ``tests/unit/test_dispatch.py``."""

from __future__ import annotations

import pytest

from celery_unique.config.recently_held import RecentlyHeld
from celery_unique.stores.base import (
    ActiveClaim,
    Claim,
    Decision,
    Scope,
    Verdict,
    WindowClaim,
)


def claim(active: str | None = "a", window: str | None = None) -> Claim:
    return Claim(
        job_id="job",
        task="task",
        active=ActiveClaim(active, Scope.ACTIVE, None) if active else None,
        window=WindowClaim(window, 60_000, "f", "p") if window else None,
    )


def answer(verdict: Verdict) -> Decision:
    return Decision(verdict, "holder")


@pytest.mark.parametrize(
    "verdict",
    [Verdict.REUSED_ACTIVE, Verdict.REUSED_WINDOW, Verdict.CONFLICT, Verdict.COMPOSITION_CONFLICT],
)
def test_a_key_found_held_is_remembered(verdict: Verdict) -> None:
    held = RecentlyHeld()
    assert claim() not in held
    held.note(claim(), answer(verdict))
    assert claim() in held


def test_a_created_job_or_no_answer_forgets_the_key() -> None:
    """The key was free after all (the guess was wrong), or nothing was learnt: the next
    dispatch need not ask first."""
    held = RecentlyHeld()
    held.note(claim(), answer(Verdict.CREATED))
    assert claim() not in held
    held.note(claim(), answer(Verdict.REUSED_ACTIVE))
    held.note(claim(), answer(Verdict.CREATED))
    assert claim() not in held
    held.note(claim(), answer(Verdict.REUSED_ACTIVE))
    held.note(claim(), None)
    assert claim() not in held


def test_a_claim_is_known_by_its_active_and_window_keys_together() -> None:
    held = RecentlyHeld()
    held.note(claim("a", "w"), answer(Verdict.REUSED_WINDOW))
    assert claim("a", "w") in held
    assert claim("a") not in held
    assert claim("a", "v") not in held
    assert claim(None, "w") not in held
    held.note(claim(None, "w"), answer(Verdict.REUSED_WINDOW))
    assert claim(None, "w") in held
    assert claim(None, None) not in held


def test_the_oldest_key_goes_once_more_than_size_are_remembered() -> None:
    held = RecentlyHeld(size=2)
    for key in "abc":
        held.note(claim(key), answer(Verdict.REUSED_ACTIVE))
    assert [key in held for key in (claim("a"), claim("b"), claim("c"))] == [False, True, True]


def test_a_key_found_held_again_is_the_newest() -> None:
    held = RecentlyHeld(size=2)
    held.note(claim("a"), answer(Verdict.REUSED_ACTIVE))
    held.note(claim("b"), answer(Verdict.REUSED_ACTIVE))
    held.note(claim("a"), answer(Verdict.REUSED_ACTIVE))
    held.note(claim("c"), answer(Verdict.REUSED_ACTIVE))
    assert [key in held for key in (claim("a"), claim("b"), claim("c"))] == [True, False, True]


def test_a_process_remembers_4096_keys_unless_told() -> None:
    held = RecentlyHeld()
    for number in range(4097):
        held.note(claim(str(number)), answer(Verdict.REUSED_ACTIVE))
    assert claim("0") not in held
    assert claim("1") in held
