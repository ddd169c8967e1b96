"""A soft time limit held back over a hand-over, and to the end of a run that sent its job on.

Real signals in this process's main thread: SIGUSR1, as billiard sends it to a
pool child, handled by billiard's own handler, as there.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from billiard.pool import soft_timeout_sighandler

from celery_unique.worker import limits


@pytest.fixture
def soft_limit() -> Iterator[None]:
    previous = signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    try:
        yield
    finally:
        limits._held_to_the_end = False
        while signal.SIGUSR1 in signal.sigpending():
            signal.sigtimedwait({signal.SIGUSR1}, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGUSR1, previous)


def _send_limit() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)


def _held_back(reached: list[str]) -> None:
    with limits.soft_limit_held_back():
        _send_limit()
        reached.append("the end of the block")


def test_a_limit_held_back_strikes_as_the_block_ends(soft_limit: None) -> None:
    reached: list[str] = []
    with pytest.raises(SoftTimeLimitExceeded):
        _held_back(reached)
    assert reached == ["the end of the block"]


def test_a_limit_held_to_the_end_of_the_run_never_strikes_in_it(soft_limit: None) -> None:
    with limits.soft_limit_held_back() as held:
        held.to_the_end = True
    _send_limit()  # after the body: the pool reads the run's outcome late
    assert signal.SIGUSR1 in signal.sigpending()


def test_the_next_run_drops_the_held_limit_and_feels_its_own(soft_limit: None) -> None:
    with limits.soft_limit_held_back() as held:
        held.to_the_end = True
    _send_limit()
    limits._rearm()
    assert signal.SIGUSR1 not in signal.sigpending()
    with pytest.raises(SoftTimeLimitExceeded):
        _send_limit()


def test_elsewhere_the_signal_is_left_alone(soft_limit: None) -> None:
    """A solo worker's SIGUSR1 asks Celery for a traceback dump: never held back."""
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    with limits.soft_limit_held_back() as held:
        held.to_the_end = True
    assert not limits._held_to_the_end
    assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
