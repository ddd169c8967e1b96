"""``UniqueTask``: a Celery task class whose dispatches are deduplicated."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from celery import Task, chord, group
from celery.canvas import Signature, _chain
from celery.exceptions import Ignore, Retry
from celery.result import AsyncResult

from celery_unique.checks.at_dispatch import check_first_dispatch
from celery_unique.dispatch import resend
from celery_unique.dispatch.apply import apply_unique
from celery_unique.dispatch.headers import HEADER, read_header
from celery_unique.dispatch.publishing import install_gate
from celery_unique.explain import Explanation, explain
from celery_unique.install import install
from celery_unique.keys.keyspace import validate_task_name
from celery_unique.options.declaration import Declaration
from celery_unique.options.duplicates import DEFAULT_LATEST_MAX_BYTES
from celery_unique.receipt import UniqueResult
from celery_unique.worker import runs
from celery_unique.worker.fates import Replaced
from celery_unique.worker.limits import hold_to_the_end, soft_limit_held_back

logger = logging.getLogger("celery_unique")
if TYPE_CHECKING:
    _Task = Task[Any, Any]
    _MixinBase = _Task
else:
    # Subscriptable at run time only from Celery 5.7.
    _Task = Task
    # The mixin adds no base at run time, so it composes with any task class.
    _MixinBase = object

#: How long an active key is held.
UniqueWhile = Literal["queued", "active", "exists"]
#: What a duplicate does to the job holding the key.
OnDuplicateName = Literal["reuse", "latest", "debounce"]


def _replaced_then(job_id: str | None, exc: Exception) -> Replaced:
    """How a run whose replacement left ends when ``exc`` was raised after the send."""
    logger.warning("job %s is replaced: %r was raised after its replacement was sent", job_id, exc)
    return Replaced(f"replaced; then {exc!r}")


def _retried_then(job_id: str | None, exc: Exception) -> Retry:
    """How a run whose next attempt left ends when ``exc`` was raised after the send."""
    logger.warning("job %s is retried: %r was raised after its next attempt was sent", job_id, exc)
    return Retry(f"retried; then {exc!r}", exc=exc)


#: Set on a job's request once ``replace()`` or ``retry()`` sent the job on: how
#: the run ends if the body raises after that.
_SENT_ON = "celery_unique_sent_on"


@contextmanager
def _carrying_on(
    task: Any, eager: bool, then: Callable[[str | None, Exception], Exception]
) -> Iterator[None]:
    """Around the send of the message that carries ``task``'s job on under its id
    (``replace()``, ``retry()``), in the pool child running it.

    Before the send, the key is marked as handed over to that message, so that
    whatever ends the run after it left (a hard time limit while the send waits
    on the broker) leaves the key to it. The soft time limit is held back over
    the send (struck in between, it would fail a job another message carries
    on), and to the end of the run once the message left (see
    :mod:`celery_unique.worker.limits`); if it strikes while the store marks the
    hand-over, the run fails and its end takes the mark back (see
    :mod:`celery_unique.worker.fates`). An error raised once the message left
    ends the run as ``then`` says (replaced, retried), and so does any error the
    body raises afterwards (see ``__call__``); one raised before the send takes
    the mark back.
    """
    request = task.request
    # The gate counts what leaves; a pool child that never dispatched a unique
    # job has not installed it yet.
    install_gate(task.app)
    undo = None if eager else runs.hand_over(task)
    with resend.counting_sends() as sent:
        try:
            with nullcontext() if eager else soft_limit_held_back():
                try:
                    yield
                finally:
                    if sent and not eager:
                        hold_to_the_end()
        except (Replaced, Retry):
            if not eager:
                setattr(request, _SENT_ON, then)
            raise
        except Exception as exc:
            if not sent or eager:
                if undo is not None:
                    undo()
                raise
            setattr(request, _SENT_ON, then)
            raise then(request.id, exc) from exc
    if sent and not eager:
        setattr(request, _SENT_ON, then)


class UniqueMixin(_MixinBase):
    """Uniqueness for a task class of your own: ``class MyTask(UniqueMixin, Base)``.

    Put it first among the bases, so that its ``apply_async`` decides before
    the base class (Celery's ``DjangoTask``, a project's ``task_cls``) publishes;
    the base's own ``apply_async`` is what finally sends the message.
    """

    #: Active-type key: a literal, a selector ``(view) -> str`` or ``Payload(...)``.
    unique_key: Any = None
    #: How long the active key is held: "queued", "active" or "exists".
    unique_while: UniqueWhile = "queued"
    #: For "exists": how long the key outlives the job (default: ``result_expires``).
    unique_retention: Any = None
    #: Window key: a literal, a selector or ``Payload(...)``.
    unique_window_key: Any = None
    #: The window's length (timedelta or seconds); required with a window key.
    unique_window: Any = None
    #: Scope keys to the task name (True) or share them across the app (False).
    unique_prefix: bool = True
    #: Let a dispatch replace the declared key (and scope, window, policy).
    unique_overridable: bool = False
    #: What a duplicate does to the job holding the active key: "reuse" (nothing),
    #: "latest" (its arguments win; one run is owed if the job runs) or "debounce".
    unique_on_duplicate: OnDuplicateName = "reuse"
    #: "debounce": the job starts this long after the last duplicate (timedelta or seconds)...
    unique_debounce: Any = None
    #: ...but never later than this long after the first dispatch (default: no cap).
    unique_debounce_max: Any = None
    #: "latest"/"debounce": the largest arguments a key keeps (encoded bytes).
    unique_latest_max_bytes: int = DEFAULT_LATEST_MAX_BYTES

    __unique__: ClassVar[Declaration]

    #: Marks its key before its body runs (see :mod:`celery_unique.worker.runs`).
    _marks_runs: ClassVar[bool] = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request_stack.top
        in_worker = request is not None and not request.called_directly
        try:
            return self._run_marked(request, in_worker, args, kwargs)
        finally:
            if in_worker:
                runs.body_ended(request)
                if not request.is_eager:
                    # How the run ended is decided: a soft time limit must not change
                    # it. (Run eagerly, in another task's body, that task's run goes on,
                    # and its limit with it.)
                    hold_to_the_end()

    def _run_marked(self, request: Any, in_worker: bool, args: Any, kwargs: Any) -> Any:
        try:
            begun = runs.begin(self)
        except runs.StoreSilent as silent:
            raise runs.defer(self, silent) from None
        stop = runs.stop_before_body(self, begun)
        if stop is not None:
            raise stop
        latest = None if begun.arguments is None else runs.latest_arguments(self, begun.arguments)
        if latest is not None:
            args, kwargs = tuple(latest[0]), latest[1]
        try:
            if in_worker:
                # The worker's tracer has already pushed this job's request. Before
                # Celery 5.7, Task.__call__ would push an empty one over it, and the
                # body would see no task id; the tracer calls ``run`` itself for a
                # task without a custom ``__call__``, so do the same.
                return self.run(*args, **kwargs)
            return super().__call__(*args, **kwargs)
        except (Replaced, Retry):
            raise
        except Exception as exc:
            # The body went on after replace() or retry() sent the job on (a
            # ``finally`` that raised, a soft time limit): that message carries the
            # job all the same.
            went_on = None if request is None else getattr(request, _SENT_ON, None)
            if went_on is None:
                raise
            raise went_on(request.id, exc) from exc

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Checked when the class is created, i.e. when the task is defined.
        validate_task_name(inspect.getattr_static(cls, "name", None))
        cls.__unique__ = Declaration.from_class(cls)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        super().on_bound(app)
        install(app)

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> UniqueResult:
        """Celery's ``apply_async``, deduplicated: publishes a new job or hands back the holder.

        Takes the ``unique_*`` options per dispatch too (see the declaration
        attributes); returns the receipt either way.
        """
        check_first_dispatch(self)

        def send(args: Any, kwargs: Any, **opts: Any) -> AsyncResult[Any]:
            return super(UniqueMixin, self).apply_async(args, kwargs, shadow=shadow, **opts)

        return apply_unique(
            self, send, args, kwargs, task_id, link, link_error, options, producer=producer
        )

    def delay(self, *args: Any, **kwargs: Any) -> UniqueResult:
        """``apply_async(args, kwargs)``: a dispatch, deduplicated; returns its receipt."""
        return self.apply_async(args, kwargs)

    def on_replace(self, sig: Any) -> Any:
        """Hand the job's keys to the replacement, which carries the job on under its id.

        Whatever its task class, the message that inherits the job's id (the
        replacement, or the last task of a replacement chain) carries the key
        header, so the end of that message releases the keys.
        """
        header = read_header(self.request)
        job_id = self.request.id
        if header is not None and job_id is not None:
            carrier = _carrying(sig, job_id)
            if carrier is not None:
                headers = dict(carrier.options.get("headers") or {})
                headers[HEADER] = {**header, "j": job_id}
                carrier.options["headers"] = headers
        with _carrying_on(self, self.request.is_eager, _replaced_then):
            try:
                return super().on_replace(sig)
            except Ignore as ended:
                # The worker's main process learns from this that the job goes on.
                raise Replaced(*ended.args) from None

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry()``, the job's keys handed to the attempt it sends.

        Marked as handed over before the send (as for ``replace()``): whatever
        ends this run once the next attempt has left (an error raised after
        ``retry()``, a time limit), the keys stay with that attempt.
        """
        request = self.request
        with _carrying_on(self, request.is_eager or request.called_directly, _retried_then):
            return super().retry(*args, **kwargs)

    def unique_explain(self, *args: Any, **kwargs: Any) -> Explanation:
        """What ``self.delay(*args, **kwargs)`` would do now, and why; writes nothing."""
        return explain(self, *args, **kwargs)

    def apply(
        self,
        args: Any = None,
        kwargs: Any = None,
        link: Any = None,
        link_error: Any = None,
        task_id: str | None = None,
        retries: int | None = None,
        throw: bool | None = None,
        logfile: str | None = None,
        loglevel: str | None = None,
        headers: Any = None,
        **options: Any,
    ) -> Any:
        """Run eagerly, with the same uniqueness as a dispatch (``.apply()``, eager mode)."""

        def run(args: Any, kwargs: Any, **opts: Any) -> Any:
            return super(UniqueMixin, self).apply(args, kwargs, **opts)

        options.update(retries=retries, throw=throw, logfile=logfile, loglevel=loglevel)
        if headers is not None:
            options["headers"] = headers
        return apply_unique(
            self, run, args, kwargs, task_id, link, link_error, options, publishes=False
        )


UniqueMixin.__unique__ = Declaration()


class UniqueTask(UniqueMixin, _Task):
    """A task whose dispatches are deduplicated by the keys it declares or is given.

    With no uniqueness options it behaves exactly like a plain task (and its
    results are still receipts: :class:`~celery_unique.UniqueResult`).
    """

    #: Follows what becomes of each message, to release keys at the right time.
    Request = "celery_unique.worker.fates:UniqueRequest"


UniqueTask.__unique__ = Declaration()


def _carrying(sig: Any, job_id: str) -> Signature[Any] | None:
    """The signature in ``sig`` whose message will carry ``job_id``, if any.

    ``replace()`` freezes the replacement with the job's id: a single task
    takes it, a chain gives it to its last task, a chord to its body.
    """
    if isinstance(sig, _chain):
        tasks = list(sig.tasks)
        return _carrying(tasks[-1], job_id) if tasks else None
    if isinstance(sig, chord):
        return _carrying(sig.body, job_id)
    if isinstance(sig, group):
        return None
    if isinstance(sig, Signature) and sig.options.get("task_id") == job_id:
        return sig
    return None
