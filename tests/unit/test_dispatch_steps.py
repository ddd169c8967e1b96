"""The steps of :func:`celery_unique.dispatch.planning.plan`, one at a time, then their order.

Each step is given its inputs directly (a declaration parsed here, a runtime
that has no store); what a whole dispatch does with the plan is in
``tests/unit/test_dispatch.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
from celery import Celery

from celery_unique.config import Runtime
from celery_unique.dispatch import planning
from celery_unique.dispatch.headers import HEADER, VERSION
from celery_unique.exceptions import (
    InvalidBoolean,
    InvalidDeclaration,
    InvalidJobId,
    InvalidKey,
    InvalidPayload,
    InvalidSchedule,
    InvalidWindow,
    KeyMismatch,
    KeySelectorFailed,
    UnsupportedCombination,
)
from celery_unique.keys import keyspace
from celery_unique.keys.arguments import ArgumentView, Binder
from celery_unique.keys.fingerprint import policy_digest
from celery_unique.keys.payload import Payload
from celery_unique.options.declaration import Declaration, KeySpec
from celery_unique.options.duplicates import DuplicatePolicy, RefusedArguments, decode_arguments
from celery_unique.stores.base import ActiveClaim, OnDuplicate, Scope

TASK = "steps.job"
NAMESPACE = "ns"
SIGNING_KEY = b"steps"


def signature(tenant: int, note: str = "") -> None:
    """The parameters of the task under test."""


def declare(binder: bool = True, **options: Any) -> Declaration:
    """A declaration as a task class with ``options`` gets it, bound to :func:`signature`."""
    declared = Declaration.parse(options)
    if not binder:
        return declared
    return dataclasses.replace(declared, binder=Binder(signature, drop_first=False))


def make_rt(**settings: Any) -> Runtime:
    """A runtime whose store must not be reached: planning writes nothing."""
    settings = {"lease_ms": None, "default_retention_ms": 86_400_000, **settings}
    return Runtime(
        backend_url="memory://",
        namespace=NAMESPACE,
        fail_open=False,
        signing_key=SIGNING_KEY,
        _store=_Untouchable(),  # type: ignore[arg-type]
        **settings,
    )


class _Untouchable:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the store was reached ({name}) while planning")


@pytest.fixture
def task(app: Celery) -> Any:
    @app.task(name=TASK, shared=False)
    def job(tenant: int, note: str = "") -> None:
        return None

    return job


def given(**overrides: Any) -> Any:
    return planning._parse_given(overrides)


def bound(**arguments: Any) -> Any:
    return planning._bind_arguments(declare(), (), arguments)


def stored(kind: str, key: str, *, scope: str = TASK, tag: str | None = None) -> str:
    return keyspace.storage_key(NAMESPACE, kind, scope, key, tag=tag)


# Parsing what the dispatch gives


def test_parse_given_reads_each_option() -> None:
    parsed = given(
        unique_key="k",
        unique_window_key="w",
        unique_window=90,
        unique_while="exists",
        unique_prefix=False,
    )
    assert parsed == planning._Given(
        key=KeySpec(literal="k"),
        window_key=KeySpec(literal="w"),
        window_ms=90_000,
        scope=Scope.EXISTS,
        prefix=False,
    )


def test_parse_given_leaves_what_is_not_given_to_the_declaration() -> None:
    assert given() == planning._Given(None, None, None, None, None)
    # A key or a window given as None is not given.
    assert given(unique_key=None, unique_window_key=None, unique_window=None) == given()


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"unique_while": None}, InvalidDeclaration),
        ({"unique_while": "forever"}, InvalidDeclaration),
        ({"unique_prefix": None}, InvalidBoolean),
        ({"unique_key": 5}, InvalidKey),
        ({"unique_window_key": 5}, InvalidKey),
        ({"unique_window": -1}, InvalidWindow),
    ],
)
def test_parse_given_refuses_a_bad_option(overrides: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        planning._parse_given(overrides)


# The prefix, and whether there is anything to plan


def test_choose_prefix_keeps_the_declared_one_when_none_is_given(task: Any) -> None:
    assert planning._choose_prefix(task, declare(unique_key="k"), None) is True
    assert planning._choose_prefix(task, declare(unique_prefix=False), None) is False


def test_choose_prefix_refuses_to_move_declared_keys(task: Any) -> None:
    with pytest.raises(KeyMismatch) as caught:
        planning._choose_prefix(task, declare(unique_key="k"), False)
    assert str(caught.value) == (
        f"unique_prefix=False given to {TASK} differs from the declared unique_prefix=True"
    )
    assert planning._choose_prefix(task, declare(unique_key="k"), True) is True
    with pytest.raises(KeyMismatch):
        planning._choose_prefix(task, declare(unique_key="k", unique_prefix=False), True)


def test_choose_prefix_takes_the_given_one_where_the_task_allows_it(task: Any) -> None:
    overridable = declare(unique_key="k", unique_overridable=True)
    assert planning._choose_prefix(task, overridable, False) is False
    # A task that declares no key has no keys to move.
    assert planning._choose_prefix(task, declare(), False) is False


def test_has_keys_from_the_declaration_or_the_dispatch() -> None:
    assert not planning._has_keys(declare(), given())
    assert planning._has_keys(declare(unique_key="k"), given())
    assert planning._has_keys(declare(unique_window_key="w", unique_window=60), given())
    assert planning._has_keys(declare(), given(unique_key="k"))
    assert planning._has_keys(declare(), given(unique_window_key="w"))
    # Options that name no key leave a plain dispatch.
    assert not planning._has_keys(declare(), given(unique_while="active", unique_window=60))


def test_refuse_chord_member(task: Any) -> None:
    with pytest.raises(UnsupportedCombination, match="chord header member"):
        planning._refuse_chord_member(task, {"chord": {"task": "callback"}})
    planning._refuse_chord_member(task, {"chord": None})
    planning._refuse_chord_member(task, {})


# Binding the arguments


def test_bind_arguments_names_positional_ones_and_applies_defaults() -> None:
    arguments = planning._bind_arguments(declare(), (7,), None)
    assert arguments.bound == {"tenant": 7, "note": ""}
    assert isinstance(arguments.view, ArgumentView)
    assert arguments.view.tenant == 7
    assert planning._bind_arguments(declare(), None, {"tenant": 7}).bound == arguments.bound


def test_bind_arguments_without_a_signature_sees_keyword_arguments_only() -> None:
    unknown = declare(binder=False)
    assert planning._bind_arguments(unknown, (1, 2), {"a": 3}).bound == {"a": 3}
    assert planning._bind_arguments(unknown, (1,), None).bound == {}


def test_bind_arguments_refuses_arguments_that_do_not_fit() -> None:
    with pytest.raises(TypeError):
        planning._bind_arguments(declare(), (1, "x", "surplus"), None)


def test_the_payload_is_built_once_and_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[Any] = []

    def counting(arguments: Any) -> dict[str, Any]:
        built.append(arguments)
        return {"built": len(built)}

    monkeypatch.setattr(planning, "json_payload", counting)
    arguments = bound(tenant=1)
    assert built == []
    assert arguments.payload() == {"built": 1}
    assert arguments.payload() == {"built": 1}
    assert built == [{"tenant": 1, "note": ""}]


# Choosing the keys


def test_place_key_scopes_a_key_to_the_task_unless_unprefixed(task: Any) -> None:
    rt, arguments = make_rt(), bound(tenant=1)
    literal = KeySpec(literal="k")

    def place(spec: KeySpec, prefix: bool) -> Any:
        return planning._place_key(task, declare(), spec, "a", "unique_key", prefix, arguments, rt)

    assert place(literal, True) == (stored("a", "k"), f"{TASK}:k")
    assert place(literal, False) == (stored("a", "k", scope=""), "k")
    shared = KeySpec(payload=Payload(prefix=False))
    assert place(shared, True).stored.startswith(stored("a", "", scope=""))
    assert ":" not in place(shared, True).shown


def test_place_key_resolves_a_selector_on_the_bound_arguments(task: Any) -> None:
    spec = KeySpec(selector=lambda job: f"tenant:{job.tenant}")
    placed = planning._place_key(
        task, declare(), spec, "w", "unique_window_key", True, bound(tenant=4), make_rt()
    )
    assert placed == (stored("w", "tenant:4"), f"{TASK}:tenant:4")


def test_spread_tag_spreads_by_key_or_by_task() -> None:
    spread, by_key = make_rt(spread_keys=True), declare(unique_key="k")
    by_task = declare(unique_key="k", unique_window_key="w", unique_window=60)
    assert planning._spread_tag(by_key, TASK, "k", spread) == keyspace.key_tag(TASK, "k")
    assert planning._spread_tag(by_task, TASK, "k", spread) == keyspace.task_tag(TASK)
    # Not spread, or shared across tasks: the namespace's tag.
    assert planning._spread_tag(by_key, TASK, "k", make_rt()) is None
    assert planning._spread_tag(by_key, "", "k", spread) is None


def choose_key(task: Any, declaration: Declaration, declared: Any, given_spec: Any) -> Any:
    return planning._choose_key(
        task,
        declaration,
        declared,
        given_spec,
        "a",
        "unique_key",
        prefix=True,
        arguments=bound(tenant=1),
        rt=make_rt(),
    )


def test_choose_key_takes_whichever_is_there(task: Any) -> None:
    mine, theirs = KeySpec(literal="mine"), KeySpec(literal="theirs")
    assert choose_key(task, declare(), None, None) is None
    assert choose_key(task, declare(), mine, None).shown == f"{TASK}:mine"
    assert choose_key(task, declare(), None, theirs).shown == f"{TASK}:theirs"
    overridable = declare(unique_overridable=True)
    assert choose_key(task, overridable, mine, theirs).shown == f"{TASK}:theirs"


def test_choose_key_lets_a_dispatch_repeat_a_declared_key_only(task: Any) -> None:
    declared = KeySpec(selector=lambda job: f"t{job.tenant}")
    assert choose_key(task, declare(), declared, KeySpec(literal="t1")) == (
        stored("a", "t1"),
        f"{TASK}:t1",
    )
    with pytest.raises(KeyMismatch) as caught:
        choose_key(task, declare(), declared, KeySpec(literal="t2"))
    assert str(caught.value) == (
        f"unique_key '{TASK}:t2' given to {TASK} differs from the declared key "
        f"'{TASK}:t1'; declare unique_overridable=True to allow replacing it"
    )


def test_choose_key_works_out_the_declared_key_before_the_given_one(task: Any) -> None:
    asked: list[str] = []

    def selector(name: str) -> KeySpec:
        def select(job: Any) -> str:
            asked.append(name)
            return "k"

        return KeySpec(selector=select)

    choose_key(task, declare(), selector("declared"), selector("given"))
    assert asked == ["declared", "given"]


def test_refuse_split_slots(task: Any) -> None:
    one = planning._Key("unique:v1:ns:{a}:a:x", "x")
    same = planning._Key("unique:v1:ns:{a}:w:y", "y")
    other = planning._Key("unique:v1:ns:{b}:w:y", "y")
    planning._refuse_split_slots(task, one, same)
    planning._refuse_split_slots(task, one, None)
    planning._refuse_split_slots(task, None, other)
    with pytest.raises(UnsupportedCombination, match="two hash slots"):
        planning._refuse_split_slots(task, one, other)


def test_choose_keys_of_both_kinds(task: Any) -> None:
    declaration = declare(unique_key="k", unique_window_key="w", unique_window=60)
    keys = planning._choose_keys(
        task, declaration, given(), True, bound(tenant=1), make_rt(spread_keys=True)
    )
    tag = keyspace.task_tag(TASK)
    assert keys == (
        (stored("a", "k", tag=tag), f"{TASK}:k"),
        (stored("w", "w", tag=tag), f"{TASK}:w"),
    )


def test_choose_keys_refuses_keys_spread_apart(task: Any) -> None:
    """Without a declared window key, a window key given per dispatch is spread by key."""
    with pytest.raises(UnsupportedCombination):
        planning._choose_keys(
            task,
            declare(unique_key="k"),
            given(unique_window_key="w"),
            True,
            bound(tenant=1),
            make_rt(spread_keys=True),
        )
    # Not spread, both keys share the namespace's slot.
    keys = planning._choose_keys(
        task,
        declare(unique_key="k"),
        given(unique_window_key="w"),
        True,
        bound(tenant=1),
        make_rt(),
    )
    assert keys.window is not None
    assert keys.window.stored == stored("w", "w")


# Scope, window, duplicate policy


def test_choose_scope(task: Any) -> None:
    declared = declare(unique_key="k", unique_while="active")
    assert planning._choose_scope(task, declared, None) is Scope.ACTIVE
    assert planning._choose_scope(task, declared, Scope.ACTIVE) is Scope.ACTIVE
    with pytest.raises(KeyMismatch) as caught:
        planning._choose_scope(task, declared, Scope.EXISTS)
    assert str(caught.value) == (
        f"unique_while='exists' given to {TASK} differs from the declared 'active'"
    )
    overridable = declare(unique_key="k", unique_overridable=True)
    assert planning._choose_scope(task, overridable, Scope.EXISTS) is Scope.EXISTS
    # A task that declares no active key has no scope to keep.
    assert planning._choose_scope(task, declare(), Scope.EXISTS) is Scope.EXISTS


def test_choose_window(task: Any) -> None:
    declared = declare(unique_window_key="w", unique_window=60)
    assert planning._choose_window(task, declared, None, True) == 60_000
    assert planning._choose_window(task, declared, 60_000, True) == 60_000
    with pytest.raises(KeyMismatch) as caught:
        planning._choose_window(task, declared, 30_000, True)
    assert str(caught.value) == (
        f"unique_window of 30000 ms given to {TASK} differs from the declared 60000 ms"
    )
    with pytest.raises(KeyMismatch):
        planning._choose_window(task, declared, 90_000, True)
    relaxed = declare(unique_window_key="w", unique_window=60, unique_overridable=True)
    assert planning._choose_window(task, relaxed, 30_000, True) == 30_000
    # A window key given per dispatch takes the window given with it, even where a
    # window is declared without its key.
    assert planning._choose_window(task, declare(unique_key="k"), 30_000, True) == 30_000
    keyless = declare(unique_key="k", unique_window=60)
    assert planning._choose_window(task, keyless, 30_000, True) == 30_000


def test_choose_window_has_no_default(task: Any) -> None:
    assert planning._choose_window(task, declare(), None, False) is None
    with pytest.raises(InvalidWindow, match="a window has no default"):
        planning._choose_window(task, declare(), None, True)


def test_choose_duplicates(task: Any) -> None:
    declared = declare(unique_key="k", unique_while="active", unique_on_duplicate="latest")
    assert planning._choose_duplicates(task, declared, {}) == declared.duplicates
    with pytest.raises(KeyMismatch) as caught:
        planning._choose_duplicates(task, declared, {"unique_on_duplicate": "reuse"})
    assert str(caught.value) == (
        f"unique_on_duplicate/unique_debounce given to {TASK} differ from the declared "
        "'latest'; declare unique_overridable=True to allow choosing them per dispatch"
    )
    # Repeating the declared policy is no change.
    repeated = planning._choose_duplicates(task, declared, {"unique_on_duplicate": "latest"})
    assert repeated == declared.duplicates
    chosen = planning._choose_duplicates(task, declare(), {"unique_on_duplicate": "latest"})
    assert chosen.on_duplicate is OnDuplicate.LATEST


# How long the job waits


def test_wait_ms_of_a_countdown() -> None:
    assert planning.waiting_ms({}) == 0
    assert planning.waiting_ms({"countdown": 2.5}) == 2500
    assert planning.waiting_ms({"countdown": 0}) == 0
    assert planning.waiting_ms({"countdown": -5}) == 0


def test_wait_ms_of_an_eta() -> None:
    later = datetime.now(timezone.utc) + timedelta(seconds=1000)
    for eta in (later, later.isoformat(), later.astimezone().replace(tzinfo=None)):
        assert abs(planning.waiting_ms({"eta": eta}) - 1_000_000) < 500, eta
    assert planning.waiting_ms({"eta": datetime.now(timezone.utc) - timedelta(hours=1)}) == 0


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"countdown": True}, "countdown must be a finite number"),
        ({"countdown": float("inf")}, "countdown must be a finite number"),
        ({"countdown": float("nan")}, "countdown must be a finite number"),
        ({"countdown": "5"}, "countdown must be a finite number"),
        ({"eta": "tomorrow"}, "eta 'tomorrow' is not an ISO 8601 date and time"),
        ({"eta": 5}, "eta must be a datetime, not int 5"),
    ],
)
def test_wait_ms_refuses_a_start_that_names_no_time(options: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidSchedule, match=says):
        planning.waiting_ms(options)


# The active claim


def debounced(debounce_ms: int = 2500, max_ms: int | None = None) -> DuplicatePolicy:
    return DuplicatePolicy(OnDuplicate.DEBOUNCE, debounce_ms, max_ms)


def test_plan_start_leaves_a_job_that_is_not_debounced_alone() -> None:
    assert planning._plan_start(DuplicatePolicy(), {}, 700) == planning._Start(None, 700, None)
    latest = DuplicatePolicy(OnDuplicate.LATEST, 2500)
    assert planning._plan_start(latest, {}, 0) == planning._Start(2500, 0, None)


def test_plan_start_publishes_a_debounced_job_with_its_debounce() -> None:
    assert planning._plan_start(debounced(2500), {}, 0) == planning._Start(2500, 2500, 2.5)
    # The lease covers the latest start duplicates can move the job to.
    assert planning._plan_start(debounced(2500, 9000), {}, 0) == planning._Start(2500, 9000, 2.5)


def test_plan_start_keeps_a_start_of_the_jobs_own() -> None:
    """A countdown or eta is the job's: it is not sent with the debounce instead, and the
    debounce is no shorter than its wait."""
    assert planning._plan_start(debounced(2500), {"countdown": 4}, 4000) == planning._Start(
        4000, 4000, None
    )
    assert planning._plan_start(debounced(2500), {"countdown": 1}, 1000) == planning._Start(
        2500, 2500, None
    )
    past = {"eta": datetime.now(timezone.utc) - timedelta(seconds=1)}
    assert planning._plan_start(debounced(2500), past, 0) == planning._Start(2500, 2500, None)


def test_lease_ms_covers_the_wait() -> None:
    assert planning._lease_ms(make_rt(), 5000) is None
    assert planning._lease_ms(make_rt(lease_ms=60_000), 5000) == 65_000


def test_arguments_to_keep(task: Any) -> None:
    key = stored("a", "k")
    assert planning._arguments_to_keep(task, (1,), {}, DuplicatePolicy(), key, make_rt()) is None
    latest = DuplicatePolicy(OnDuplicate.LATEST)
    kept = planning._arguments_to_keep(task, (1,), {"note": "n"}, latest, key, make_rt())
    assert kept is not None
    assert decode_arguments(task, key, kept, SIGNING_KEY) == ([1], {"note": "n"})
    # Signed for its key: moved to another, they are refused.
    with pytest.raises(RefusedArguments, match="signature does not match"):
        decode_arguments(task, stored("a", "other"), kept, SIGNING_KEY)


def test_arguments_to_keep_refuses_arguments_too_large(task: Any) -> None:
    small = DuplicatePolicy(OnDuplicate.LATEST, latest_max_bytes=8)
    with pytest.raises(InvalidPayload, match="more than unique_latest_max_bytes"):
        planning._arguments_to_keep(task, ("x" * 64,), {}, small, stored("a", "k"), make_rt())


def test_generation_where_the_id_may_hold_the_key_another_way() -> None:
    assert planning._generation(DuplicatePolicy(), id_chosen=False) is None
    chosen = planning._generation(DuplicatePolicy(), id_chosen=True)
    follows = planning._generation(DuplicatePolicy(OnDuplicate.LATEST), id_chosen=False)
    assert isinstance(chosen, str)
    assert isinstance(follows, str)
    assert chosen != follows


def test_active_claim(task: Any) -> None:
    key = planning._Key(stored("a", "k"), f"{TASK}:k")
    start = planning._Start(2500, 9000, 2.5)
    claim = planning._active_claim(
        task,
        key,
        Scope.ACTIVE,
        debounced(2500, 9000),
        start,
        (1,),
        {},
        id_chosen=False,
        rt=make_rt(lease_ms=1000),
    )
    assert claim.arguments is not None
    assert claim.generation is not None
    assert claim == ActiveClaim(
        key=key.stored,
        scope=Scope.ACTIVE,
        lease_ms=10_000,
        on_duplicate=OnDuplicate.DEBOUNCE,
        arguments=claim.arguments,
        debounce_ms=2500,
        debounce_max_ms=9000,
        generation=claim.generation,
    )
    assert decode_arguments(task, key.stored, claim.arguments, SIGNING_KEY) == ([1], {})


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The generations drawn during the test."""
    seen: list[str] = []
    draw = planning.next_generation

    def recorded() -> str:
        seen.append(draw())
        return seen[-1]

    monkeypatch.setattr(planning, "next_generation", recorded)
    return seen


def test_active_claim_draws_no_generation_for_arguments_it_refuses(
    task: Any, drawn: list[str]
) -> None:
    with pytest.raises(InvalidPayload):
        planning._active_claim(
            task,
            planning._Key(stored("a", "k"), "k"),
            Scope.ACTIVE,
            DuplicatePolicy(OnDuplicate.LATEST, latest_max_bytes=8),
            planning._Start(None, 0, None),
            ("x" * 64,),
            {},
            id_chosen=True,
            rt=make_rt(),
        )
    assert drawn == []


def active_claim(scope: Scope = Scope.ACTIVE, generation: str | None = None) -> ActiveClaim:
    return ActiveClaim(stored("a", "k"), scope, None, generation=generation)


def test_active_header_of_a_reused_key(task: Any) -> None:
    header = planning._active_header(task, declare(), active_claim(), DuplicatePolicy(), make_rt())
    assert header == {"a": stored("a", "k"), "s": "active"}


def test_active_header_of_a_key_that_follows_its_duplicates(task: Any) -> None:
    header = planning._active_header(
        task,
        declare(unique_retention=30),
        active_claim(Scope.EXISTS, generation="g1"),
        DuplicatePolicy(OnDuplicate.DEBOUNCE, 1000),
        make_rt(),
    )
    assert list(header.items()) == [
        ("p", "d"),
        ("t", TASK),
        ("a", stored("a", "k")),
        ("s", "exists"),
        ("g", "g1"),
        ("r", 30_000),
    ]


def test_retention_ms() -> None:
    assert planning._retention_ms(declare(unique_retention=30), make_rt()) == 30_000
    assert planning._retention_ms(declare(), make_rt(default_retention_ms=5)) == 5
    assert planning._retention_ms(declare(), make_rt(default_retention_ms=None)) is None


# The window claim


ACTIVE_KEY = planning._Key(stored("a", "k"), f"{TASK}:k")
WINDOW_KEY = planning._Key(stored("w", "w"), f"{TASK}:w")


def test_fingerprinted_keys() -> None:
    both = planning._Keys(ACTIVE_KEY, WINDOW_KEY)
    assert planning._fingerprinted_keys(both, Scope.EXISTS, 60_000) == {
        "active": ACTIVE_KEY.stored,
        "scope": "exists",
        "window": WINDOW_KEY.stored,
        "window_ms": 60_000,
    }
    alone = planning._Keys(None, WINDOW_KEY)
    assert planning._fingerprinted_keys(alone, Scope.EXISTS, 60_000) == {
        "active": None,
        "scope": None,
        "window": WINDOW_KEY.stored,
        "window_ms": 60_000,
    }


def window_claim(
    task: Any,
    keys: Any = None,
    scope: Scope = Scope.QUEUED,
    window_ms: int = 60_000,
    tenant: int = 1,
    options: dict[str, Any] | None = None,
    link: Any = None,
) -> Any:
    return planning._window_claim(
        task,
        keys or planning._Keys(None, WINDOW_KEY),
        scope,
        window_ms,
        bound(tenant=tenant),
        options or {},
        link=link,
        link_error=None,
    )


def test_window_claim(task: Any) -> None:
    claim = window_claim(task, options={"time_limit": 30})
    assert (claim.key, claim.window_ms) == (WINDOW_KEY.stored, 60_000)
    assert claim.policy == policy_digest(task, {"time_limit": 30})
    assert claim.fingerprint == window_claim(task, options={"time_limit": 30}).fingerprint


def test_window_claim_tells_another_request_by_its_fingerprint(task: Any) -> None:
    """Arguments, keys, scope, window, routing and callbacks are part of the request;
    the scope only where there is an active key to hold."""
    same = window_claim(task).fingerprint
    with_active = planning._Keys(ACTIVE_KEY, WINDOW_KEY)
    others = [
        window_claim(task, tenant=2),
        window_claim(task, window_ms=30_000),
        window_claim(task, keys=with_active),
        window_claim(task, options={"queue": "elsewhere"}),
        window_claim(task, link={"task": "callback"}),
    ]
    assert all(other.fingerprint != same for other in others)
    assert window_claim(task, scope=Scope.EXISTS).fingerprint == same
    assert (
        window_claim(task, keys=with_active, scope=Scope.EXISTS).fingerprint
        != window_claim(task, keys=with_active).fingerprint
    )


# Handing the key on


def worker_task(name: str, job_id: str, active_key: str | None) -> Any:
    """A task whose app runs the job ``job_id`` of task ``name``, holding ``active_key``."""
    header = {"v": VERSION, "a": active_key} if active_key else None
    running = SimpleNamespace(
        name=name, request=SimpleNamespace(id=job_id, headers={HEADER: header})
    )
    return SimpleNamespace(name=TASK, app=SimpleNamespace(current_worker_task=running))


def test_handoff_from_the_running_job_that_holds_the_key() -> None:
    claim = active_claim(Scope.ACTIVE)
    assert planning._handoff_from(worker_task(TASK, "holder", claim.key), claim) == "holder"


def test_handoff_from_nobody_else() -> None:
    held = active_claim(Scope.ACTIVE)
    key = held.key
    assert planning._handoff_from(worker_task(TASK, "holder", key), None) is None
    # A queued key was freed as the running job started.
    queued = active_claim(Scope.QUEUED)
    assert planning._handoff_from(worker_task(TASK, "holder", key), queued) is None
    assert planning._handoff_from(worker_task("other.task", "holder", key), held) is None
    assert planning._handoff_from(worker_task(TASK, "holder", stored("a", "x")), held) is None
    assert planning._handoff_from(worker_task(TASK, "holder", None), held) is None


def test_handoff_from_compares_names_and_keys_by_value() -> None:
    """Names and keys come from messages and settings: equal strings are rarely one object,
    and neither sorts before the other by meaning."""
    held = active_claim(Scope.ACTIVE)
    same_name, same_key = "".join(list(TASK)), "".join(list(held.key))
    assert planning._handoff_from(worker_task(same_name, "holder", same_key), held) == "holder"
    assert planning._handoff_from(worker_task(TASK + "~", "holder", held.key), held) is None
    assert planning._handoff_from(worker_task(TASK, "holder", held.key[:-1]), held) is None


# plan(): the steps in order

_ids = itertools.count()


def plan(
    task: Any,
    declaration: Declaration,
    overrides: dict[str, Any] | None = None,
    args: Any = (1,),
    options: dict[str, Any] | None = None,
    *,
    job_id: str | None = None,
    rt: Runtime | None = None,
    **kwargs: Any,
) -> Any:
    return planning.plan(
        task,
        declaration,
        overrides or {},
        args,
        None,
        options or {},
        job_id=job_id or f"job{next(_ids)}",
        rt=rt or make_rt(),
        **kwargs,
    )


def test_plan_of_a_dispatch_without_keys_is_none(task: Any) -> None:
    assert plan(task, declare(), {"unique_while": "active"}) is None


def test_plan_puts_the_steps_together(task: Any) -> None:
    declaration = declare(
        unique_key=lambda job: f"t{job.tenant}",
        unique_while="exists",
        unique_retention=30,
        unique_on_duplicate="debounce",
        unique_debounce=2,
    )
    planned = plan(task, declaration, job_id="j1", id_chosen=False, rt=make_rt(lease_ms=1000))
    active = planned.claim.active
    assert (planned.claim.job_id, planned.claim.task, planned.claim.window) == ("j1", TASK, None)
    assert (active.key, active.scope, active.lease_ms) == (stored("a", "t1"), Scope.EXISTS, 3000)
    assert (active.debounce_ms, planned.countdown_s) == (2000, 2.0)
    assert planned.header == {
        "v": VERSION,
        "p": "d",
        "t": TASK,
        "a": stored("a", "t1"),
        "s": "exists",
        "g": active.generation,
        "r": 30_000,
    }
    assert (planned.active_key, planned.window_key) == (f"{TASK}:t1", None)


def test_plan_of_a_window_key(task: Any) -> None:
    planned = plan(
        task, declare(), {"unique_window_key": "w", "unique_window": 60}, id_chosen=False
    )
    assert planned.claim.active is None
    assert planned.claim.window.key == stored("w", "w")
    assert planned.header == {"v": VERSION, "w": stored("w", "w")}
    assert (planned.active_key, planned.window_key, planned.countdown_s) == (
        None,
        f"{TASK}:w",
        None,
    )


def failing_selector(job: Any) -> str:
    raise RuntimeError("selector")


class Faults(NamedTuple):
    """A dispatch with two faults, and the one it must be told of: the earlier step's."""

    declared: dict[str, Any]
    overrides: dict[str, Any]
    error: type[Exception]
    says: str
    options: dict[str, Any] = {}
    job_id: str | None = None
    args: tuple[Any, ...] = (1,)


SURPLUS = (1, "", "surplus")

FIRST_FAULTS = {
    "options parsed before the prefix is checked": Faults(
        {"unique_key": "k"},
        {"unique_prefix": False, "unique_while": "forever"},
        InvalidDeclaration,
        "unique_while must be one of",
    ),
    "prefix before chord": Faults(
        {"unique_key": "k"},
        {"unique_prefix": False},
        KeyMismatch,
        "unique_prefix=False",
        options={"chord": True},
    ),
    "chord before job id": Faults(
        {"unique_key": "k"}, {}, UnsupportedCombination, "chord", {"chord": True}, "bad\x00id"
    ),
    "job id before arguments": Faults(
        {"unique_key": "k"}, {}, InvalidJobId, "control character", job_id="bad\x00id", args=SURPLUS
    ),
    "arguments before keys": Faults(
        {"unique_key": failing_selector}, {}, TypeError, "too many positional", args=SURPLUS
    ),
    "keys before scope": Faults(
        {"unique_key": failing_selector},
        {"unique_while": "exists"},
        KeySelectorFailed,
        "selector",
    ),
    "scope before window": Faults(
        {"unique_key": "k", "unique_window_key": "w", "unique_window": 60},
        {"unique_while": "exists", "unique_window": 30},
        KeyMismatch,
        "unique_while",
    ),
    "window before duplicate policy": Faults(
        {"unique_key": "k", "unique_window_key": "w", "unique_window": 60},
        {"unique_window": 30, "unique_on_duplicate": "latest"},
        KeyMismatch,
        "unique_window",
    ),
    "duplicate policy before its fit with the keys": Faults(
        {"unique_key": "k"},
        {"unique_on_duplicate": "latest"},
        KeyMismatch,
        "unique_on_duplicate",
    ),
    "the policy's fit with the keys before the start": Faults(
        {"unique_key": "k", "unique_overridable": True},
        {"unique_on_duplicate": "latest"},
        InvalidDeclaration,
        "needs unique_while='active' or 'exists'",
        options={"eta": "soon"},
    ),
    "start before the arguments kept": Faults(
        {
            "unique_key": "k",
            "unique_while": "active",
            "unique_on_duplicate": "latest",
            "unique_latest_max_bytes": 8,
        },
        {},
        InvalidSchedule,
        "countdown",
        options={"countdown": "soon"},
        args=("x" * 64,),
    ),
}


@pytest.mark.parametrize("faults", FIRST_FAULTS.values(), ids=FIRST_FAULTS.keys())
def test_plan_tells_of_the_first_fault_in_step_order(task: Any, faults: Faults) -> None:
    with pytest.raises(faults.error, match=faults.says):
        plan(
            task,
            declare(**faults.declared),
            faults.overrides,
            faults.args,
            faults.options,
            job_id=faults.job_id,
        )


def test_plan_reaches_no_store(task: Any) -> None:
    """Planning writes nothing: the store of :func:`make_rt` fails at any use, and these
    plans go through every step."""
    rt = make_rt(lease_ms=1000)
    with pytest.raises(AssertionError, match="the store was reached"):
        rt.store.decide([])
    follows = declare(unique_key="k", unique_while="active", unique_on_duplicate="latest")
    assert plan(task, follows, rt=rt).claim.active.arguments is not None
    windowed = declare(unique_key="k", unique_window_key="w", unique_window=60)
    assert plan(task, windowed, rt=rt).claim.window is not None


def test_plan_takes_a_job_id_as_chosen_unless_told_it_was_made(task: Any, drawn: list[str]) -> None:
    """A caller that does not say where its job id came from may have chosen it: the claim
    gets a generation of its own, as for a caller's task_id."""
    planned = planning.plan(
        task, declare(unique_key="k"), {}, (1,), None, {}, job_id="job-made-where", rt=make_rt()
    )
    assert planned is not None
    assert drawn == [planned.claim.active.generation]


def test_a_generation_is_a_process_prefix_then_a_count() -> None:
    """Twelve random hex digits a process (drawn again in a forked child), then a count:
    what a key and a header carry, and what a rollback compares."""
    generations = planning._Generations()
    first, second = generations.next(), generations.next()
    assert re.fullmatch(r"[0-9a-f]{12}0", first), first
    assert second == first[:12] + "1"


def test_plan_draws_a_generation_only_where_the_id_may_be_shared(
    task: Any, drawn: list[str]
) -> None:
    assert plan(task, declare(unique_key="k"), id_chosen=False).claim.active.generation is None
    assert drawn == []
    planned = plan(task, declare(unique_key="k"), id_chosen=True)
    assert drawn == [planned.claim.active.generation] == [planned.header["g"]]
