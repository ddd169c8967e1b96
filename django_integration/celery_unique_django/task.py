"""``UniqueDjangoTask``: a :class:`~celery_unique.UniqueTask` that is Celery's ``DjangoTask``.

Celery (5.4+) gives Django projects ``delay_on_commit`` and
``apply_async_on_commit`` on its ``celery.contrib.django.task.DjangoTask``, the
default task class of an app with Celery's Django fixup; a task declared with
``base=UniqueTask`` does not inherit them. This class is both: a subclass of
``DjangoTask`` (of Celery's ``Task`` on Celery 5.3, which has none), whose two
methods dispatch when the transaction commits as Celery documents, deciding
uniqueness then too, and return an
:class:`~celery_unique_django.on_commit.OnCommitDispatch` where Celery's return
``None``::

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
from typing import TYPE_CHECKING, Any

from celery_unique import UniqueTask
from celery_unique_django.on_commit import OnCommitDispatch, defer

if TYPE_CHECKING:
    from celery.contrib.django.task import DjangoTask
else:
    try:
        from celery.contrib.django.task import DjangoTask
    except ImportError:  # Celery 5.3: no DjangoTask to compose with.
        from celery import Task as DjangoTask


class UniqueDjangoTask(UniqueTask, DjangoTask):  # type: ignore[type-arg]
    """A unique task whose dispatch (uniqueness decision included) can wait for commit."""

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> OnCommitDispatch:  # type: ignore[override]
        """``delay(*args, **kwargs)`` when the default database's transaction commits."""
        return defer(functools.partial(self.delay, *args, **kwargs))

    def apply_async_on_commit(  # type: ignore[override]
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
