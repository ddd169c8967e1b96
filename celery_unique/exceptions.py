"""Every error celery-unique raises, each with a stable ``code``.

A caller can catch :class:`UniquenessError` and branch on ``.code``; the
subclasses exist so that ``except UniquenessConflict`` reads naturally too.
Facts travel as attributes, never only inside the message.
"""

from __future__ import annotations

from collections.abc import Sequence


class UniquenessError(Exception):
    """Base of every celery-unique error; ``code`` is stable across releases."""

    code: str = "uniqueness_error"
    #: Position of the failing item in a ``dispatch_many`` batch, else ``None``.
    index: int | None = None

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__ or self.code)

    def __reduce__(self) -> tuple[object, ...]:
        # Keep attributes when errors cross process boundaries (result backends, pools).
        return (_rebuild, (type(self), str(self), self.__dict__))


def _rebuild(cls: type[UniquenessError], message: str, state: dict[str, object]) -> UniquenessError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class InvalidKey(UniquenessError):
    """The key is not 1 to 512 bytes of valid, control-free Unicode text."""

    code = "invalid_key"

    def __init__(self, message: str, key: object) -> None:
        super().__init__(message)
        self.key = key


class UniquenessRequired(UniquenessError):
    """A key selector returned None, but the task declares that key as required."""

    code = "uniqueness_required"


class KeySelectorFailed(UniquenessError):
    """A key selector raised; the original exception is the ``__cause__``."""

    code = "key_selector_failed"


class KeyMismatch(UniquenessError):
    """The dispatch passed a key (or window) different from the one the task declares."""

    code = "uniqueness_key_mismatch"


class UniquenessConflict(UniquenessError):
    """The window key is already used by a different request."""

    code = "uniqueness_conflict"

    def __init__(self, message: str, conflicting_job_id: str) -> None:
        super().__init__(message)
        self.conflicting_job_id = conflicting_job_id


class CompositionConflict(UniquenessError):
    """The window key and the active key point at two different jobs."""

    code = "uniqueness_composition_conflict"

    def __init__(self, message: str, conflicting_job_ids: Sequence[str]) -> None:
        super().__init__(message)
        self.conflicting_job_ids = tuple(conflicting_job_ids)


class InvalidWindow(UniquenessError):
    """The window is missing, not positive, not whole milliseconds, or over 3,650 days."""

    code = "invalid_window"


class InvalidPayload(UniquenessError):
    """The task arguments cannot be encoded for hashing."""

    code = "invalid_payload"

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class InvalidSchedule(UniquenessError):
    """The dispatch's ``countdown`` or ``eta`` says no time the job could start at."""

    code = "invalid_schedule"


class BackendUnavailable(UniquenessError):
    """The uniqueness store cannot be reached or refused to work; nothing was published."""

    code = "backend_unavailable"
    #: The request may have reached the store although no answer came back: the
    #: library undoes whatever it may have written, as soon as the store answers.
    maybe_applied: bool = False


class InvalidJobId(UniquenessError):
    """The job id cannot be held exactly by every store (a control character, or not Unicode)."""

    code = "invalid_job_id"

    def __init__(self, message: str, job_id: object) -> None:
        super().__init__(message)
        self.job_id = job_id


class UnsupportedCombination(UniquenessError):
    """Uniqueness cannot be combined with this kind of task or dispatch."""

    code = "unsupported_combination"


class InvalidDeclaration(UniquenessError, ValueError):
    """A task's uniqueness options are malformed (unknown scope, bad type, ...)."""

    code = "invalid_declaration"


class InvalidPath(InvalidDeclaration):
    """A payload path does not follow the path grammar."""

    code = "invalid_path"

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class ImproperlyConfigured(UniquenessError):
    """celery-unique's settings are missing or malformed."""

    code = "improperly_configured"


class InvalidBoolean(ImproperlyConfigured, InvalidDeclaration):
    """A boolean setting or option is neither True/False nor a string that says one."""

    code = "improperly_configured"

    def __init__(self, message: str, setting: str, value: object) -> None:
        super().__init__(message)
        #: The setting or option, as the app or the task names it.
        self.setting = setting
        self.value = value


class StoreRefused(ImproperlyConfigured, BackendUnavailable):
    """The store refuses what its settings ask of it (a database number it does not have,
    an ACL user without a key or command the library needs); nothing was published.

    Coded ``improperly_configured``: waiting does not help, the settings must
    change. A :class:`BackendUnavailable` as well, so that the store's every
    caller treats it as it treats an outage (``unique_fail_open`` applies, a
    release is retried in the background).
    """

    code = "improperly_configured"


class UniquenessWarning(UserWarning):
    """Base of the warnings celery-unique emits when a duplicate changes what a caller holds."""


class CallbacksNotAttached(UniquenessWarning):
    """A reused dispatch carried link/link_error/chain callbacks the existing job will not run."""


class GroupMemberReused(UniquenessWarning):
    """A group member was reused: the group's result for that member will never be ready."""


class EagerOutcomeUnknown(UniquenessError):
    """An eager dispatch reused a job whose outcome this process does not know."""

    code = "eager_outcome_unknown"

    def __init__(self, message: str, job_id: str) -> None:
        super().__init__(message)
        self.job_id = job_id
