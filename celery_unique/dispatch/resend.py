"""A job sent again under its own id is the same job, never a duplicate of itself.

Celery sends a job again under its own id

* when the job retries (``retry()``, ``autoretry_for``): the pool child running
  it publishes the next attempt;
* when the worker's main process retries a job whose pool child was lost
  (``task_retry_on_worker_lost``, Celery 5.7 and later);
* when the job replaces itself (``replace()``): the replacement, or the last
  task of a replacement chain, inherits the id.

Such a send is published without asking the store (the job holds its keys
already) and carries the job's key header, whatever the class of the task
it sends, so that the end of the message that runs last releases the keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery_unique.dispatch.headers import HEADER, KeyHeader, read_header

if TYPE_CHECKING:
    from celery import Celery


@dataclass
class Resend:
    """A job the worker's main process may send again while it handles a lost child."""

    job_id: str
    header: KeyHeader | None
    #: Whether it did.
    published: bool = False


_resending: ContextVar[Resend | None] = ContextVar("celery_unique_resending", default=None)
_lease_covers: ContextVar[bool] = ContextVar("celery_unique_lease_covers", default=False)


@contextmanager
def lease_covers_it() -> Iterator[None]:
    """While the block runs, a job sent again is due soon enough for its key's lease (the
    worker that receives it renews it): the send does not ask the store to extend it first.

    For the library's own re-sends of a run that did not start (the store was silent,
    another delivery of the job runs, its planned start is later): one that waited on a
    silent store before it is sent could meet the run's hard time limit after the send,
    and the worker would then take the run's end for the job's.
    """
    token = _lease_covers.set(True)
    try:
        yield
    finally:
        _lease_covers.reset(token)


def lease_covered() -> bool:
    """Whether a job sent again now needs no longer lease (see :func:`lease_covers_it`)."""
    return _lease_covers.get()


_sent: ContextVar[list[str | None] | None] = ContextVar("celery_unique_sent", default=None)


@contextmanager
def resending(job_id: str, header: KeyHeader | None) -> Iterator[Resend]:
    """While the block runs, a send of ``job_id`` is that job sent again."""
    watched = Resend(job_id, header)
    token = _resending.set(watched)
    try:
        yield watched
    finally:
        _resending.reset(token)


@contextmanager
def counting_sends() -> Iterator[list[str | None]]:
    """While the block runs, the ids of the messages it handed to the broker, in order."""
    sent: list[str | None] = []
    token = _sent.set(sent)
    try:
        yield sent
    finally:
        _sent.reset(token)


def handed_over(job_id: str | None) -> None:
    """At the publish gate, once the broker took a message: note it for :func:`counting_sends`."""
    sent = _sent.get()
    if sent is not None:
        sent.append(job_id)


def resent(app: Celery, task_id: str | None, options: Mapping[str, Any]) -> Resend | None:
    """The job this dispatch sends again under its own id, with its key header; else ``None``."""
    if task_id is None:
        return None
    current = app.current_worker_task
    if current is not None and current.request.id == task_id:
        # retry() or replace() in the pool child running the job (or an eager run).
        return Resend(task_id, read_header(current.request))
    watched = _resending.get()
    if watched is not None and watched.job_id == task_id:
        return watched
    # The last task of a replacement chain, sent by the worker that ran the
    # step before it: replace() gave it the job's header, naming the job.
    header = read_header(options.get("headers") or {})
    if header is not None and header.get("j") == task_id:
        return Resend(task_id, header)
    return None


def observe(job_id: str | None, headers: dict[str, Any]) -> None:
    """At the publish gate: note a watched re-send going out, and give it the job's header.

    Celery's own worker-lost retry of a task that is not a ``UniqueTask`` (a
    replacement carrying the job's header) never passes through
    ``UniqueTask.apply_async``; this is where it is seen.
    """
    watched = _resending.get()
    if watched is not None and job_id is not None and watched.job_id == job_id:
        watched.published = True
        if watched.header is not None:
            headers.setdefault(HEADER, watched.header)
