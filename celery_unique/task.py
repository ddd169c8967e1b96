"""``UniqueTask``: a Celery task class whose dispatches are deduplicated."""

from __future__ import annotations

from typing import Any, ClassVar

from celery import Task
from celery.result import AsyncResult

from celery_unique.declaration import Declaration
from celery_unique.dispatch import apply_unique
from celery_unique.explain import Explanation, explain
from celery_unique.install import install


class UniqueTask(Task):  # type: ignore[type-arg]
    """A task whose dispatches are deduplicated by the keys it declares or is given.

    With no uniqueness options it behaves exactly like a plain task (and its
    results still carry the receipt attributes).
    """

    #: Active-type key: a literal, a selector ``(view) -> str`` or ``Payload(...)``.
    unique_key: Any = None
    #: How long the active key is held: "queued", "active" or "exists".
    unique_while: str = "queued"
    #: For "exists": how long the key outlives the job (default: ``result_expires``).
    unique_retention: Any = None
    #: Window key: a literal, a selector or ``Payload(...)``.
    unique_window_key: Any = None
    #: The window's length (timedelta or seconds); required with a window key.
    unique_window: Any = None
    #: Scope keys to the task name (True) or share them across the app (False).
    unique_prefix: bool = True
    #: Let a dispatch replace the declared key.
    unique_overridable: bool = False

    __unique__: ClassVar[Declaration]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Checked when the class is created, i.e. when the task is defined.
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
    ) -> AsyncResult[Any]:
        def send(args: Any, kwargs: Any, **opts: Any) -> AsyncResult[Any]:
            return super(UniqueTask, self).apply_async(args, kwargs, shadow=shadow, **opts)

        return apply_unique(
            self, send, args, kwargs, task_id, link, link_error, options, producer=producer
        )

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
            return super(UniqueTask, self).apply(args, kwargs, **opts)

        options.update(retries=retries, throw=throw, logfile=logfile, loglevel=loglevel)
        if headers is not None:
            options["headers"] = headers
        return apply_unique(
            self, run, args, kwargs, task_id, link, link_error, options, publishes=False
        )


UniqueTask.__unique__ = Declaration()
