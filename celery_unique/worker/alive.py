"""The process that runs a job vouches for the run, so that a copy of its message waits.

A broker can deliver a message again while its first delivery still runs: a
worker that lost its broker connection goes on running its jobs (Celery's
default), and RabbitMQ gives their messages to another worker; a Redis
transport puts back a message whose run outlasts ``visibility_timeout``. The
copy's run marks the job's key (see :mod:`celery_unique.worker.runs`); had it
taken the mark and ended first, its release would have freed the key while
the first run went on, and a new job could have run beside it.

So a run is vouched alive: its start vouches for :func:`alive_ms`, and a
thread of the process running it vouches again every :func:`interval_s`
until its body ends. A copy that finds the run vouched for is sent again for
when the vouching runs out; it runs once the first run released the key (or
finds the key another job's: it is stale), or once nobody vouches for that run
any more: its process died, and the copy is the job's next run.

The vouching comes from the process that runs the body, not from the
worker's main process: a main process cut off from its broker hears nothing
from its pool until it reconnects, and would vouch for runs long over. A
body that holds the interpreter's lock for longer than :func:`alive_ms`
(a long call into C code that does not release it) stops the vouching too.
"""

from __future__ import annotations

import logging
import os
import threading

from celery import Celery

from celery_unique.config import runtime
from celery_unique.stores.base import Hold

logger = logging.getLogger("celery_unique")

#: How often, at most, a process vouches for the runs it has in progress, in seconds.
HEARTBEAT_S = 2.5
#: Floor of the interval, in seconds (a very short lease).
MIN_INTERVAL_S = 0.1
#: A run is vouched alive this many intervals ahead, so that a late round or two (a
#: slow store, a busy host) does not let a copy in.
VOUCHED_INTERVALS = 4
#: Rounds per lease, when the lease is short.
ROUNDS_PER_LEASE = 3


def interval_s(lease_ms: int | None) -> float:
    """Seconds between two rounds of vouching."""
    if lease_ms is None:
        return HEARTBEAT_S
    return max(min(lease_ms / 1000 / ROUNDS_PER_LEASE, HEARTBEAT_S), MIN_INTERVAL_S)


def alive_ms(lease_ms: int | None) -> int:
    """How long a start, or a round, vouches for a run (at most a lease: by then the key
    of a job nobody renews has lapsed anyway)."""
    vouched = round(interval_s(lease_ms) * 1000 * VOUCHED_INTERVALS)
    return vouched if lease_ms is None else min(vouched, lease_ms)


class Voucher(threading.Thread):
    """Vouches for the runs in progress in this process, with one store call per round."""

    def __init__(self, app: Celery) -> None:
        super().__init__(name="celery-unique-run-voucher", daemon=True)
        self.app = app
        self.runs: dict[str, Hold] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            lease_ms = runtime(self.app).lease_ms
        except Exception:
            return  # The app has no store (a misconfigured app): there is nothing to vouch.
        while not self.stopped.wait(interval_s(lease_ms)):
            self.vouch_once(lease_ms)

    def vouch_once(self, lease_ms: int | None) -> int:
        with self.lock:
            holds = list(self.runs.values())
        if not holds:
            return 0
        try:
            return runtime(self.app).store.renew_many(holds, None, alive_ms=alive_ms(lease_ms))
        except Exception:
            # The next round tries again: a run is vouched for a few rounds ahead.
            logger.warning("could not vouch for %d runs in progress", len(holds), exc_info=True)
            return 0


_vouchers: dict[tuple[int, int], Voucher] = {}
_lock = threading.Lock()


def prepare(app: Celery) -> Voucher:
    """This process's voucher for ``app``, started if it was not.

    A pool child prepares it when it starts: started on a job's first run, the
    thread's start would count against that run's soft time limit."""
    slot = (id(app), os.getpid())
    voucher = _vouchers.get(slot)
    if voucher is None:
        with _lock:
            voucher = _vouchers.get(slot)
            if voucher is None:
                voucher = _vouchers[slot] = Voucher(app)
                voucher.start()
    return voucher


def started(app: Celery, hold: Hold) -> None:
    """Vouch for the run ``hold.run`` of this process until :func:`ended`."""
    voucher = prepare(app)
    with voucher.lock:
        voucher.runs[str(hold.run)] = hold


def ended(run: str) -> None:
    """Stop vouching for the run ``run`` (its body ended)."""
    pid = os.getpid()
    for (_, owner), voucher in list(_vouchers.items()):
        if owner == pid:
            with voucher.lock:
                voucher.runs.pop(run, None)
