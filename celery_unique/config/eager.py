"""Eager runs (``task_always_eager``, ``.apply()``): what a reused eager dispatch hands back.

A duplicate dispatched eagerly runs nothing; its receipt is an ``EagerResult``
of the job holding the key, as a worker-backed receipt is the holder's
``AsyncResult``. The outcome of every job run eagerly is remembered per app
runtime (the most recent :data:`REMEMBERED` of them), so the receipt carries
the holder's state and value when the holder ran here; when it did not (it
is still running, it ran in another process, or it was forgotten) the
receipt says so instead of waiting for a value that will never come.
"""

from __future__ import annotations

import inspect
import threading
from collections import OrderedDict
from typing import Any

from celery import states
from celery.result import EagerResult

from celery_unique.exceptions import EagerOutcomeUnknown

#: How many eager outcomes a runtime remembers (the oldest are forgotten first).
REMEMBERED = 10_000


class EagerRuns:
    """The outcomes of the jobs run eagerly in this process, by job id."""

    def __init__(self, size: int = REMEMBERED) -> None:
        self._size = size
        self._outcomes: OrderedDict[str, EagerResult[Any]] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, result: Any) -> None:
        """Remember ``result`` if it is the ``EagerResult`` of a finished run."""
        if not isinstance(result, EagerResult):
            return
        with self._lock:
            self._outcomes[result.id] = result
            self._outcomes.move_to_end(result.id)
            while len(self._outcomes) > self._size:
                self._outcomes.popitem(last=False)

    def result_of(self, job_id: str, task_name: str | None = None) -> EagerResult[Any]:
        """A new ``EagerResult`` of ``job_id``: its outcome if it ran here, else one saying not."""
        with self._lock:
            ran = self._outcomes.get(job_id)
        if ran is None:
            return _eager(OutcomeUnknown, job_id, None, states.PENDING, None, task_name)
        # A copy: the holder's own receipt must keep its own stamp.
        # (celery-types call the traceback a TracebackType; Celery keeps the text.)
        traceback: Any = ran.traceback
        return _eager(EagerResult, job_id, ran.result, ran.state, traceback, ran.name)


#: Whether this Celery's ``EagerResult`` takes its task's name (5.3.1 and later).
_TAKES_NAME = "name" in inspect.signature(EagerResult.__init__).parameters


def _eager(
    cls: type[EagerResult[Any]],
    job_id: str,
    value: Any,
    state: str,
    traceback: Any,
    name: str | None,
) -> EagerResult[Any]:
    if _TAKES_NAME:
        return cls(job_id, value, state, traceback, name=name)
    return cls(job_id, value, state, traceback)  # Celery 5.3.0: no name to give


class OutcomeUnknown(EagerResult):  # type: ignore[type-arg]
    """An eager receipt for a holder whose outcome is not known in this process.

    Its state is ``PENDING``; ``get()`` raises :class:`EagerOutcomeUnknown`
    rather than returning ``None`` as Celery's ``EagerResult`` would.
    """

    def get(
        self, timeout: float | None = None, propagate: bool = True, *args: Any, **kwargs: Any
    ) -> Any:
        raise EagerOutcomeUnknown(
            f"job {self.id} holds the key this eager dispatch reused, but it did not finish "
            "an eager run in this process (it is still running, or ran elsewhere): its "
            "outcome is not known here",
            self.id,
        )

    wait = get
