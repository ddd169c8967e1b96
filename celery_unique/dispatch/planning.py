"""Planning a dispatch: everything it will ask of the store, computed before touching it.

:func:`plan` runs the steps in the order their refusals must come (every bad
option is refused before the store is asked or anything is published):
parse what the dispatch gives, choose the prefix, bind the arguments, choose
the keys, the scope, the window and the duplicate policy, plan the start,
then build the claims and the message header.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from celery_unique.config import Runtime
from celery_unique.config.durations import parse_window
from celery_unique.dispatch.headers import VERSION, KeyHeader, read_header
from celery_unique.exceptions import (
    InvalidSchedule,
    InvalidWindow,
    KeyMismatch,
    UnsupportedCombination,
)
from celery_unique.keys import keyspace
from celery_unique.keys.arguments import ArgumentView, json_payload
from celery_unique.keys.fingerprint import policy_digest, request_fingerprint
from celery_unique.options.declaration import (
    Declaration,
    KeySpec,
    parse_prefix,
    parse_scope,
)
from celery_unique.options.duplicates import (
    DuplicatePolicy,
    encode_arguments,
    parse_policy,
)
from celery_unique.stores.base import (
    ActiveClaim,
    Claim,
    OnDuplicate,
    Scope,
    WindowClaim,
)

if TYPE_CHECKING:
    from celery import Task


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a dispatch asks of the store, computed before touching it."""

    claim: Claim
    header: KeyHeader
    #: Keys as users read them, for messages and logs.
    active_key: str | None
    window_key: str | None
    #: ``debounce``: the countdown the created job is published with.
    countdown_s: float | None = None


def plan(
    task: Task[Any, Any],
    declaration: Declaration,
    overrides: Mapping[str, Any],
    args: Any,
    kwargs: Any,
    options: Mapping[str, Any],
    *,
    job_id: str,
    id_chosen: bool = True,
    link: Any = None,
    link_error: Any = None,
    rt: Runtime,
) -> Plan | None:
    """The claim and header for one dispatch, or ``None`` when it has no keys.

    ``id_chosen``: the job id came with the dispatch (a caller's ``task_id``, a
    frozen signature's), so another dispatch may share it; the claim then gets a
    generation of its own. So does a claim that follows its duplicates (latest,
    debounce): its id may come to hold the key as the run another job owes, and
    undoing its own decision must not take that. Else an id made here needs none.

    Nothing here writes: every fault of the dispatch is found before the store or
    the broker is touched. One with several faults is told of the first in the
    order of these steps.
    """
    given = _parse_given(overrides)
    prefix = _choose_prefix(task, declaration, given.prefix)
    if not _has_keys(declaration, given):
        return None
    _refuse_chord_member(task, options)
    keyspace.validate_job_id(job_id)
    arguments = _bind_arguments(declaration, args, kwargs)
    keys = _choose_keys(task, declaration, given, prefix, arguments, rt)
    scope = _choose_scope(task, declaration, given.scope)
    window_ms = _choose_window(task, declaration, given.window_ms, keys.window is not None)
    duplicates = _choose_duplicates(task, declaration, overrides)
    duplicates.check_keys(
        has_active_key=keys.active is not None, has_window_key=keys.window is not None, scope=scope
    )
    wait_ms = waiting_ms(options)

    header: KeyHeader = {"v": VERSION}
    active = window = None
    countdown_s = None
    if keys.active is not None:
        start = _plan_start(duplicates, options, wait_ms)
        active = _active_claim(
            task, keys.active, scope, duplicates, start, args, kwargs, id_chosen=id_chosen, rt=rt
        )
        header.update(_active_header(task, declaration, active, duplicates, rt))
        countdown_s = start.countdown_s
    if keys.window is not None:
        assert window_ms is not None
        header["w"] = keys.window.stored
        window = _window_claim(
            task, keys, scope, window_ms, arguments, options, link=link, link_error=link_error
        )
    return Plan(
        claim=Claim(
            job_id=job_id,
            task=task.name,
            active=active,
            window=window,
            handoff_from=_handoff_from(task, active),
        ),
        header=header,
        active_key=keys.active.shown if keys.active else None,
        window_key=keys.window.shown if keys.window else None,
        countdown_s=countdown_s,
    )


@dataclass(frozen=True, slots=True)
class _Given:
    """The uniqueness options one dispatch gives, parsed; ``None`` where it gives none.

    Its duplicate policy is parsed later, over the declared one
    (:func:`_choose_duplicates`).
    """

    key: KeySpec | None
    window_key: KeySpec | None
    window_ms: int | None
    scope: Scope | None
    prefix: bool | None


def _parse_given(overrides: Mapping[str, Any]) -> _Given:
    """The dispatch's key, window, scope and prefix options, checked; a bad one raises."""
    key = KeySpec.parse(overrides.get("unique_key"), "unique_key")
    window_key = KeySpec.parse(overrides.get("unique_window_key"), "unique_window_key")
    raw_window = overrides.get("unique_window")
    window_ms = None if raw_window is None else parse_window(raw_window)
    # Given as None, these are refused, not taken as "the declared one".
    scope = parse_scope(overrides["unique_while"]) if "unique_while" in overrides else None
    prefix = parse_prefix(overrides["unique_prefix"]) if "unique_prefix" in overrides else None
    return _Given(key, window_key, window_ms, scope, prefix)


def _choose_prefix(task: Task[Any, Any], declaration: Declaration, given: bool | None) -> bool:
    """Whether the dispatch's keys are scoped to the task name.

    A task that declares its keys keeps their scoping unless it is overridable:
    another prefix would move its keys away from the declared ones.
    """
    prefix = declaration.prefix if given is None else given
    if prefix != declaration.prefix and declaration.declares_keys and not declaration.overridable:
        raise KeyMismatch(
            f"unique_prefix={prefix} given to {task.name} differs from the declared "
            f"unique_prefix={declaration.prefix}"
        )
    return prefix


def _has_keys(declaration: Declaration, given: _Given) -> bool:
    """Whether the dispatch has a key to claim; without one it is a plain dispatch."""
    return declaration.declares_keys or given.key is not None or given.window_key is not None


def _refuse_chord_member(task: Task[Any, Any], options: Mapping[str, Any]) -> None:
    """A chord waits for every header member: one deduplicated away would never come."""
    if options.get("chord"):
        raise UnsupportedCombination(
            f"{task.name} is unique and a chord header member: if it were deduplicated the "
            "chord would wait for it forever. Deduplicate the chord as a whole instead."
        )


class _Arguments:
    """A dispatch's arguments bound to its task's signature.

    Selectors read ``view``; the JSON payload is built on first use, once: only a
    payload key or a window fingerprint needs it, and encoding is the costly part.
    """

    __slots__ = ("_payload", "bound", "view")

    def __init__(self, bound: dict[str, Any]) -> None:
        self.bound = bound
        self.view = ArgumentView(bound)
        self._payload: dict[str, Any] | None = None

    def payload(self) -> dict[str, Any]:
        if self._payload is None:
            self._payload = json_payload(self.bound)
        return self._payload


def _bind_arguments(declaration: Declaration, args: Any, kwargs: Any) -> _Arguments:
    """The arguments by parameter name, defaults applied; ``TypeError`` if they do not bind.

    A task whose signature is unknown is seen through its keyword arguments only.
    """
    if declaration.binder is None:
        return _Arguments(dict(kwargs or {}))
    return _Arguments(declaration.binder.bind(tuple(args or ()), dict(kwargs or {})))


class _Key(NamedTuple):
    """One of a dispatch's keys."""

    #: As the store keeps it.
    stored: str
    #: As users read it, in messages and logs.
    shown: str


class _Keys(NamedTuple):
    active: _Key | None
    window: _Key | None


def _choose_keys(
    task: Task[Any, Any],
    declaration: Declaration,
    given: _Given,
    prefix: bool,
    arguments: _Arguments,
    rt: Runtime,
) -> _Keys:
    """The dispatch's active and window keys, each declared or given."""
    active = _choose_key(
        task,
        declaration,
        declaration.key,
        given.key,
        keyspace.ACTIVE,
        "unique_key",
        prefix=prefix,
        arguments=arguments,
        rt=rt,
    )
    window = _choose_key(
        task,
        declaration,
        declaration.window_key,
        given.window_key,
        keyspace.WINDOW,
        "unique_window_key",
        prefix=prefix,
        arguments=arguments,
        rt=rt,
    )
    _refuse_split_slots(task, active, window)
    return _Keys(active, window)


def _choose_key(
    task: Task[Any, Any],
    declaration: Declaration,
    declared: KeySpec | None,
    given: KeySpec | None,
    kind: str,
    option: str,
    *,
    prefix: bool,
    arguments: _Arguments,
    rt: Runtime,
) -> _Key | None:
    """The key of one kind: the given one where the task allows it, else the declared one."""

    def place(spec: KeySpec) -> _Key:
        return _place_key(task, declaration, spec, kind, option, prefix, arguments, rt)

    if given is None:
        return None if declared is None else place(declared)
    if declared is None or declaration.overridable:
        return place(given)
    # A declared key always applies: a dispatch may only repeat it.
    mine, theirs = place(declared), place(given)
    if mine != theirs:
        raise KeyMismatch(
            f"{option} {theirs.shown!r} given to {task.name} differs from the declared "
            f"key {mine.shown!r}; declare unique_overridable=True to allow replacing it"
        )
    return mine


def _place_key(
    task: Task[Any, Any],
    declaration: Declaration,
    spec: KeySpec,
    kind: str,
    option: str,
    prefix: bool,
    arguments: _Arguments,
    rt: Runtime,
) -> _Key:
    """``spec`` worked out for this dispatch (the key rules checked), and where it is stored."""
    key = spec.resolve(option, arguments.view, arguments.payload)
    scope = "" if spec.unscoped or not prefix else task.name
    tag = _spread_tag(declaration, scope, key, rt)
    return _Key(
        keyspace.storage_key(rt.namespace, kind, scope, key, tag=tag),
        keyspace.display_key(scope, key),
    )


def _spread_tag(declaration: Declaration, scope: str, key: str, rt: Runtime) -> str | None:
    """The hash tag of a key scoped to a task under ``unique_key_spread='key'``; else
    ``None``: the namespace's.

    Both keys of one dispatch must share a hash slot, so a task that declares a
    window key spreads its keys by task, any other task by key.
    """
    if not (rt.spread_keys and scope):
        return None
    if declaration.window_key is not None:
        return keyspace.task_tag(scope)
    return keyspace.key_tag(scope, key)


def _refuse_split_slots(task: Task[Any, Any], active: _Key | None, window: _Key | None) -> None:
    """The store decides both keys of a dispatch in one step, which Redis Cluster allows
    only for keys in one hash slot."""
    if active and window and keyspace.hash_tag(active.stored) != keyspace.hash_tag(window.stored):
        raise UnsupportedCombination(
            f"{task.name} is given an active key and a window key that would sit in two "
            "hash slots (unique_key_spread='key'): a task decides both kinds at once only "
            "if it declares its unique_window_key, and either both keys are scoped to it "
            "or neither is"
        )


def _choose_scope(task: Task[Any, Any], declaration: Declaration, given: Scope | None) -> Scope:
    """How long the active key is held: the given scope, unless the task declares its key
    and is not overridable."""
    declared = declaration.scope
    if given is None:
        return declared
    if declaration.key is not None and not declaration.overridable and given != declared:
        raise KeyMismatch(
            f"unique_while={given.value!r} given to {task.name} differs from the "
            f"declared {declared.value!r}"
        )
    return given


def _choose_window(
    task: Task[Any, Any], declaration: Declaration, given: int | None, has_window_key: bool
) -> int | None:
    """How long the window key maps to the job: the given window, unless the task declares
    its window key and is not overridable."""
    declared = declaration.window_ms
    locked = declaration.window_key is not None and not declaration.overridable
    if locked and declared is not None and given is not None and given != declared:
        raise KeyMismatch(
            f"unique_window of {given} ms given to {task.name} differs from the declared "
            f"{declared} ms"
        )
    window = given if given is not None else declared
    if has_window_key and window is None:
        raise InvalidWindow("unique_window_key needs unique_window: a window has no default")
    return window


def _choose_duplicates(
    task: Task[Any, Any], declaration: Declaration, overrides: Mapping[str, Any]
) -> DuplicatePolicy:
    """What a duplicate does to the job: the dispatch's policy over the declared one, which
    a task that declares its keys keeps unless it is overridable."""
    declared = declaration.duplicates
    given = parse_policy(overrides, base=declared)
    if given != declared and declaration.declares_keys and not declaration.overridable:
        raise KeyMismatch(
            f"unique_on_duplicate/unique_debounce given to {task.name} differ from the "
            f"declared {declared.on_duplicate.value!r}; declare unique_overridable=True to "
            "allow choosing them per dispatch"
        )
    return given


def waiting_ms(options: Mapping[str, Any]) -> int:
    """How long the job waits before it may run (countdown/eta): its lease covers that.

    :class:`InvalidSchedule` for a countdown or eta that names no time (checked
    before anything is written: Celery would fail to build the message after).
    """
    countdown = options.get("countdown")
    if countdown is not None:
        return max(0, round(_seconds(countdown) * 1000))
    eta = options.get("eta")
    if eta is None:
        return 0
    if isinstance(eta, str):
        try:
            eta = datetime.fromisoformat(eta)
        except ValueError:
            raise InvalidSchedule(f"eta {eta!r} is not an ISO 8601 date and time") from None
    if not isinstance(eta, datetime):
        raise InvalidSchedule(f"eta must be a datetime, not {type(eta).__name__} {eta!r}")
    now = datetime.now(eta.tzinfo) if eta.tzinfo else datetime.now()
    return max(0, round((eta - now).total_seconds() * 1000))


def _seconds(countdown: object) -> float:
    """A countdown as Celery can schedule it: a finite number of seconds."""
    if isinstance(countdown, int | float) and not isinstance(countdown, bool):
        try:
            timedelta(seconds=countdown)  # what Celery adds to now
        except (OverflowError, ValueError):
            pass
        else:
            return float(countdown)
    raise InvalidSchedule(
        f"countdown must be a finite number of seconds Celery can add to now, not {countdown!r}"
    )


@dataclass(frozen=True, slots=True)
class _Start:
    """When a created job may start, as its active claim and its message say."""

    #: The debounce the store plans the job's start with.
    debounce_ms: int | None
    #: How long the job may wait before it runs: its lease covers that much more.
    wait_ms: int
    #: The countdown the job is published with.
    countdown_s: float | None


def _plan_start(duplicates: DuplicatePolicy, options: Mapping[str, Any], wait_ms: int) -> _Start:
    """The start of a job that waits ``wait_ms`` (its countdown/eta), debounced if its
    policy says so."""
    debounce = duplicates.debounce_ms
    if debounce is None or duplicates.on_duplicate is not OnDuplicate.DEBOUNCE:
        return _Start(debounce, wait_ms, None)
    # Published without a start of its own, the job waits out its debounce.
    countdown_s = debounce / 1000 if not wait_ms and options.get("eta") is None else None
    # A job published with a longer countdown/eta cannot start sooner: the store
    # plans its start (and every receipt names it) no earlier.
    debounce = max(debounce, wait_ms)
    # The lease covers the latest start a duplicate can move the job to.
    wait_ms = max(wait_ms, duplicates.debounce_max_ms or debounce)
    return _Start(debounce, wait_ms, countdown_s)


def _active_claim(
    task: Task[Any, Any],
    key: _Key,
    scope: Scope,
    duplicates: DuplicatePolicy,
    start: _Start,
    args: Any,
    kwargs: Any,
    *,
    id_chosen: bool,
    rt: Runtime,
) -> ActiveClaim:
    """What the dispatch asks of the store for its active key."""
    return ActiveClaim(
        key=key.stored,
        scope=scope,
        lease_ms=_lease_ms(rt, start.wait_ms),
        on_duplicate=duplicates.on_duplicate,
        arguments=_arguments_to_keep(task, args, kwargs, duplicates, key.stored, rt),
        debounce_ms=start.debounce_ms,
        debounce_max_ms=duplicates.debounce_max_ms,
        generation=_generation(duplicates, id_chosen=id_chosen),
    )


def _lease_ms(rt: Runtime, wait_ms: int) -> int | None:
    """The lease of a job that may wait ``wait_ms`` before it runs; ``None``: no lease.

    The lease runs from the dispatch: a job that waits for its start must not
    lose its key while it waits.
    """
    return None if rt.lease_ms is None else rt.lease_ms + wait_ms


def _arguments_to_keep(
    task: Task[Any, Any],
    args: Any,
    kwargs: Any,
    duplicates: DuplicatePolicy,
    storage_key: str,
    rt: Runtime,
) -> str | None:
    """The arguments a ``latest``/``debounce`` key keeps: the holder runs with the last
    duplicate's, so each dispatch leaves its own. ``None`` for ``reuse``."""
    if not duplicates.follows:
        return None
    return encode_arguments(
        task,
        args,
        kwargs,
        duplicates.latest_max_bytes,
        storage_key=storage_key,
        signing_key=rt.signing_key,
    )


def _generation(duplicates: DuplicatePolicy, *, id_chosen: bool) -> str | None:
    """The claim's own generation, where its job id may hold the key another way (see
    :func:`plan`); ``None`` for an id made for this dispatch alone."""
    return next_generation() if id_chosen or duplicates.follows else None


def _active_header(
    task: Task[Any, Any],
    declaration: Declaration,
    claim: ActiveClaim,
    duplicates: DuplicatePolicy,
    rt: Runtime,
) -> KeyHeader:
    """What the job's message says of its active key: what its worker releases, when, and
    (``latest``/``debounce``) whose run its duplicates are owed."""
    header: KeyHeader = {}
    if duplicates.follows:
        header["p"], header["t"] = duplicates.on_duplicate.code, task.name
    header["a"], header["s"] = claim.key, claim.scope.value
    if claim.generation is not None:
        header["g"] = claim.generation
    if claim.scope is Scope.EXISTS:
        header["r"] = _retention_ms(declaration, rt)
    return header


def _retention_ms(declaration: Declaration, rt: Runtime) -> int | None:
    """How long an ``exists`` key outlives its job: as declared, else the app's
    ``result_expires`` (for as long as the job's result is remembered)."""
    if declaration.retention_ms is not None:
        return declaration.retention_ms
    return rt.default_retention_ms


def _window_claim(
    task: Task[Any, Any],
    keys: _Keys,
    scope: Scope,
    window_ms: int,
    arguments: _Arguments,
    options: Mapping[str, Any],
    *,
    link: Any,
    link_error: Any,
) -> WindowClaim:
    """What the dispatch asks of the store for its window key: the request's fingerprint,
    to tell a repeat of it from another request, and its retry/time-limit settings."""
    assert keys.window is not None
    return WindowClaim(
        key=keys.window.stored,
        window_ms=window_ms,
        fingerprint=request_fingerprint(
            task_name=task.name,
            payload=arguments.payload(),
            options=options,
            keys=_fingerprinted_keys(keys, scope, window_ms),
            headers=options.get("headers"),
            link=link,
            link_error=link_error,
            chain=options.get("chain"),
        ),
        policy=policy_digest(task, options),
    )


def _fingerprinted_keys(keys: _Keys, scope: Scope, window_ms: int) -> dict[str, Any]:
    """The keys as a window fingerprint covers them: a request naming other keys, another
    scope or another window is another request."""
    assert keys.window is not None
    return {
        "active": keys.active.stored if keys.active else None,
        "scope": scope.value if keys.active else None,
        "window": keys.window.stored,
        "window_ms": window_ms,
    }


def _handoff_from(task: Task[Any, Any], claim: ActiveClaim | None) -> str | None:
    """The running job that passes its active key on to this dispatch, if any.

    A ``queued`` key is freed as its job starts: a running job holds none to pass on.
    """
    if claim is None or claim.scope is Scope.QUEUED:
        return None
    return _running_holder(task, claim.key)


def _running_holder(task: Task[Any, Any], active_key: str) -> str | None:
    """The running job that holds ``active_key``, when it dispatches its own successor.

    Only a job of the same task hands its key on (a chain to itself, a job that
    re-enqueues itself); any other dispatch meeting the key is a duplicate.
    """
    current = task.app.current_worker_task
    if current is None or current.name != task.name:
        return None
    header = read_header(current.request)
    if header is not None and header.get("a") == active_key:
        job_id: str | None = current.request.id
        return job_id
    return None


class _Generations:
    """Tokens no other dispatch of a job id shares: a random prefix per process (drawn
    again in a forked child), then a count. Cheaper than a uuid per dispatch."""

    def __init__(self) -> None:
        self.restart()
        os.register_at_fork(after_in_child=self.restart)

    def restart(self) -> None:
        self.prefix = secrets.token_hex(6)
        self.count = itertools.count()

    def next(self) -> str:
        return f"{self.prefix}{next(self.count):x}"


_generations = _Generations()


def next_generation() -> str:
    """A new dispatch's generation (see :attr:`ActiveClaim.generation`)."""
    return _generations.next()
