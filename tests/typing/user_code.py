"""User code as a type checker sees it: receipts and options are typed (``mypy --strict``).

Checked by ``scripts/test`` (the ``mypy`` step) and run by
``tests/unit/test_typing.py``; it must never need a ``type: ignore``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from celery import Celery, Task

from celery_unique import (
    Disposition,
    DuplicateMatch,
    Payload,
    UniqueMixin,
    UniquenessConflict,
    UniqueResult,
    UniqueTask,
    UniqueWhile,
    dispatch_many,
)

app = Celery("typed", broker="memory://", set_as_current=False)
app.conf.unique_backend = "memory://"


@app.task(base=UniqueTask, unique_key=lambda job: f"tenant:{job.tenant_id}", unique_while="active")
def recalculate(tenant_id: int) -> int:
    return tenant_id


@app.task(
    base=UniqueTask,
    unique_window_key=Payload(only=[".request_id"]),
    unique_window=timedelta(days=1),
)
def place_order(cart_id: str, request_id: str) -> None:
    return None


def dispatch_and_read_the_receipt() -> tuple[Disposition, bool, DuplicateMatch | None, bool]:
    receipt: UniqueResult = recalculate.delay(7)
    again = recalculate.apply_async((7,), unique_while="active")
    assert again.id == receipt.id
    return receipt.disposition, again.duplicate, again.duplicate_match, again.policy_drift


def handle_a_conflict() -> str | None:
    place_order.delay("cart-1", request_id="R-1")
    try:
        place_order.delay("cart-2", request_id="R-1")
    except UniquenessConflict as error:
        job: str = error.conflicting_job_id
        return job
    return None


def many() -> list[str]:
    outcomes = dispatch_many([recalculate.s(n) for n in range(3)])
    return [o.code if isinstance(o, Exception) else o.disposition.value for o in outcomes]


if TYPE_CHECKING:
    BaseTask = Task[Any, Any]
else:  # Task is subscriptable at run time only from Celery 5.7.
    BaseTask = Task


class ProjectTask(BaseTask):
    """A project's own base class, made unique by the mixin."""

    abstract = True


class UniqueProjectTask(UniqueMixin, ProjectTask):
    abstract = True


SCOPE: UniqueWhile = "exists"


@app.task(base=UniqueProjectTask, unique_key="nightly", unique_while=SCOPE)
def nightly() -> None:
    return None


def dispatch_a_mixin_task() -> Disposition:
    receipt: UniqueResult = nightly.delay()
    return receipt.disposition
