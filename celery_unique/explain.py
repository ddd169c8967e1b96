"""What a dispatch would do right now, and why, without doing it.

:func:`explain` runs the dispatch path's own planning (the same keys, scope,
window, fingerprint and policy digests ``apply_async`` would compute, with the
same errors for bad input), reads who holds each key, and applies the store's
decision rules to what it read. It writes nothing and publishes nothing.

The verdict is a snapshot: another dispatch, a finishing job or an expiring
key may change the answer before the next real dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.utils import uuid

from celery_unique.config import runtime
from celery_unique.dispatch.apply import take_dispatch_options
from celery_unique.dispatch.planning import plan
from celery_unique.keys.keyspace import shown
from celery_unique.operations import KeyInfo, format_ms, printable
from celery_unique.stores._records import Record, decide
from celery_unique.stores.base import Effect, HeldKey, KeyKind, Scope, Verdict

if TYPE_CHECKING:
    from celery import Task

    from celery_unique.options.declaration import Declaration


@dataclass(frozen=True, slots=True)
class KeyReport:
    """One key a dispatch would claim, and who holds it now."""

    kind: KeyKind
    display_key: str
    storage_key: str
    #: Who holds the key now (``None``: free).
    holder: HeldKey | None
    #: Active keys: how long the dispatch would hold it, and its lease.
    scope: Scope | None = None
    lease_ms: int | None = None
    #: Window keys: the window, and this request's digests.
    window_ms: int | None = None
    fingerprint: str | None = None
    policy: str | None = None

    @property
    def same_request(self) -> bool | None:
        """For a held window key: whether it remembers this very request."""
        if self.kind is not KeyKind.WINDOW or self.holder is None:
            return None
        return self.holder.fingerprint == self.fingerprint

    @property
    def same_policy(self) -> bool | None:
        """For a held window key: whether the retry/time-limit settings match."""
        if self.kind is not KeyKind.WINDOW or self.holder is None:
            return None
        return self.holder.policy == self.policy

    def as_dict(self) -> dict[str, Any]:
        holder = self.holder
        return {
            "kind": self.kind.value,
            "display_key": self.display_key,
            "storage_key": self.storage_key,
            "scope": None if self.scope is None else self.scope.value,
            "lease_ms": self.lease_ms,
            "window_ms": self.window_ms,
            "fingerprint": self.fingerprint,
            "policy": self.policy,
            "holder": None if holder is None else KeyInfo.of(holder).as_dict(),
            "same_request": self.same_request,
            "same_policy": self.same_policy,
        }

    def lines(self) -> list[str]:
        """Human-readable description, one fact per line."""
        if self.kind is KeyKind.ACTIVE:
            assert self.scope is not None
            claim = f"while {self.scope.value}, lease {format_ms(self.lease_ms)}"
        else:
            claim = f"window {format_ms(self.window_ms)}, fingerprint {self.fingerprint}"
        lines = [
            f"{self.kind.value} key:  {shown(self.display_key)}  ({claim})",
            f"  storage key: {printable(self.storage_key)}",
        ]
        holder = self.holder
        if holder is None:
            lines.append("  held by:     nobody")
            return lines
        lines.append(
            f"  held by:     job {holder.job_id} ({holder.task}), {KeyInfo.of(holder).state}, "
            f"expires in {format_ms(holder.expires_in_ms)}"
        )
        follows = KeyInfo.of(holder).duplicates
        if follows:
            lines.append(f"  duplicates:  {follows}")
        if holder.kind is KeyKind.WINDOW:
            request = "same request" if self.same_request else "a DIFFERENT request"
            policy = "same" if self.same_policy else "different (drift)"
            lines.append(f"  remembers:   {holder.fingerprint} ({request}); policy {policy}")
        return lines


@dataclass(frozen=True, slots=True)
class Explanation:
    """What a dispatch would do now: its keys, who holds them, and the verdict."""

    task: str
    #: The store verdict the dispatch would get; ``None`` when it has no keys.
    outcome: Verdict | None
    #: The job the dispatch would resolve to or collide with (``None`` when it creates).
    job_id: str | None
    active: KeyReport | None
    window: KeyReport | None
    policy_drift: bool = False
    conflicting_job_ids: tuple[str, ...] = ()
    #: ``latest``/``debounce``: what the dispatch would do to the job it is handed.
    effect: Effect | None = None

    @property
    def would_create(self) -> bool:
        return self.outcome in (None, Verdict.CREATED)

    @property
    def verdict(self) -> str:
        """The answer in one line."""
        outcome = self.outcome
        if outcome is None:
            return "would create (no uniqueness keys)"
        if outcome is Verdict.CREATED:
            return "would create"
        if outcome is Verdict.REUSED_ACTIVE:
            effect = "" if self.effect is None else f"; {_EFFECTS[self.effect]}"
            return f"would reuse job {self.job_id} (active{effect})"
        if outcome is Verdict.REUSED_WINDOW:
            drift = ", with policy drift" if self.policy_drift else ""
            return f"would reuse job {self.job_id} (window{drift})"
        if outcome is Verdict.CONFLICT:
            return f"would conflict with job {self.job_id}"
        return (
            "would be a composition conflict (window key -> job "
            f"{self.conflicting_job_ids[0]}, active key -> job {self.conflicting_job_ids[-1]})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "verdict": self.verdict,
            "outcome": None if self.outcome is None else self.outcome.value,
            "job_id": self.job_id,
            "policy_drift": self.policy_drift,
            "conflicting_job_ids": list(self.conflicting_job_ids),
            "effect": None if self.effect is None else self.effect.value,
            "active": None if self.active is None else self.active.as_dict(),
            "window": None if self.window is None else self.window.as_dict(),
        }

    def __str__(self) -> str:
        lines = [f"task:    {self.task}", f"verdict: {self.verdict}"]
        for report in (self.active, self.window):
            if report is not None:
                lines += report.lines()
        return "\n".join(lines)


def explain(task: Task[Any, Any], *args: Any, **kwargs: Any) -> Explanation:
    """What ``task.delay(*args, **kwargs)`` would do now; writes nothing."""
    return explain_dispatch(task, args, kwargs)


def explain_dispatch(
    task: Task[Any, Any],
    args: Any = None,
    kwargs: Any = None,
    task_id: str | None = None,
    producer: Any = None,
    link: Any = None,
    link_error: Any = None,
    shadow: str | None = None,
    **options: Any,
) -> Explanation:
    """What ``task.apply_async(args, kwargs, **options)`` would do now; writes nothing.

    Takes exactly ``apply_async``'s arguments, including the per-dispatch
    uniqueness options (``unique_key=...``) and routing/start options
    (``queue=...``, ``countdown=...``) that a window fingerprint covers. Bad
    input raises the same error the dispatch would raise.
    """
    declaration: Declaration | None = getattr(task, "__unique__", None)
    if declaration is None:
        raise TypeError(f"{task.name} is not a UniqueTask: it has no uniqueness to explain")
    options = dict(options)
    overrides = take_dispatch_options(options)
    if not (overrides or declaration.declares_keys):
        return Explanation(task=task.name, outcome=None, job_id=None, active=None, window=None)
    rt = runtime(task.app)
    planned = plan(
        task,
        declaration,
        overrides,
        args,
        kwargs,
        options,
        job_id=task_id or uuid(),
        id_chosen=task_id is not None,
        link=link,
        link_error=link_error,
        rt=rt,
    )
    if planned is None:
        return Explanation(task=task.name, outcome=None, job_id=None, active=None, window=None)
    claim = planned.claim
    held = {key.key: rt.store.get(key.key) for key in (claim.active, claim.window) if key}
    # The store's own rules, on records rebuilt from what was read (clock at 0).
    records = {key: _record(value) for key, value in held.items() if value is not None}
    (decision,), _ = decide([claim], records.get, 0, all_or_nothing=True)
    active = window = None
    if claim.active is not None:
        assert planned.active_key is not None
        active = KeyReport(
            kind=KeyKind.ACTIVE,
            display_key=planned.active_key,
            storage_key=claim.active.key,
            holder=held[claim.active.key],
            scope=claim.active.scope,
            lease_ms=claim.active.lease_ms,
        )
    if claim.window is not None:
        assert planned.window_key is not None
        window = KeyReport(
            kind=KeyKind.WINDOW,
            display_key=planned.window_key,
            storage_key=claim.window.key,
            holder=held[claim.window.key],
            window_ms=claim.window.window_ms,
            fingerprint=claim.window.fingerprint,
            policy=claim.window.policy,
        )
    created = decision.verdict is Verdict.CREATED
    return Explanation(
        task=task.name,
        outcome=decision.verdict,
        job_id=None if created else decision.job_id,
        active=active,
        window=window,
        policy_drift=decision.policy_drift,
        conflicting_job_ids=decision.conflicting_job_ids,
        effect=decision.effect,
    )


_EFFECTS = {
    Effect.ARGUMENTS_REPLACED: "it would run with these arguments",
    Effect.POSTPONED: "its start would move later, and it would run with these arguments",
    Effect.RERUN_REQUESTED: "it runs: one run with these arguments would be owed after it",
}


def _record(held: HeldKey) -> Record:
    return Record(
        job_id=held.job_id,
        task=held.task,
        kind=held.kind,
        scope=held.scope,
        finished=held.finished,
        expires_at=held.expires_in_ms,
        fingerprint=held.fingerprint,
        policy=held.policy,
        since=held.since_ms,
        run=held.run,
        on_duplicate=held.on_duplicate,
        owed=held.owed,
        arguments=held.arguments,
        due=held.starts_in_ms,
    )
