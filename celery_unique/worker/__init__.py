"""The worker side: keys released when the message's fate says so, and kept alive meanwhile.

* :mod:`~celery_unique.worker.fates`: the request class that learns, in the
  worker's main process, whether a message was acknowledged, rejected or
  requeued, whether its run ended and whether the job goes on under its id
  (retry, replacement, a lost child's retry), and releases keys accordingly;
* :mod:`~celery_unique.worker.step`: the consumer bootstep giving that request
  class to every task the worker runs;
* :mod:`~celery_unique.worker.dropped`: messages dropped before they become a
  request (unknown task, unreadable message);
* :mod:`~celery_unique.worker.runs`: each delivery's mark on its key, so that
  a copy of a message the broker delivered again never runs beside another job;
* :mod:`~celery_unique.worker.guard`: the same stop before the body for tasks
  that are not unique but carry a job's key (a replacement);
* :mod:`~celery_unique.worker.alive`: the process running a job vouching for
  the run, so that a copy of its message waits for it;
* :mod:`~celery_unique.worker.leases`: renewing the lease of every key a live
  worker holds.

Keys are computed on the producer and travel in the message's ``celery_unique``
header; the worker only reads them back.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from celery import Celery, signals

from celery_unique.checks.at_start import check_at_worker_start
from celery_unique.config import configured_backend_url, runtime
from celery_unique.dispatch.publishing import install_gate
from celery_unique.stores import cleanup
from celery_unique.stores.masking import redacted
from celery_unique.worker import alive, control, dropped, guard, leases, limits, runs
from celery_unique.worker.step import FollowFates

logger = logging.getLogger("celery_unique")

#: How long a stopping worker waits for releases still owed to the store.
SHUTDOWN_FLUSH_S = 10.0


def _on_worker_shutdown(**_: object) -> None:
    cleanup.flush(SHUTDOWN_FLUSH_S)


def _on_worker_init(sender: Any = None, **_: object) -> None:
    # Build the store in the main process before the pool forks, so that every
    # pool child inherits its client library imported: importing redis-py takes
    # a second or more on a busy machine, time the first job of each child would
    # otherwise spend before its body starts (past a short time limit, even).
    app = getattr(sender, "app", None)
    if app is None or not control.installed_in(app):
        return
    # Before the pool forks, too: its children build their tracers from these tasks.
    guard.guard_tasks(app)
    # The main process sends a lost run again under its id (retry_on_worker_lost) and
    # knows it only through the gate: installed by a unique dispatch otherwise, which a
    # worker's main process need never make, so the re-send of a plain task carrying a
    # job's keys (a unique job's replacement) went unseen and its key was freed.
    install_gate(app)
    try:
        runtime(app).store  # noqa: B018 - built for its side effect
    except Exception as exc:
        # Not logger.exception: the error may quote the store's URL, password and all.
        logger.error(
            "celery-unique: the uniqueness store could not be set up:\n%s",
            redacted("".join(traceback.format_exception(exc)), configured_backend_url(app)),
        )


def _on_pool_child_start(**_: object) -> None:
    for app in control.installed_apps():
        alive.prepare(app)


def _on_worker_set_up(instance: Any = None, **_: object) -> None:
    # After the worker's logging is set up (so that findings reach its log),
    # before its pool starts (so that a strict check stops it before any job).
    app = getattr(instance, "app", None)
    if app is not None:
        check_at_worker_start(app)


def install(app: Celery) -> None:
    """Hook the worker side into ``app`` (idempotent)."""
    if FollowFates not in app.steps["consumer"]:
        app.steps["consumer"].add(FollowFates)
    control.unique_plugin  # noqa: B018 - imported for its registration
    dropped.connect()
    leases.connect()
    limits.connect()
    runs.connect()
    guard.connect()
    signals.worker_shutdown.connect(
        _on_worker_shutdown, weak=False, dispatch_uid="celery_unique.worker.shutdown"
    )
    control.mark_installed(app)
    signals.worker_init.connect(
        _on_worker_init, weak=False, dispatch_uid="celery_unique.worker.prepare"
    )
    signals.worker_process_init.connect(
        _on_pool_child_start, weak=False, dispatch_uid="celery_unique.worker.pool_child"
    )


# Connected when the plugin is imported, not by install(): an app whose tasks all
# forgot base=UniqueTask never binds a UniqueTask, and is the one that most needs
# its checks. check_at_worker_start passes over the apps that do not use the plugin.
signals.celeryd_after_setup.connect(
    _on_worker_set_up, weak=False, dispatch_uid="celery_unique.worker.check"
)
