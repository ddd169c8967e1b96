"""The gate a job passes where it would leave: the store's answer for it, read once.

A dispatch opens a gate for its job before Celery publishes; wherever the
message would leave (the broker, the co-located path, an eager run) the gate
is passed, and only a "created" decision lets the job out. A gate whose
decision failed stays failed: a publish retried by kombu cannot pass it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from celery_unique.config import Runtime
from celery_unique.dispatch.headers import KeyHeader
from celery_unique.exceptions import BackendUnavailable
from celery_unique.stores.base import Claim, Decision, PendingDecisions, Verdict

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
            "uniqueness store unavailable, publishing without uniqueness (fail-open): %s", error
        )
    return True


def store_answered(rt: Runtime) -> None:
    if rt.outage:
        rt.outage = False
        logger.warning("uniqueness store reachable again; uniqueness restored")


class Gate:
    """The store's answer for one job, read once, where the job would leave."""

    def __init__(
        self,
        job_id: str,
        rt: Runtime,
        header: KeyHeader | None,
        pending: PendingDecisions | None = None,
        decision: Decision | None = None,
        *,
        claim: Claim | None = None,
    ) -> None:
        self.job_id, self.rt, self.header, self._pending = job_id, rt, header, pending
        self.decision = decision
        #: Not asked yet: the store is asked as the message leaves (:mod:`colocated`).
        self.claim = claim
        self.resolved = pending is None and claim is None
        #: Why the decision failed, if it did: raised again wherever the job would
        #: leave, so that a retried publish can never pass a gate that has no decision.
        self.failure: BaseException | None = None
        #: Whether the job really went out through a gate (the broker or an eager run).
        self.passed = False
        #: Whether the store pushed the message itself, with its decision.
        self.enqueued = False
        self.outer: Gate | None = None

    def resolve(self, ask: Callable[[], Decision] | None = None) -> Decision | None:
        """The decision (``None``: store down, fail-open); :class:`NotPublished` unless created.

        ``ask`` asks the store now, for a gate whose question was not sent yet.
        """
        if not self.resolved:
            # Resolved once, whatever happens: an answer cannot be read twice.
            self.resolved = True
            try:
                self.decision = self._answer(ask)
            except BackendUnavailable as error:
                if not tolerate_outage(self.rt, error):
                    self.failure = error
                    raise
            except BaseException as error:
                self.failure = error
                raise
            else:
                store_answered(self.rt)
        if self.failure is not None:
            raise self.failure
        if self.decision is not None and not self.decision.verdict.publishes:
            raise NotPublished
        return self.decision

    def let_out(self, ask: Callable[[], Decision] | None = None) -> Decision | None:
        """:meth:`resolve`, and note that the job goes out through this gate."""
        decision = self.resolve(ask)
        self.passed = True
        return decision

    def _answer(self, ask: Callable[[], Decision] | None) -> Decision:
        if self._pending is not None:
            return self._pending.wait()[0]
        if ask is not None:
            return ask()
        assert self.claim is not None
        return self.rt.store.decide([self.claim])[0]

    def created(self) -> bool:
        """After a failed publish: did the store create this job (so it must be undone)?"""
        if not self.resolved and self._pending is None:
            self.resolved = True  # never asked: the failure came before the message left
            return False
        if self.failure is not None:
            return False
        try:
            self.resolve()
        except (NotPublished, BackendUnavailable):
            return False
        return self.decision is not None and self.decision.verdict is Verdict.CREATED


_gates: ContextVar[Gate | None] = ContextVar("celery_unique_gates", default=None)


@contextmanager
def gated(gate: Gate) -> Iterator[Gate]:
    """Make ``gate`` the one its job passes while the block publishes (or runs) it."""
    gate.outer = _gates.get()
    token = _gates.set(gate)
    try:
        yield gate
    finally:
        _gates.reset(token)


def gate_for(job_id: str | None) -> Gate | None:
    """The open gate of ``job_id`` in this context (dispatches may nest), if any."""
    gate = _gates.get()
    while gate is not None and gate.job_id != job_id:
        gate = gate.outer
    return gate


def pass_gate(job_id: str | None) -> Gate | None:
    """Let ``job_id`` out only if its store answer says so; ``None`` when it has no gate."""
    gate = gate_for(job_id)
    if gate is not None:
        gate.let_out()
    return gate
