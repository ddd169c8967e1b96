"""The store checks on a store of the test's own: what they report when it cannot be
built, cannot be used, evicts keys, or shares its namespace with other apps."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from celery import Celery

from celery_unique import UniqueTask
from celery_unique import config as unique_config
from celery_unique.checks import store_findings
from celery_unique.checks.catalogue import Finding, finding
from celery_unique.exceptions import BackendUnavailable, ImproperlyConfigured, StoreRefused
from celery_unique.stores import STORES
from celery_unique.stores.base import EvictionUnknown
from celery_unique.stores.memory import MemoryStore

URL = "scripted://:hunter2@store.example:7000/0"
SHOWN = "scripted://:***@store.example:7000/0"


@dataclasses.dataclass
class Script:
    """What the next store built answers: ping's error, eviction, the namespace registry."""

    ping: BaseException | None = None
    eviction: tuple[int, str] | BaseException | None = None
    registry: dict[str, dict[str, list[str]]] | None = None
    registering: BaseException | None = None


SCRIPT = Script()


class ScriptedStore(MemoryStore):
    """A memory store that answers the checks' questions as ``SCRIPT`` says."""

    @classmethod
    def from_url(cls, url: str) -> ScriptedStore:
        return cls()

    def ping(self) -> None:
        if SCRIPT.ping is not None:
            raise SCRIPT.ping

    def eviction(self) -> tuple[int, str] | None:
        if isinstance(SCRIPT.eviction, BaseException):
            raise SCRIPT.eviction
        return SCRIPT.eviction

    def register_app(
        self, namespace: str, app: str, tasks: Sequence[str], keep_ms: int
    ) -> dict[str, list[str]] | None:
        if SCRIPT.registering is not None:
            raise SCRIPT.registering
        if SCRIPT.registry is None:
            return None
        apps = SCRIPT.registry.setdefault(namespace, {})
        apps[app] = list(tasks)
        # As a store answers: names read back from what it keeps, not the caller's strings.
        answer: dict[str, list[str]] = json.loads(json.dumps(apps))
        return answer


@pytest.fixture(autouse=True)
def scripted(monkeypatch: pytest.MonkeyPatch) -> None:
    """``scripted://`` URLs open a ScriptedStore, which answers nothing unusual yet."""
    monkeypatch.setitem(STORES, "scripted", f"{__name__}:ScriptedStore.from_url")
    monkeypatch.setattr(SCRIPT, "ping", None)
    monkeypatch.setattr(SCRIPT, "eviction", None)
    monkeypatch.setattr(SCRIPT, "registry", None)
    monkeypatch.setattr(SCRIPT, "registering", None)


def noop() -> None: ...


@pytest.fixture
def make_app() -> Iterator[Callable[..., Celery]]:
    apps: list[Celery] = []

    def make(main: str | None = "checked", *tasks: str, **settings: Any) -> Celery:
        app = Celery(main, broker="memory://", set_as_current=False)
        app.conf.update({"unique_backend": URL, "unique_namespace": "shop", **settings})
        for name in tasks:
            app.task(base=UniqueTask, name=name, shared=False, unique_key="all")(noop)
        apps.append(app)
        return app

    yield make
    for app in apps:
        unique_config.reset(app)
        app.close()


def shown(found: list[Finding]) -> list[tuple[str, str, str, str]]:
    return [(each.id, each.subject, each.message, each.hint) for each in found]


def test_no_store_is_asked_without_a_url(make_app: Callable[..., Celery]) -> None:
    SCRIPT.eviction = (100, "allkeys-lru")
    assert store_findings(make_app(unique_backend=None)) == []


def test_no_store_is_asked_after_an_unusable_url_but_after_other_findings_it_is(
    make_app: Callable[..., Celery],
) -> None:
    SCRIPT.eviction = (100, "allkeys-lru")
    app = make_app()
    e001 = finding("celery_unique.E001", "unique_backend", "unusable")
    w021 = finding("celery_unique.W021", "unique_lease", "short")
    assert store_findings(app, [w021, e001]) == []
    assert [each.id for each in store_findings(app, [w021])] == ["celery_unique.E026"]


def test_a_store_that_cannot_be_built_leaves_its_checks_unfinished(
    make_app: Callable[..., Celery],
) -> None:
    [found] = store_findings(make_app(unique_lease="forever"))
    assert (found.id, found.subject) == ("celery_unique.E013", "unique_backend")
    assert found.message.startswith(
        "the check for the store (celery_unique.E012, W012, E026, W025) could not finish"
    )
    assert "unique_lease" in found.message


def refused_connection() -> BackendUnavailable:
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused to :hunter2@store")
        except OSError as exc:
            raise BackendUnavailable(f"store unavailable: {exc}") from exc
    except BackendUnavailable as outer:
        return outer


def test_a_store_that_does_not_answer_fails_closed_or_warns_failing_open(
    make_app: Callable[..., Celery],
) -> None:
    SCRIPT.ping = refused_connection()
    said = "store unavailable: [Errno 111] Connection refused to :***@store"
    reached = "start the store, or correct the host and port in unique_backend"
    assert shown(store_findings(make_app())) == [
        (
            "celery_unique.E012",
            "unique_backend",
            f"the uniqueness store {SHOWN} cannot be reached: {said}",
            "until then, unique dispatches fail with backend_unavailable (fail-closed); " + reached,
        )
    ]
    assert shown(store_findings(make_app(unique_fail_open=True))) == [
        (
            "celery_unique.W012",
            "unique_backend",
            f"the uniqueness store {SHOWN} cannot be reached: {said}",
            "until then, unique dispatches are published without uniqueness (fail-open); "
            + reached,
        )
    ]


def test_a_url_refused_as_written_is_e001(make_app: Callable[..., Celery]) -> None:
    SCRIPT.ping = ImproperlyConfigured("unique_backend names database 'abc' for :hunter2@")
    assert shown(store_findings(make_app(unique_fail_open=True))) == [
        (
            "celery_unique.E001",
            "unique_backend",
            "unique_backend cannot be used as written: "
            "unique_backend names database 'abc' for :***@",
            "correct unique_backend: a URL is used exactly as written, or refused",
        )
    ]


def not_set_up(message: str, cause: BaseException | None = None) -> ImproperlyConfigured:
    try:
        raise ImproperlyConfigured(message) from cause
    except ImproperlyConfigured as exc:
        return exc


@pytest.mark.parametrize(
    "error",
    [
        not_set_up("add celery_unique_django to INSTALLED_APPS"),
        not_set_up("Apps aren't loaded yet."),
        not_set_up("Requested setting, but settings are not configured."),
        not_set_up("the store's client is missing", ModuleNotFoundError("No module named 'x'")),
    ],
    ids=["not installed", "apps not loaded", "settings not configured", "client missing"],
)
def test_a_store_not_set_up_in_this_process_is_e012_not_a_wrong_url(
    make_app: Callable[..., Celery], error: ImproperlyConfigured
) -> None:
    SCRIPT.ping = error
    [found] = store_findings(make_app())
    assert (found.id, found.subject) == ("celery_unique.E012", "unique_backend")
    assert (
        found.message == f"the uniqueness store {SHOWN} cannot be opened in this process: {error}"
    )
    assert found.hint.startswith(
        "until then, unique dispatches fail with improperly_configured (fail-closed); "
        "install or configure what the message names"
    )


def test_a_store_refusing_what_its_settings_ask_says_so_unless_it_refuses_the_login(
    make_app: Callable[..., Celery],
) -> None:
    SCRIPT.ping = StoreRefused("DB index is out of range")
    [found] = store_findings(make_app())
    assert found.id == "celery_unique.E012"
    assert found.message == (
        f"the uniqueness store {SHOWN} refuses what its settings ask: DB index is out of range"
    )
    assert found.hint == (
        "until then, unique dispatches fail with improperly_configured (fail-closed); "
        "correct unique_backend or the store's ACL"
    )
    SCRIPT.ping = StoreRefused("WRONGPASS invalid username-password pair")
    [login] = store_findings(make_app())
    assert "refuses the credentials it is given" in login.message
    assert login.hint.endswith(
        "correct the user name and password in unique_backend (or the store's ACL)"
    )


def test_a_store_whose_first_command_fails_otherwise_says_so(
    make_app: Callable[..., Celery],
) -> None:
    SCRIPT.ping = RuntimeError("unexpected reply")
    [found] = store_findings(make_app())
    assert found.message == (
        f"the uniqueness store {SHOWN} does not answer its first command: unexpected reply"
    )
    assert found.hint == (
        "until then, unique dispatches fail with backend_unavailable (fail-closed); "
        "correct what the message names"
    )


@pytest.mark.parametrize(
    ("eviction", "evicts"),
    [
        ((104857600, "allkeys-lru"), "any key"),
        ((1, "allkeys-random"), "any key"),
        (
            (104857600, "volatile-ttl"),
            "keys with an expiry, which every held key has while a lease or window runs",
        ),
    ],
)
def test_a_store_that_evicts_keys_is_e026(
    make_app: Callable[..., Celery], eviction: tuple[int, str], evicts: str
) -> None:
    SCRIPT.eviction = eviction
    maxmemory, policy = eviction
    [found] = store_findings(make_app())
    assert (found.id, found.subject, found.message) == (
        "celery_unique.E026",
        "unique_backend",
        f"the uniqueness store {SHOWN} has maxmemory {maxmemory} bytes and maxmemory-policy "
        f"{policy}: when full it evicts {evicts}, and an evicted key admits a duplicate",
    )


@pytest.mark.parametrize(
    "eviction",
    [None, (0, "allkeys-lru"), (-1, "allkeys-lru"), (104857600, "noeviction"), (104857600, "")],
)
def test_a_store_without_a_limit_or_an_evicting_policy_is_left_alone(
    make_app: Callable[..., Celery], eviction: tuple[int, str] | None
) -> None:
    SCRIPT.eviction = eviction
    assert store_findings(make_app()) == []


def test_an_eviction_policy_that_cannot_be_read_is_w029(make_app: Callable[..., Celery]) -> None:
    SCRIPT.eviction = EvictionUnknown("NOPERM this user (:hunter2) has no permissions")
    assert shown(store_findings(make_app())) == [
        (
            "celery_unique.W029",
            "unique_backend",
            f"could not read maxmemory-policy of the uniqueness store {SHOWN} "
            "(NOPERM this user (:***) has no permissions): whether it evicts keys is unknown",
            finding("celery_unique.W029", "", "").hint,
        )
    ]


def test_each_store_check_that_raises_is_unfinished_and_the_other_reports(
    make_app: Callable[..., Celery],
) -> None:
    SCRIPT.eviction = RuntimeError("eviction broke at :hunter2@")
    SCRIPT.registry = {"shop": {"other": []}}
    found = store_findings(make_app("me", "me.task"))
    assert [(each.id, each.subject) for each in found] == [
        ("celery_unique.E013", "unique_backend"),
        ("celery_unique.W025", "unique_namespace"),
    ]
    assert found[0].message.startswith("the check for celery_unique.E026 could not finish")
    assert "hunter2" not in found[0].message
    SCRIPT.eviction = (104857600, "allkeys-lru")
    SCRIPT.registering = RuntimeError("registry broke at :hunter2@")
    found = store_findings(make_app("me", "me.task"))
    assert [(each.id, each.subject) for each in found] == [
        ("celery_unique.E026", "unique_backend"),
        ("celery_unique.E013", "unique_namespace"),
    ]
    assert found[1].message.startswith("the check for celery_unique.W025 could not finish")
    assert "hunter2" not in found[1].message


def test_apps_with_the_same_unique_tasks_share_a_namespace_quietly(
    make_app: Callable[..., Celery],
) -> None:
    """A plain task is none of the app's unique tasks: only those are compared."""
    SCRIPT.registry = {}
    first = make_app("web", "shop.ship")
    first.task(name="shop.plain", shared=False)(noop)
    assert store_findings(first) == []
    assert store_findings(make_app("worker", "shop.ship")) == []


def test_an_app_with_other_unique_tasks_in_the_namespace_is_w025(
    make_app: Callable[..., Celery],
) -> None:
    SCRIPT.registry = {}
    assert store_findings(make_app("zeta", "zeta.a")) == []
    assert [each.id for each in store_findings(make_app("alpha", "alpha.a"))] == [
        "celery_unique.W025"
    ]
    assert shown(store_findings(make_app("mid", "mid.a"))) == [
        (
            "celery_unique.W025",
            "unique_namespace",
            "the key namespace 'shop' on this store is also used by apps 'alpha', 'zeta', "
            "with other unique tasks than app 'mid': the keys of these apps share one space",
            "give each app its own unique_namespace (now 'shop')",
        )
    ]


@pytest.mark.parametrize(("mine", "theirs"), [((), ("other.a",)), (("mine.a",), ()), ((), ())])
def test_an_app_without_unique_tasks_beside_another_is_w025(
    make_app: Callable[..., Celery], mine: tuple[str, ...], theirs: tuple[str, ...]
) -> None:
    """Without tasks to compare, two apps in one namespace cannot be told to be one."""
    SCRIPT.registry = {"shop": {"other": list(theirs)}}
    [found] = store_findings(make_app("mine", *mine))
    assert found.id == "celery_unique.W025"
    assert "also used by app 'other', with other unique tasks than app 'mine'" in found.message


def test_an_app_without_a_name_registers_as_celery(make_app: Callable[..., Celery]) -> None:
    SCRIPT.registry = {"shop": {"other": ["other.a"]}}
    [found] = store_findings(make_app(None, "mine.a"))
    assert "than app 'celery'" in found.message
    assert sorted(SCRIPT.registry["shop"]) == ["celery", "other"]


def raised_through(depth: int, cause: BaseException) -> BaseException:
    """``cause`` wrapped ``depth`` times, each wrapper raised from the one before (a store
    wrapping its client's error, wrapping the socket's); or, odd levels, while handling it."""
    error = cause
    for level in range(depth):
        try:
            try:
                raise error
            except BaseException as inner:
                if level % 2:
                    raise RuntimeError(f"level {level}")  # noqa: B904 - implicit context
                raise RuntimeError(f"level {level}") from inner
        except RuntimeError as outer:
            error = outer
    return error


class AuthenticationError(Exception):
    """A client's name for a refused login."""


@pytest.mark.parametrize("depth", [2, 3, 9])
def test_a_refused_login_is_named_however_deep_it_was_wrapped(
    make_app: Callable[..., Celery], depth: int
) -> None:
    SCRIPT.ping = raised_through(depth, AuthenticationError("no"))
    [found] = store_findings(make_app())
    assert "refuses the credentials it is given" in found.message


def test_causes_are_followed_ten_deep_at_most(make_app: Callable[..., Celery]) -> None:
    """A cycle of errors (each the context of the other) would otherwise never end."""
    SCRIPT.ping = raised_through(10, AuthenticationError("no"))
    [found] = store_findings(make_app())
    assert "does not answer its first command" in found.message
