"""Dispatch when the database transaction commits, with uniqueness decided then.

``task.delay()`` inside ``transaction.atomic()`` publishes at once: the worker
may run before the rows it needs are committed, and a rolled-back transaction
still leaves a job (and its key) behind. Deferring the dispatch to commit
fixes both; with celery-unique the *whole* dispatch is deferred, including the
uniqueness decision, so a rolled-back transaction publishes nothing and holds
no key::

    from celery_unique_django.on_commit import dispatch_on_commit

    with transaction.atomic():
        order = Order.objects.create(...)
        pending = dispatch_on_commit(send_receipt, order.id)
    pending.result.disposition   # after commit: Disposition.CREATED or REUSED

Outside a transaction the dispatch happens immediately (Django's
``on_commit`` semantics). Tasks built on
:class:`celery_unique_django.task.UniqueDjangoTask` also have
``delay_on_commit`` / ``apply_async_on_commit`` returning the same handle.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from celery import Task
from celery.canvas import Signature
from celery.result import AsyncResult
from django.db import transaction

import celery_unique_django.checks  # noqa: F401  (system checks, even without INSTALLED_APPS)


class OnCommitDispatch:
    """A dispatch waiting for its transaction to commit; filled in when it has run.

    ``result`` is the ``AsyncResult`` the dispatch returned (with
    ``disposition``, ``duplicate``, ``duplicate_match``, ``policy_drift``);
    ``error`` is the exception it raised (``UniquenessConflict``,
    ``BackendUnavailable``, ...). Both stay ``None`` while the transaction is
    open, and for ever if it rolls back (``done`` stays ``False``).
    """

    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = False
        self.result: AsyncResult[Any] | None = None
        self.error: BaseException | None = None

    def __repr__(self) -> str:
        if not self.done:
            return "<OnCommitDispatch: waiting for commit>"
        if self.error is not None:
            return f"<OnCommitDispatch: failed: {self.error!r}>"
        return f"<OnCommitDispatch: {getattr(self.result, 'disposition', None)} {self.result}>"

    def _run(self, dispatch: Callable[[], AsyncResult[Any]]) -> None:
        try:
            self.result = dispatch()
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.done = True


def defer(
    dispatch: Callable[[], AsyncResult[Any]], *, using: str | None = None, robust: bool = False
) -> OnCommitDispatch:
    """Run ``dispatch`` when the transaction on ``using`` commits; return its handle.

    An exception the dispatch raises at commit is kept in ``handle.error`` and,
    unless ``robust``, propagates from the block that committed (Django's
    ``on_commit`` rule); with ``robust`` Django logs it instead.
    """
    handle = OnCommitDispatch()

    def dispatch_at_commit() -> None:  # A function: Django's robust mode logs its name.
        handle._run(dispatch)

    transaction.on_commit(dispatch_at_commit, using=using, robust=robust)
    return handle


def dispatch_on_commit(
    target: Task[Any, Any] | Signature[Any],
    *args: Any,
    using: str | None = None,
    robust: bool = False,
    **kwargs: Any,
) -> OnCommitDispatch:
    """``target.delay(*args, **kwargs)`` when the transaction on ``using`` commits.

    ``target`` is a task or a signature (``task.s(...).set(countdown=10)``;
    ``args``/``kwargs`` complete its arguments as ``signature.delay`` does).
    ``using`` and ``robust`` are this function's own: pass task arguments with
    those names through a signature.
    """
    return defer(functools.partial(target.delay, *args, **kwargs), using=using, robust=robust)
