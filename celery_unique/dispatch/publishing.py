"""The publish gate: nothing reaches the broker, or runs eagerly, before the store said "created".

A unique dispatch sends its decision request to the store, then lets Celery
route the task and build the message as usual while the store works. The
answer is read at the gate, which every way out of Celery passes:

* Celery's ``amqp.send_task_message``, through which every task message goes
  to the broker whatever producer or connection Celery was given, is wrapped
  once per app: it reads the answer for the message's job id before anything
  is sent (and before ``before_task_publish`` fires);
* ``UniqueTask.apply`` reads it before running a job eagerly
  (``task_always_eager``: Celery's ``apply_async`` runs ``apply()``);
* the stand-in producer handed to Celery reads it the first time Celery
  touches it, which spares a reused dispatch the work of taking a real
  producer from the pool.

Whichever comes first reads the answer; the others find it read. An answer
other than "created" stops the dispatch with :class:`NotPublished`, which
never leaves this package.

When the store and the broker share a Redis server, the question is not sent
ahead: the gate at ``send_task_message`` arms the producer's channel, and the
store is asked where kombu would push the message, with the message
(:mod:`celery_unique.dispatch.colocated`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from celery import Celery
from kombu import Queue
from kombu.common import Broadcast

from celery_unique.dispatch import colocated, resend
from celery_unique.dispatch.gate import Gate, NotPublished, gate_for, gated, pass_gate
from celery_unique.stores.base import Decision

logger = logging.getLogger("celery_unique")


_install_lock = threading.Lock()


def install_gate(app: Celery) -> None:
    """Wrap the app's ``amqp.send_task_message`` with the gate (once per app)."""
    amqp = app.amqp
    if getattr(amqp, "_celery_unique_gate", False):
        return
    with _install_lock:
        if getattr(amqp, "_celery_unique_gate", False):
            return
        send = amqp.send_task_message

        def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> Any:
            job_id = _job_id(message)
            gate = gate_for(job_id)
            # Asked as the message leaves: the decision travels with it.
            armed = gate is not None and not gate.resolved and gate.claim is not None
            unique = armed or pass_gate(job_id) is not None or colocated.capturing_now()
            if unique:
                _declared_already(amqp, producer, options)
            resend.observe(job_id, message.headers)

            def publish() -> Any:
                return send(producer, name, message, **options)

            with colocated.unique_message(producer) if unique else nullcontext():
                if armed and gate is not None:
                    result = colocated.send_armed(gate, producer, publish)
                else:
                    result = publish()
            resend.handed_over(job_id)
            return result

        amqp.send_task_message = send_task_message  # type: ignore[misc]
        amqp._celery_unique_gate = True  # type: ignore[attr-defined]


def _declared_already(amqp: Any, producer: Any, options: dict[str, Any]) -> None:
    """Tell Celery not to declare a unique job's queue when the connection has.

    Celery asks kombu to declare the queue with every publish, and kombu copies
    the queue and binds the copy to the channel before it finds the queue in
    the connection's cache of declared entities and does nothing. This is
    kombu's own test, made first: a connection that reconnected has an empty
    cache, and declares again.
    """
    queue = options.get("queue")
    if options.get("declare") is not None or queue is None:
        return
    if isinstance(queue, str):
        queue = amqp.queues.get(queue)
    if not isinstance(queue, Queue) or isinstance(queue, Broadcast):
        return
    try:
        declared = producer.channel.connection.client.declared_entities
    except AttributeError:  # a channel without a connection: kombu will say so
        return
    if queue.can_cache_declaration and hash(queue) in declared:
        options["declare"] = []


def _job_id(message: Any) -> str | None:
    headers = getattr(message, "headers", None) or {}
    job_id = headers.get("id")
    if job_id is None:  # task protocol 1 keeps it in the body
        body = getattr(message, "body", None)
        job_id = body.get("id") if isinstance(body, dict) else None
    return job_id if isinstance(job_id, str) else None


class DeferredProducer:
    """Stands in for a kombu producer until Celery first needs one.

    Then it passes the gate: a created job gets the real producer (the
    caller's, or one from the app's pool, released by :meth:`close`). A gate
    whose question travels with the message is passed later, at the put.
    """

    def __init__(self, app: Celery, given: Any, gate: Gate) -> None:
        self._app, self._given, self._gate = app, given, gate
        self._real: Any = None
        self._context: Any = None

    def _producer(self) -> Any:
        if self._real is None:
            if self._gate.claim is None:
                self._gate.resolve()
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


def publish_deciding(
    app: Celery,
    gate: Gate,
    given_producer: Any,
    publish: Callable[[Any], Any],
    on_not_published: Callable[[Decision], Any],
    on_failed_publish: Callable[[], None],
    on_created: Callable[[], None] | None = None,
) -> Any:
    """Run ``publish(producer)`` behind ``gate``; dispatch on the store's answer."""
    producer = DeferredProducer(app, given_producer, gate)
    try:
        with gated(gate):
            result = publish(producer)
        gate.resolve()  # normally read already; never leave an answer unread
    except NotPublished:
        assert gate.decision is not None
        if gate.passed:
            # Cannot happen: the gate raises instead of letting the job through.
            raise
        return on_not_published(gate.decision)
    except BaseException:
        # A message the store pushed itself stays with its key: the job exists.
        if gate.created() and not gate.enqueued:
            on_failed_publish()
        raise
    finally:
        producer.close()
    if not gate.passed and gate.decision is not None:
        # Celery sent the job by a way that bypasses every gate: the job went out
        # although its answer was read only now. A bug to see, not to accept.
        logger.error(
            "job %s of %s was sent without passing the uniqueness gate (answer: %s); "
            "please report this with your Celery version",
            gate.job_id,
            app.main,
            gate.decision.verdict.value,
        )
    if on_created is not None and gate.decision is not None and gate.created():
        on_created()
    return result
