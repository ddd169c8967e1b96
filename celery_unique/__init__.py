"""celery-unique: stop duplicate Celery jobs from being created.

Declare keys on a task (``@app.task(base=UniqueTask, unique_key=...)``) or
pass them per dispatch; ``apply_async`` returns the existing job instead of
queueing a duplicate.
"""

from __future__ import annotations

from celery_unique.dispatch.batch import dispatch_many
from celery_unique.exceptions import (
    BackendUnavailable,
    CallbacksNotAttached,
    CompositionConflict,
    EagerOutcomeUnknown,
    GroupMemberReused,
    ImproperlyConfigured,
    InvalidDeclaration,
    InvalidJobId,
    InvalidKey,
    InvalidPath,
    InvalidPayload,
    InvalidSchedule,
    InvalidWindow,
    KeyMismatch,
    KeySelectorFailed,
    UniquenessConflict,
    UniquenessError,
    UniquenessRequired,
    UniquenessWarning,
    UnsupportedCombination,
)
from celery_unique.install import install
from celery_unique.keys.payload import Payload
from celery_unique.receipt import Disposition, DuplicateMatch, UniqueResult
from celery_unique.stores.base import Scope
from celery_unique.task import UniqueMixin, UniqueTask, UniqueWhile

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "CallbacksNotAttached",
    "CompositionConflict",
    "Disposition",
    "DuplicateMatch",
    "EagerOutcomeUnknown",
    "GroupMemberReused",
    "ImproperlyConfigured",
    "InvalidDeclaration",
    "InvalidJobId",
    "InvalidKey",
    "InvalidPath",
    "InvalidPayload",
    "InvalidSchedule",
    "InvalidWindow",
    "KeyMismatch",
    "KeySelectorFailed",
    "Payload",
    "Scope",
    "UniqueMixin",
    "UniqueResult",
    "UniqueTask",
    "UniqueWhile",
    "UniquenessConflict",
    "UniquenessError",
    "UniquenessRequired",
    "UniquenessWarning",
    "UnsupportedCombination",
    "dispatch_many",
    "install",
]
