"""A consumer bootstep: every task a worker runs gets requests that follow their message's fate.

``UniqueTask`` declares its request class itself. Other tasks can carry a
job's keys too (the replacement of a unique job, the last task of a
replacement chain), so when the worker builds its task strategies it mixes
:class:`~celery_unique.worker.fates.FateMixin` into every task's request
class (keeping any custom class a task declares); a request whose message
carries no key header costs one dictionary lookup.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.utils.imports import symbol_by_name

from celery_unique.worker.fates import with_fates


def follow_fates(app: Any) -> None:
    """Give every task of ``app`` a request class that follows its message's fate."""
    for task in list(app.tasks.values()):
        request_class = symbol_by_name(task.Request)
        mixed = with_fates(request_class)
        if mixed is not request_class:
            task.Request = mixed


class FollowFates(bootsteps.Step):
    """Runs before the consumer builds its strategies (at start and on every reload)."""

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        super().__init__(consumer, **kwargs)
        update = consumer.update_strategies

        def update_strategies() -> Any:
            follow_fates(consumer.app)
            return update()

        consumer.update_strategies = update_strategies
