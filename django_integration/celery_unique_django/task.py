"""``UniqueDjangoTask``: a :class:`~celery_unique.UniqueTask` that can wait for commit.

Celery (5.4+) gives Django projects ``delay_on_commit`` on its default task
class; a task declared with ``base=UniqueTask`` does not inherit it. This
class brings the same two methods back, returning an
:class:`~celery_unique_django.on_commit.OnCommitDispatch` instead of ``None``::

    @app.task(base=UniqueDjangoTask, unique_key=lambda job: f"order:{job.order_id}")
    def send_receipt(order_id): ...

    with transaction.atomic():
        order = Order.objects.create(...)
        pending = send_receipt.delay_on_commit(order.id)

Use it for every task of an app with ``Celery(..., task_cls=
"celery_unique_django.task:UniqueDjangoTask")``.
"""

from __future__ import annotations

import functools
from typing import Any

from celery_unique import UniqueTask
from celery_unique_django.on_commit import OnCommitDispatch, defer


class UniqueDjangoTask(UniqueTask):
    """A unique task whose dispatch (uniqueness decision included) can wait for commit."""

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> OnCommitDispatch:
        """``delay(*args, **kwargs)`` when the default database's transaction commits."""
        return defer(functools.partial(self.delay, *args, **kwargs))

    def apply_async_on_commit(
        self,
        args: Any = None,
        kwargs: Any = None,
        *,
        using: str | None = None,
        robust: bool = False,
        **options: Any,
    ) -> OnCommitDispatch:
        """``apply_async(args, kwargs, **options)`` when the transaction on ``using`` commits."""
        dispatch = functools.partial(self.apply_async, args, kwargs, **options)
        return defer(dispatch, using=using, robust=robust)
