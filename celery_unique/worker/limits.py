"""Holding a soft time limit back while the job hands itself over, and after.

In a prefork pool child, Celery's soft time limit is a signal whose handler
raises in whatever the child runs at that instant. Struck in the middle of a
hand-over (the replacement of a job sent, the job not yet ended as replaced),
it would fail a job that another message already carries on, and free its
keys beside it. The signal is held back over the hand-over.

Once the message that carries the job on has left, or once the body has
ended, the limit can no longer do the run any good, and it can still strike
after the body, where nothing of the job can catch it: in Celery's code that
reports how the run ended, or later, as the pool sends it until the worker's
main process has read the run's outcome, and a child that is slow to report it
(a loaded machine) then reports a failure instead of the retry, replacement or
requeue the body asked for. So from there to the end of the run the limit is
held back; the next run in the child drops a limit that came meanwhile and
arms it again. The run's hard time limit still ends it.

Held back means handled by a handler that only notes the strike, not
blocked: the pool sends the signal to the process, and a thread of the child
that does not block it (a library's background thread) would take it, the
interpreter then running the raising handler in the main thread all the same.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from billiard.pool import soft_timeout_sighandler

# billiard's soft time limit signal (``billiard.pool.SIG_SOFT_TIMEOUT``).
_SOFT_LIMIT: signal.Signals | None = getattr(signal, "SIGUSR1", None)

#: Whether the limit is held back until this process's next run starts.
_held_to_the_end = False
#: Whether the limit struck while held back.
_struck = False


def _note(signum: int, frame: FrameType | None) -> None:
    global _struck
    _struck = True


def _in_pool_child() -> signal.Signals | None:
    """The signal a soft time limit strikes with here: in the main thread of a prefork
    pool child, where billiard handles it; elsewhere none. (The threads pool has
    no soft limit, gevent's is a timeout; in a solo worker the signal is Celery's
    call for a traceback dump, which must not wait.)"""
    if (
        _SOFT_LIMIT is not None
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(_SOFT_LIMIT) in (soft_timeout_sighandler, _note)
    ):
        return _SOFT_LIMIT
    return None


@contextmanager
def soft_limit_held_back() -> Iterator[None]:
    """While the block runs, a soft time limit waits; it strikes as the block ends,
    unless the block called :func:`hold_to_the_end`: then it never strikes in this run."""
    global _struck
    limit = _in_pool_child()
    if limit is None or signal.getsignal(limit) is _note:
        # Not a pool child, or held back already (by an outer block, or to the end).
        yield
        return
    signal.signal(limit, _note)
    try:
        yield
    finally:
        if not _held_to_the_end:
            signal.signal(limit, soft_timeout_sighandler)
            if _struck:
                _struck = False
                soft_timeout_sighandler(limit, None)


def hold_to_the_end() -> None:
    """The body of this run has ended, or the job was sent on: from here, a soft time
    limit only notes its strike (struck in Celery's code after the body, or before
    the pool reported the run, it would report a failure in place of how the run
    ended)."""
    global _held_to_the_end
    limit = _in_pool_child()
    if limit is None:
        return
    signal.signal(limit, _note)
    _held_to_the_end = True


def _rearm(task: Any = None, **_: Any) -> None:
    """A run begins (``task_prerun``): drop a soft limit that struck after the end of the
    last one, held back, and let this run's strike.

    A task run eagerly (``.apply()``) inside another task's body begins no run of the
    pool child: the run it is in keeps its hold."""
    global _held_to_the_end, _struck
    limit = _in_pool_child()
    if not _held_to_the_end or limit is None:
        return
    if task is not None and getattr(task.request, "is_eager", False):
        return
    _held_to_the_end = _struck = False
    signal.signal(limit, soft_timeout_sighandler)


def connect() -> None:
    from celery import signals

    signals.task_prerun.connect(_rearm, weak=False, dispatch_uid="celery_unique.limits.rearm")
