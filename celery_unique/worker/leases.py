"""Leases: a worker keeps the keys of the jobs it holds alive; a dead worker's keys lapse.

Every active-type key is written with a lease (``unique_lease`` plus the
job's countdown/ETA wait). While a worker is alive, one thread in its main
process renews the keys of every job it has received and not yet finished
(waiting for an ETA, prefetched, or running, in any pool), with ONE store
call per interval whatever the number of jobs. If the worker dies, renewals
stop and its jobs' keys are freed when the lease runs out: never while the
job could still run on a live worker.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from celery import Celery, signals

from celery_unique.config import runtime
from celery_unique.dispatch.headers import read_header
from celery_unique.stores.base import Hold

logger = logging.getLogger("celery_unique")

#: Renew this many times per lease, so a missed renewal or two is harmless.
RENEWALS_PER_LEASE = 3
#: Floor of the renewal interval, in seconds.
MIN_INTERVAL_S = 0.1


def held_by_worker(requests: Iterable[Any]) -> list[Hold]:
    """The hold of every request that carries an active-type key (and of the key a
    replacement holds of its own beside it)."""
    holds = []
    for request in requests:
        header = read_header(request)
        job_id = getattr(request, "id", None)
        if header is None or not job_id:
            continue
        own = header.get("x") or {}
        for key in (header.get("a"), own.get("a")):
            if key:
                holds.append(Hold(str(job_id), key))
    return holds


#: Every request received in this process, held weakly: the worker drops its last
#: reference when the job is done. This covers jobs in none of Celery's own sets
#: (waiting for a rate-limit token, for instance).
_received: weakref.WeakSet[Any] = weakref.WeakSet()


def _worker_requests() -> list[Any]:
    """Requests this worker has received and not finished (main process only).

    A finished request still referenced somewhere is harmless here: renewing a
    released or finished key changes nothing.
    """
    from celery.worker import state

    requests: list[Any] = []
    for tracked in (_received, state.reserved_requests, state.active_requests):
        # The consumer adds and removes entries while we read: copy, retrying.
        for _ in range(3):
            try:
                requests.extend(list(tracked))
                break
            except RuntimeError:
                continue
    return list({id(r): r for r in requests}.values())


class Renewer(threading.Thread):
    """Renews the leases of every job a worker holds, every ``lease / 3``."""

    def __init__(self, app: Celery) -> None:
        super().__init__(name="celery-unique-lease-renewer", daemon=True)
        self.app = app
        self.stopped = threading.Event()

    def run(self) -> None:
        lease_ms = runtime(self.app).lease_ms
        if lease_ms is None:
            return
        interval = max(lease_ms / 1000 / RENEWALS_PER_LEASE, MIN_INTERVAL_S)
        while not self.stopped.wait(interval):
            self.renew_once(lease_ms)

    def renew_once(self, lease_ms: int) -> int:
        holds = held_by_worker(_worker_requests())
        if not holds:
            return 0
        try:
            return runtime(self.app).store.renew_many(holds, lease_ms)
        except Exception:
            # The next round tries again; the lease has room for a few misses.
            logger.warning("could not renew %d key leases", len(holds), exc_info=True)
            return 0

    def stop(self) -> None:
        self.stopped.set()


_renewers: dict[tuple[int, int], Renewer] = {}
_lock = threading.Lock()


def ensure_renewer(app: Celery) -> None:
    """Start the app's renewer in this process on its first received job (cheap after that)."""
    slot = (id(app), os.getpid())
    if slot in _renewers:
        return
    with _lock:
        if slot not in _renewers:
            renewer = Renewer(app)
            _renewers[slot] = renewer
            renewer.start()


def _on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None) or getattr(request, "app", None)
    if app is not None and read_header(request) is not None:
        _received.add(request)
        ensure_renewer(app)


def _on_worker_shutdown(sender: Any = None, **_: Any) -> None:
    with _lock:
        for renewer in _renewers.values():
            renewer.stop()
        _renewers.clear()


def connect() -> None:
    signals.task_received.connect(
        _on_received, weak=False, dispatch_uid="celery_unique.leases.received"
    )
    signals.worker_shutdown.connect(
        _on_worker_shutdown, weak=False, dispatch_uid="celery_unique.leases.shutdown"
    )
