"""Publishing while the store decides: the store's round trip overlaps message building.

A unique dispatch sends its decision request to the store, then lets Celery
route the task and build the broker message as usual, handing it a stand-in
producer. The first time Celery touches the producer (right before it
publishes, and before ``before_task_publish`` fires) the stand-in reads the
store's answer: a created job is published through a real producer; anything
else stops the publish by raising :class:`NotPublished`, which never leaves
this module's caller. Nothing is ever published before the store said so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_unique.config import Runtime
from celery_unique.exceptions import BackendUnavailable
from celery_unique.stores.base import Decision, PendingDecisions, Verdict

logger = logging.getLogger("celery_unique")


class NotPublished(Exception):
    """Raised through Celery's publish path when the store's answer is not "created"."""


def tolerate_outage(rt: Runtime, error: BackendUnavailable) -> bool:
    """Whether to publish without uniqueness (fail-open); warns once per outage."""
    if not rt.fail_open:
        return False
    if not rt.outage:
        rt.outage = True
        logger.warning(
            "uniqueness store unreachable, publishing without uniqueness (fail-open): %s", error
        )
    return True


def store_answered(rt: Runtime) -> None:
    if rt.outage:
        rt.outage = False
        logger.warning("uniqueness store reachable again; uniqueness restored")


class DeferredProducer:
    """Stands in for a kombu producer until Celery first needs one.

    Then it reads the store's decision: a created job gets the real producer
    (the caller's, or one from the app's pool, released by :meth:`close`).
    """

    def __init__(self, app: Celery, given: Any, pending: PendingDecisions, rt: Runtime) -> None:
        self._app, self._given, self._pending, self._rt = app, given, pending, rt
        self._real: Any = None
        self._context: Any = None
        self.decision: Decision | None = None
        self.resolved = False

    def resolve(self) -> None:
        """Read the decision; raise :class:`NotPublished` unless the job is to be published."""
        if self.resolved:
            return
        # Resolved once, whatever happens: an answer cannot be read twice.
        self.resolved = True
        try:
            self.decision = self._pending.wait()[0]
        except BackendUnavailable as error:
            if not tolerate_outage(self._rt, error):
                raise
        else:
            store_answered(self._rt)
        if self.decision is not None and not self.decision.verdict.publishes:
            raise NotPublished

    def _producer(self) -> Any:
        if self._real is None:
            self.resolve()
            if self._given is not None:
                self._real = self._given
            else:
                self._context = self._app.producer_or_acquire(None)
                self._real = self._context.__enter__()
        return self._real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer(), name)

    def close(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def created(self) -> bool:
        """After a failed publish: did the store create this job (so it must be undone)?"""
        try:
            self.resolve()
        except (NotPublished, BackendUnavailable):
            return False
        return self.decision is not None and self.decision.verdict is Verdict.CREATED


def publish_deciding(
    app: Celery,
    rt: Runtime,
    pending: PendingDecisions,
    given_producer: Any,
    publish: Callable[[Any], Any],
    on_not_published: Callable[[Decision], Any],
    on_failed_publish: Callable[[], None],
    on_created: Callable[[], None] | None = None,
) -> Any:
    """Run ``publish(producer)`` with a stand-in producer; dispatch on the store's answer."""
    producer = DeferredProducer(app, given_producer, pending, rt)
    try:
        result = publish(producer)
        producer.resolve()  # normally read already; never leave an answer unread
    except NotPublished:
        assert producer.decision is not None
        return on_not_published(producer.decision)
    except BaseException:
        if producer.created():
            on_failed_publish()
        raise
    finally:
        producer.close()
    decision = producer.decision
    if on_created is not None and decision is not None and decision.verdict is Verdict.CREATED:
        on_created()
    return result
