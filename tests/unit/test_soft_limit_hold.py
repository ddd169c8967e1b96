"""A soft time limit held back over a hand-over, and to the end of a run that sent its job on.

Real signals in this process: SIGUSR1, as billiard sends it to a pool child (to
the process, which any of its threads may take), handled by billiard's own
handler, as there.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from billiard.pool import soft_timeout_sighandler

from celery_unique.exceptions import BackendUnavailable
from celery_unique.stores.base import RunStart, Scope
from celery_unique.worker import limits, runs


@pytest.fixture
def soft_limit() -> Iterator[None]:
    previous = signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
    try:
        yield
    finally:
        limits._held_to_the_end = limits._struck = False
        signal.signal(signal.SIGUSR1, previous)


def _send_limit() -> None:
    """SIGUSR1 to the process, and time for the interpreter to run its handler."""
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(100):
        time.sleep(0.001)


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
    with limits.soft_limit_held_back():
        limits.hold_to_the_end()
    _send_limit()  # after the body: the pool reads the run's outcome late
    assert limits._struck


def test_a_thread_that_takes_the_signal_does_not_let_it_strike(soft_limit: None) -> None:
    """Another thread, with the signal unblocked: the kernel may hand it the signal."""
    stop = threading.Event()
    taker = threading.Thread(target=stop.wait)
    taker.start()
    try:
        with limits.soft_limit_held_back():
            limits.hold_to_the_end()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        try:
            _send_limit()  # this thread blocks it: the kernel gives it to the other one
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        assert limits._struck
    finally:
        stop.set()
        taker.join()


def test_the_next_run_drops_the_held_limit_and_feels_its_own(soft_limit: None) -> None:
    with limits.soft_limit_held_back():
        limits.hold_to_the_end()
    _send_limit()
    limits._rearm()
    assert not limits._struck
    with pytest.raises(SoftTimeLimitExceeded):
        _send_limit()


def test_a_task_run_eagerly_after_the_hold_leaves_it_held(soft_limit: None) -> None:
    """A run that sent its job on and then runs a task eagerly (in a ``finally``, say):
    that task's start is no new run of the pool child, and the limit stays held."""
    with limits.soft_limit_held_back():
        limits.hold_to_the_end()
    limits._rearm(task=SimpleNamespace(request=SimpleNamespace(is_eager=True)))
    _send_limit()
    assert limits._struck


def test_elsewhere_the_signal_is_left_alone(soft_limit: None) -> None:
    """A solo worker's SIGUSR1 asks Celery for a traceback dump: never held back."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    with limits.soft_limit_held_back():
        limits.hold_to_the_end()
    assert not limits._held_to_the_end
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN


def test_once_the_body_ended_a_limit_only_notes_its_strike(soft_limit: None) -> None:
    """Struck in Celery's code after the body, it would report a failure in place of
    how the body ended (a requeue asked for, a retry)."""
    limits.hold_to_the_end()
    _send_limit()
    assert limits._struck
    limits._rearm()
    with pytest.raises(SoftTimeLimitExceeded):
        _send_limit()


class _SilentStore:
    """A store that never answers the start of a run (a fake: only ``begin_run`` is asked)."""

    def __init__(self) -> None:
        self.asked = 0

    def begin_run(self, job_id: str, key: str, start: object) -> object:
        self.asked += 1
        if self.asked == 1:
            # Strikes while the run sleeps before asking again.
            threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        raise BackendUnavailable("no answer")


def test_a_limit_striking_between_two_asks_of_a_silent_store_defers_the_run(
    soft_limit: None,
) -> None:
    """Struck while the run waits to ask the store again, before its body: the run is
    deferred (sent again), not failed with its job lost (a 30-minute RabbitMQ run)."""
    store = _SilentStore()
    start = RunStart("r1", Scope.ACTIVE, "t", 60_000)
    with pytest.raises(runs.StoreSilent):
        runs._start_waiting(store, "j1", "k", start, patient=True)  # type: ignore[arg-type]
    assert store.asked == 1
