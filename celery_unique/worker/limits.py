"""Holding a soft time limit back while the job hands itself over.

In a prefork pool child, Celery's soft time limit is a signal whose handler
raises in whatever the child runs at that instant. Struck in the middle of a
hand-over (the replacement of a job sent, the job not yet ended as replaced),
it would fail a job that another message already carries on, and free its
keys beside it. The signal is held back over the hand-over and delivered
right after it, where the job's end can tell what was sent.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# billiard's soft time limit signal (``billiard.pool.SIG_SOFT_TIMEOUT``).
_SOFT_LIMIT = getattr(signal, "SIGUSR1", None)


@contextmanager
def soft_limit_held_back() -> Iterator[None]:
    """While the block runs, a soft time limit waits; it strikes as the block ends."""
    if _SOFT_LIMIT is None or threading.current_thread() is not threading.main_thread():
        # Signal handlers run on the main thread only: elsewhere no soft limit
        # is a signal (the threads pool has none; gevent's is a timeout).
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {_SOFT_LIMIT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
