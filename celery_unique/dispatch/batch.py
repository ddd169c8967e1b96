"""``dispatch_many``: many dispatches, one store round trip, one producer connection.

Items behave as if dispatched one after another in input order (the store
decides the batch with sequential semantics). Every item is planned before
the store is asked, so bad input anywhere fails the batch with nothing
written; a conflict fails the whole batch too unless ``continue_on_conflict``.

Where the store and a Redis broker share a server, the batch is one round
trip in all: every message is built first, and the script that decides the
batch pushes the created jobs' messages (:mod:`celery_unique.dispatch.colocated`).
Elsewhere the store decides the batch, then kombu publishes the created
jobs' messages in one pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from celery import Celery, Task
from celery.canvas import Signature, maybe_signature
from celery.utils import uuid

from celery_unique import signals
from celery_unique.config import Runtime, runtime
from celery_unique.dispatch import colocated
from celery_unique.dispatch.apply import (
    as_sent,
    created_receipt,
    reused,
    rollback,
    take_dispatch_options,
    unsubscribe,
    verdict_error,
    with_header,
)
from celery_unique.dispatch.gate import Gate, gated, store_answered, tolerate_outage
from celery_unique.dispatch.planning import Plan, plan
from celery_unique.dispatch.publishing import install_gate
from celery_unique.exceptions import BackendUnavailable, UniquenessError, UnsupportedCombination
from celery_unique.options.declaration import DISPATCH_OPTIONS
from celery_unique.receipt import UniqueResult, stamp
from celery_unique.stores.base import Decision, Verdict

Outcome = UniqueResult | UniquenessError

#: kombu's publish batch flushes once it buffered this many transport commands.
_NO_PARTIAL_FLUSH = 2**31 - 1


@dataclass
class _Item:
    index: int
    task: Task[Any, Any]
    args: Any
    kwargs: Any
    options: dict[str, Any]
    job_id: str
    link: Any
    link_error: Any
    plan: Plan | None = None
    decision: Decision | None = None
    outcome: Outcome | None = None

    @property
    def app(self) -> Celery:
        return self.task.app

    @property
    def result(self) -> Outcome:
        assert self.outcome is not None, "every item is published, reused or failed"
        return self.outcome


def dispatch_many(
    signatures: Iterable[Signature[Any] | dict[str, Any]], continue_on_conflict: bool = False
) -> list[Outcome]:
    """Dispatch every signature; return one result per item, in input order.

    Without ``continue_on_conflict`` any failing item raises its error (with
    ``.index``) and nothing is written or published. With it, a failing item's
    slot holds its error and the other items proceed.
    """
    entries: list[_Item | UniquenessError] = []
    for index, signature in enumerate(signatures):
        try:
            entries.append(_prepare(index, _signature(signature)))
        except UniquenessError as error:
            error.index = index
            if not continue_on_conflict:
                raise
            entries.append(error)

    items = [entry for entry in entries if isinstance(entry, _Item)]
    if not _decide_with_messages(items, continue_on_conflict):
        _decide(items, continue_on_conflict)
        _publish(items)
    return [entry if isinstance(entry, UniquenessError) else entry.result for entry in entries]


def _signature(value: Signature[Any] | dict[str, Any]) -> Signature[Any]:
    signature = maybe_signature(value)
    if not isinstance(signature, Signature) or not signature.task:
        raise TypeError(f"dispatch_many takes task signatures, not {value!r}")
    return signature


def _prepare(index: int, signature: Signature[Any]) -> _Item:
    app = signature.app
    options = dict(signature.options)
    name = str(signature.task)
    task = app.tasks.get(name)
    if task is None:
        if any(option in options for option in DISPATCH_OPTIONS):
            raise UnsupportedCombination(
                f"item {index}: task {name!r} is not registered in this process, "
                "so its uniqueness options cannot be applied"
            )
        task = app.tasks[name]  # KeyError, as Celery itself would raise
    overrides = take_dispatch_options(options)
    chosen = options.pop("task_id", None)
    job_id = chosen or uuid()
    link, link_error = options.pop("link", None), options.pop("link_error", None)
    args, kwargs = as_sent(task, signature.args, signature.kwargs, options)
    item = _Item(index, task, args, kwargs, options, job_id, link, link_error)
    declaration = getattr(task, "__unique__", None)
    if declaration is not None and (overrides or declaration.declares_keys):
        item.plan = plan(
            task,
            declaration,
            overrides,
            item.args,
            item.kwargs,
            options,
            job_id=job_id,
            id_chosen=chosen is not None,
            link=link,
            link_error=link_error,
            rt=runtime(app),
        )
    elif overrides:
        raise UnsupportedCombination(
            f"item {index}: {task.name} is not a UniqueTask; its uniqueness options would be "
            "ignored"
        )
    return item


def _decide(items: Sequence[_Item], continue_on_conflict: bool) -> None:
    """One store round trip per store (in practice: one) for every planned item."""
    by_store: dict[int, tuple[Runtime, list[_Item]]] = {}
    for item in items:
        if item.plan is not None:
            rt = runtime(item.app)
            by_store.setdefault(id(rt.store), (rt, []))[1].append(item)
    for rt, planned in by_store.values():
        try:
            decisions = rt.store.decide(
                [item.plan.claim for item in planned],  # type: ignore[union-attr]
                all_or_nothing=not continue_on_conflict,
            )
        except BackendUnavailable as outage:
            if not tolerate_outage(rt, outage):
                raise
            for item in planned:
                item.plan = None  # publish without uniqueness, as a single dispatch would
            continue
        store_answered(rt)
        for item, decision in zip(planned, decisions, strict=True):
            item.decision = decision
    _fail_refused(items, continue_on_conflict)


def _fail_refused(items: Sequence[_Item], continue_on_conflict: bool) -> None:
    for item in items:
        if item.plan is None or item.decision is None:
            continue
        error = verdict_error(item.task, item.plan, item.decision)
        if error is not None:
            error.index = item.index
            if not continue_on_conflict:
                raise error
            item.outcome = error


def _decide_with_messages(items: Sequence[_Item], continue_on_conflict: bool) -> bool:
    """Store and broker on one Redis server: one script decides every item and enqueues
    the messages of those it created; ``False`` where that cannot be exact (nothing sent).

    Every message is built first, as kombu would push it; a duplicate's is dropped.
    """
    planned = [item for item in items if item.plan is not None]
    if not planned or any(item.app is not items[0].app for item in items):
        return False
    app = items[0].app
    rt = runtime(app)
    if not colocated.suits_batch(app, rt):
        return False
    from celery_unique.stores.redis import Enqueued, script_parts  # a Redis store, then

    if len(script_parts([item.plan.claim for item in planned])) > 1:  # type: ignore[union-attr]
        # Too large for one script: decided in parts, so the messages of an early
        # part could not be taken back if a later one is refused.
        return False

    install_gate(app)
    sent: dict[int, Any] = {}
    messages: list[Enqueued] = []
    with app.producer_or_acquire() as producer:
        db = colocated.broker_db(producer.channel, rt)
        if db is None:
            return False  # a channel the script cannot push to: asked first
        positions = {id(item): n for n, item in enumerate(planned, 1)}
        try:
            for item in items:
                with colocated.capturing() as captured:
                    sent[item.index] = _send(item, producer)
                claim = positions.get(id(item), 0)
                messages += [Enqueued(claim, queue, message) for queue, message in captured]
        except colocated.Uncapturable:
            # Asked first instead; the messages built so far subscribed to their jobs,
            # which only those published keep.
            for item in items:  # the item kombu refused subscribed too; later ones did not
                unsubscribe(app, item.job_id)
            return False
        try:
            decisions = rt.store.decide_enqueue_many(  # type: ignore[attr-defined]
                [item.plan.claim for item in planned],  # type: ignore[union-attr]
                not continue_on_conflict,
                db,
                messages,
            )
        except BackendUnavailable as outage:
            # A lost reply: the jobs and their messages exist together, or neither does.
            if outage.maybe_applied:
                raise
            if not tolerate_outage(rt, outage):
                for item in items:
                    unsubscribe(app, item.job_id)
                raise
            return False  # asked again, and published without uniqueness
    store_answered(rt)
    for item, decision in zip(planned, decisions, strict=True):
        item.decision = decision
    _unsubscribe_unpublished(app, items, continue_on_conflict)
    _fail_refused(items, continue_on_conflict)
    for item in items:
        if item.outcome is None:
            _settle(item, sent[item.index])
    return True


def _unsubscribe_unpublished(app: Any, items: Sequence[_Item], continue_on_conflict: bool) -> None:
    """Every message of a batch decided as it leaves was built by Celery's ``apply_async``,
    which subscribed to its job's result: a job the store did not enqueue is subscribed
    to no more (see :func:`~celery_unique.dispatch.apply.unsubscribe`)."""
    decided = [item.decision for item in items if item.decision is not None]
    refused = not continue_on_conflict and any(d.verdict.failed for d in decided)
    for item in items:
        decision = item.decision
        if decision is not None and not decision.verdict.publishes:
            if decision.job_id != item.job_id:  # a job of its own id holds the key: keep
                unsubscribe(app, item.job_id)
        elif refused:
            unsubscribe(app, item.job_id)


def _publish(items: Sequence[_Item]) -> None:
    """Publish created items in order, pipelined per app; hand back the rest.

    Where the transport supports it (kombu's ``Producer.batch``), the messages
    leave in one pipeline when the batch closes. If anything fails before
    they are known to be out, every created item's keys are rolled back: a
    key must never stay held for a job that was not published.
    """
    pipelined: list[Any] = []
    position = 0
    try:
        with ExitStack() as stack:
            producers: dict[int, Any] = {}
            for position, item in enumerate(items):  # noqa: B007 - read after a failure
                if item.outcome is not None:
                    continue
                decision = item.decision
                if item.plan is not None and decision and not decision.verdict.publishes:
                    _settle(item, None)
                    continue
                if id(item.app) not in producers:
                    producer = stack.enter_context(item.app.producer_or_acquire())
                    if hasattr(producer, "batch"):  # kombu >= 5.6
                        # Never flushed part-way (kombu counts transport commands, not
                        # messages): all of the batch goes out at its end, or none.
                        pipelined.append(stack.enter_context(producer.batch(_NO_PARTIAL_FLUSH)))
                    producers[id(item.app)] = producer
                gate: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
                if item.plan is not None:
                    install_gate(item.app)
                    # Decided already: the gate lets the job out (or, eagerly, run).
                    gate = gated(
                        Gate(item.job_id, runtime(item.app), item.plan.header, decision=decision)
                    )
                with gate:
                    result = _send(item, producers[id(item.app)])
                _settle(item, result)
    except BaseException:
        sent_one_by_one = all(getattr(b.state, "immediate", False) for b in pipelined)
        _roll_back_unpublished(items[position:] if sent_one_by_one else items)
        raise


def _send(item: _Item, producer: Any) -> Any:
    """Celery's own ``apply_async`` of the item (its decision is made, or travels with it)."""
    options = item.options
    if item.plan is not None:
        options = with_header(options, item.plan.header)
        if item.plan.countdown_s is not None:
            options = {**options, "countdown": item.plan.countdown_s}
    return Task.apply_async(
        item.task,
        item.args,
        item.kwargs,
        task_id=item.job_id,
        producer=producer,
        link=item.link,
        link_error=item.link_error,
        **options,
    )


def _settle(item: _Item, result: Any) -> None:
    """The item's outcome, once the store decided it and a created job's message left."""
    plan, decision = item.plan, item.decision
    if plan is None:
        item.outcome = stamp(result)
    elif decision is not None and not decision.verdict.publishes:
        callbacks = bool(item.link or item.link_error or item.options.get("chain"))
        item.outcome = reused(item.task, plan, decision, callbacks=callbacks)
    else:
        item.outcome = created_receipt(result, plan, decision)
        signals.emit_created(item.task, plan)


def _roll_back_unpublished(items: Sequence[_Item]) -> None:
    """Free the keys of created items whose messages may not have left."""
    for item in items:
        decision = item.decision
        if item.plan is not None and decision is not None and decision.verdict is Verdict.CREATED:
            rollback(runtime(item.app), item.plan.claim)
