"""What a dispatch reports back, on the ``AsyncResult`` it returns."""

from __future__ import annotations

import enum
import threading
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from celery.result import AsyncResult


class Disposition(str, enum.Enum):
    """Whether a dispatch created a job or handed back an existing one."""

    CREATED = "created"
    REUSED = "reused"


class DuplicateMatch(str, enum.Enum):
    """Which key found the existing job."""

    ACTIVE = "active"
    WINDOW = "window"


if TYPE_CHECKING:
    _Result = AsyncResult[Any]
else:
    # Subscriptable at run time only from Celery 5.7.
    _Result = AsyncResult


class UniqueResult(_Result):
    """The result of a dispatch through a :class:`~celery_unique.UniqueTask`: a receipt.

    It is the ``AsyncResult`` Celery would have returned (the app's own result
    class, or an ``EagerResult`` for an eager run), with what the dispatch did:

    * ``disposition``: :attr:`Disposition.CREATED` or :attr:`Disposition.REUSED`;
    * ``duplicate``: ``disposition is Disposition.REUSED``;
    * ``duplicate_match``: which key found the existing job (``None`` if created);
    * ``policy_drift``: the existing job's key was written with other options;
    * ``callbacks_dropped``: this dispatch's callbacks are not attached to the
      job it was handed (an active-key match on a job queued without them);
    * ``arguments_replaced`` (``latest``/``debounce``): the job it was handed has
      not started and will run with this dispatch's arguments;
    * ``rerun_requested`` (``latest``/``debounce``): the job it was handed runs;
      one run with the latest duplicate's arguments follows it;
    * ``postponed_to`` (``debounce``): when the job is planned to start (an
      aware UTC datetime), for the dispatch that created it and for each
      duplicate that moved it; ``None`` otherwise.

    Pickled (or sent to another process), it is the plain result again.
    """

    disposition: Disposition
    duplicate: bool
    duplicate_match: DuplicateMatch | None
    policy_drift: bool
    callbacks_dropped: bool
    arguments_replaced: bool
    rerun_requested: bool
    postponed_to: datetime | None
    #: The result class this receipt class extends (set on each generated class).
    _celery_class: ClassVar[type[AsyncResult[Any]]]

    def __reduce__(self) -> tuple[Any, ...]:
        # The generated classes are not importable: reduce as the plain result.
        reduced = self._celery_class.__reduce__(self)
        assert isinstance(reduced, tuple)
        if reduced and reduced[0] is type(self):
            return (self._celery_class, *reduced[1:])
        return reduced


_receipt_classes: dict[type[Any], type[UniqueResult]] = {}
_receipt_classes_lock = threading.Lock()


def _receipt_class(cls: type[Any]) -> type[UniqueResult]:
    """``UniqueResult`` mixed into ``cls`` (an app-bound ``AsyncResult``, an ``EagerResult``)."""
    found = _receipt_classes.get(cls)
    if found is None:
        with _receipt_classes_lock:
            found = _receipt_classes.get(cls)
            if found is None:
                found = type(
                    f"Unique{cls.__name__}",
                    (UniqueResult, cls),
                    {"__module__": __name__, "_celery_class": cls},
                )
                _receipt_classes[cls] = found
    return found


def stamp(
    result: AsyncResult[Any],
    disposition: Disposition = Disposition.CREATED,
    match: DuplicateMatch | None = None,
    *,
    policy_drift: bool = False,
    callbacks_dropped: bool = False,
    arguments_replaced: bool = False,
    rerun_requested: bool = False,
    postponed_to: datetime | None = None,
) -> UniqueResult:
    """Turn Celery's result into a receipt; every dispatch through a UniqueTask gets one."""
    if not isinstance(result, UniqueResult):
        result.__class__ = _receipt_class(type(result))
    assert isinstance(result, UniqueResult)
    result.disposition = disposition
    result.duplicate = disposition is Disposition.REUSED
    result.duplicate_match = match
    result.policy_drift = policy_drift
    result.callbacks_dropped = callbacks_dropped
    result.arguments_replaced = arguments_replaced
    result.rerun_requested = rerun_requested
    result.postponed_to = postponed_to
    return result
