"""The run a ``latest``/``debounce`` job's duplicates are owed, published as the job ends.

A duplicate that met the job running left its arguments and the id of one
owed run with the key (:mod:`celery_unique.options.duplicates`). When the job ends for
good, the worker's main process, which frees the key, first asks the store to
hand the key to that run (:meth:`~celery_unique.stores.base.Store.pass_on`: one
atomic step, so however many duplicates came, one run is owed and one takes
the key) and publishes it, with the latest arguments, to the queue the job
came from. The run is always the ended job's own task, never one the store
names, and its arguments run only if their signature holds
(:mod:`celery_unique.stores.signing`): a run whose record fails the check is logged,
not published, and its key freed. That step does not wait, as the release
does, for kombu to confirm the job's acknowledgement: a copy of the message
the broker delivers again finds the key the owed run's and does not run.

The run's mark stays on the key until the hold ends, so a duplicate that comes
after that first step still finds the job running and owes a run. The hold
then ends in one atomic step too
(:meth:`~celery_unique.stores.base.Store.pass_on_or_release`): the key goes to
the run owed by then, published as above, or, none being owed, is released.
No duplicate is told of a run that nobody publishes.

Each step is retried in the background until it succeeds, within the key's
lease: asked again, the store names the same owed run, so a publish that
failed is tried again rather than lost. A worker that dies between handing
the key over and publishing leaves the key with a job that was never
published: its lease frees it.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_unique import signals
from celery_unique.config import runtime
from celery_unique.dispatch import resend
from celery_unique.dispatch.headers import KeyHeader
from celery_unique.keys.keyspace import split_storage_key
from celery_unique.options.duplicates import RefusedArguments, decode_arguments
from celery_unique.stores.base import FollowUp, Release

logger = logging.getLogger("celery_unique")


class Passer:
    """Hands the key of ``hold.job_id`` (whose delivery ``hold.run`` of ``task`` ended for
    good) to its owed run and publishes that run; each step raises (to be retried) while
    it fails."""

    def __init__(
        self, app: Any, hold: Release, header: KeyHeader, message: Any, task: str | None
    ) -> None:
        self.app, self.hold, self.header, self.message, self.task = (
            app,
            hold,
            header,
            message,
            task,
        )
        #: The key went to the owed run, which was published (or refused).
        self.handed = False

    def pass_on(self) -> None:
        """The run owed so far takes the key (nothing changes when none is)."""
        rt = runtime(self.app)
        hold = self.hold
        owed = rt.store.pass_on(hold.job_id, hold.key, hold.run, rt.lease_ms)
        if owed is not None:
            self._follow(owed)

    def end(self) -> bool:
        """End the hold: the run owed by now takes the key, or the key is released as
        ``hold`` says; whether the release changed the key."""
        if self.handed:
            return False  # the key is the owed run's: nothing of this job's is left
        rt = runtime(self.app)
        hold = self.hold
        ended = rt.store.pass_on_or_release(
            hold.job_id, hold.key, hold.run, rt.lease_ms, hold.keep_ms
        )
        if isinstance(ended, FollowUp):
            self._follow(ended)
            return False
        return ended

    def _follow(self, owed: FollowUp) -> None:
        rt = runtime(self.app)
        job_id, key = self.hold.job_id, self.hold.key
        follows = _own_task(self.app, self.header, self.task)
        try:
            arguments = _arguments(follows, owed, key, rt.signing_key)
        except RefusedArguments as refused:
            _refuse(rt, job_id, key, owed, refused)
        else:
            _publish(follows, job_id, self.header, owed, arguments, self.message)
        self.handed = True


def _own_task(app: Any, header: KeyHeader, task: str | None) -> Any:
    """The task the ended job's key belongs to: the one its key is scoped to, else the
    one its dispatch named (a replacement of another task carries it on), else the one
    its message ran. Never a name read from the store."""
    name = split_storage_key(header["a"])[2] or header.get("t") or task
    return app.tasks.get(name) if name else None


def _arguments(
    task: Any, owed: FollowUp, key: str, signing_key: bytes
) -> tuple[list[Any], dict[str, Any]]:
    if task is None:
        raise RefusedArguments("the job's own task is not registered in this worker")
    if owed.task != task.name:
        # Only a record written elsewhere than by a dispatch names another task.
        raise RefusedArguments(f"the record names the task {owed.task!r}, not {task.name!r}")
    return decode_arguments(task, key, owed.arguments, signing_key)


def _refuse(rt: Any, job_id: str, key: str, owed: FollowUp, refused: RefusedArguments) -> None:
    """Log the refused run and free its key, which no job will release otherwise."""
    logger.error(
        "job %s ended owing a run to its duplicates; that run (job %s) is refused and not "
        "published: the arguments its key %r keeps in the store are refused, %s",
        job_id,
        owed.job_id,
        key,
        refused,
    )
    try:
        rt.store.release_many([Release(owed.job_id, key)])
    except Exception as exc:
        logger.warning("job %s: its key is freed by its lease instead: %r", owed.job_id, exc)


def _publish(
    task: Any,
    job_id: str,
    header: KeyHeader,
    owed: FollowUp,
    arguments: tuple[list[Any], dict[str, Any]],
    message: Any,
) -> None:
    info = getattr(message, "delivery_info", None) or {}
    properties = getattr(message, "properties", None) or {}
    route = {
        name: value
        for name, value in (
            ("exchange", info.get("exchange")),
            ("routing_key", info.get("routing_key")),
            ("priority", properties.get("priority", info.get("priority"))),
        )
        if value is not None
    }
    args, kwargs = arguments
    try:
        # Published without asking the store: the key is the owed run's already.
        with resend.resending(owed.job_id, header):
            task.apply_async(args, kwargs, task_id=owed.job_id, **route)
    except Exception as exc:
        logger.warning(
            "job %s ended owing a run to its duplicates; publishing it (job %s) failed, "
            "tried again shortly: %r",
            job_id,
            owed.job_id,
            exc,
        )
        raise
    logger.info(
        "job %s ended with a run owed to its duplicates: job %s published, with the latest "
        "arguments",
        job_id,
        owed.job_id,
    )
    signals.emit_rerun_published(task, job_id, owed.job_id, header["a"])
