"""A store that refuses what its settings ask is a coded error, and fail-closed publishes nothing.

A database number the server does not have, an ACL user without a command
the library sends: no wait will change either, so the error is
``improperly_configured`` (still treated as an outage by everything that
handles one: ``unique_fail_open`` applies). On every publish path (asked
first, co-located, a batch) the dispatch raises and the queue stays as it
was. Store and broker connecting as different users never share a script:
the store is asked first. ACL users are made on the session's own
``redis-server`` and deleted after.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_unique import (
    BackendUnavailable,
    Disposition,
    ImproperlyConfigured,
    UniquenessError,
    dispatch_many,
)
from celery_unique import config as unique_config
from tests.conftest import HOST
from tests.processes import RedisServer

from ._apps import Spec
from .conftest import producer, queue_length, task_of

pytestmark = pytest.mark.slow

#: A database number a default redis-server (16 databases) refuses.
REFUSED_DB = 33

#: The paths a dispatch can take out of the producer.
PATHS = {
    "colocated": {},
    "asked_first": {"unique_colocated": False},
}


def dispatch(task: Any, how: str, key: str) -> Any:
    if how == "batch":
        return dispatch_many([task.s().set(unique_key=key, unique_while="active")])[0]
    return task.apply_async(unique_key=key, unique_while="active")


@pytest.fixture
def acl_user(services: RedisServer) -> Iterator[Callable[..., str]]:
    """Make Redis ACL users on the session's server (``rules`` as ``ACL SETUSER`` takes
    them); each is given as its URL for a database, and deleted at teardown."""
    admin = redis.Redis.from_url(services.url(0))
    made: list[str] = []

    def make(*rules: str, db: int = 0) -> str:
        name, password = f"acl-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
        admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *rules)
        made.append(name)
        return f"redis://{name}:{password}@{HOST}:{services.port}/{db}"

    yield make
    for name in made:
        admin.execute_command("ACL", "DELUSER", name)
    admin.close()


@pytest.mark.parametrize("how", ["single", "batch"])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_refused_database_is_improperly_configured_and_publishes_nothing(
    path: str, how: str, make_spec: Callable[..., Spec], services: RedisServer
) -> None:
    """Store on a database the broker's server refuses: every dispatch raises, none queues."""
    spec = make_spec(store_url=services.url(REFUSED_DB), settings=PATHS[path])
    with producer(spec) as app:
        task = task_of(app)
        published = queue_length(spec)
        for _ in range(3):
            with pytest.raises(ImproperlyConfigured) as refused:
                dispatch(task, how, "k")
            assert refused.value.code == "improperly_configured"
            assert "DB index is out of range" in str(refused.value)
        assert queue_length(spec) == published


def test_fail_open_publishes_through_a_refused_database(
    make_spec: Callable[..., Spec], services: RedisServer
) -> None:
    """As for an outage: with fail-open the job goes out, without uniqueness."""
    spec = make_spec(store_url=services.url(REFUSED_DB), fail_open=True)
    with producer(spec) as app:
        task = task_of(app)
        published = queue_length(spec)
        results = [dispatch(task, "single", "k") for _ in range(2)]
        assert [r.disposition for r in results] == [Disposition.CREATED] * 2
        assert queue_length(spec) == published + 2


def test_store_and_broker_as_different_users_never_share_a_script(
    make_spec: Callable[..., Spec], acl_user: Callable[..., str]
) -> None:
    """A store user limited to the library's keys, beside a broker's user on one server:
    the store is asked first, and duplicates are told apart as on any deployment."""
    spec = make_spec(store_url=acl_user("~unique:*", "+@all"))
    with producer(spec) as app:
        task = task_of(app)
        published = queue_length(spec)
        first = dispatch(task, "single", "k")
        again = [dispatch(task, "single", "k") for _ in range(2)]
        assert first.disposition is Disposition.CREATED
        assert [(r.disposition, r.id) for r in again] == [(Disposition.REUSED, first.id)] * 2
        assert queue_length(spec) == published + 1
        assert unique_config.runtime(app).colocation is None


@pytest.mark.parametrize("path", list(PATHS))
def test_an_acl_refusal_is_improperly_configured_and_publishes_nothing(
    path: str, make_spec: Callable[..., Spec], acl_user: Callable[..., str]
) -> None:
    """One user for store and broker, refused the scripts the store runs: coded, nothing out."""
    user = acl_user("~*", "&*", "+@all", "-@scripting", db=0)
    spec = make_spec(store_url=user, broker_url=user.rsplit("/", 1)[0] + "/1", settings=PATHS[path])
    with producer(spec) as app:
        task = task_of(app)
        published = queue_length(spec)
        for _ in range(2):
            with pytest.raises(ImproperlyConfigured) as refused:
                dispatch(task, "single", "k")
            assert refused.value.code == "improperly_configured"
            assert isinstance(refused.value, BackendUnavailable), "fail-open applies to it"
        assert queue_length(spec) == published
        assert bool(unique_config.runtime(app).colocation) is (path == "colocated")


def test_every_error_reply_of_the_store_is_coded(
    services: RedisServer, acl_user: Callable[..., str]
) -> None:
    """The refusals Redis gives (inside a script, on a key, on a database) and any other
    error reply each map to a coded error."""
    from celery_unique.stores.redis import store_failure

    limited = redis.Redis.from_url(acl_user("~unique:*", "+@all"))
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: limited.eval("redis.call('SELECT', 1) return redis.call('LPUSH', 'q', 'm')", 0),
         "improperly_configured"),
        (lambda: limited.lpush("q", "m"), "improperly_configured"),
        (lambda: redis.Redis.from_url(services.url(REFUSED_DB)).ping(), "improperly_configured"),
        (lambda: limited.eval("return redis.error_reply('WRONGTYPE not a list')", 0),
         "backend_unavailable"),
    ]  # fmt: skip
    try:
        for call, code in cases:
            with pytest.raises(redis.RedisError) as raised:
                call()
            failure = store_failure(raised.value)
            assert isinstance(failure, UniquenessError)
            assert (failure.code, failure.__cause__) == (code, raised.value), raised.value
    finally:
        limited.close()


def test_the_checks_say_the_store_refuses_its_database(
    make_spec: Callable[..., Spec], services: RedisServer
) -> None:
    """A refused database is no outage: the check says the store refuses what it is asked."""
    from celery_unique import checks

    with producer(make_spec(store_url=services.url(REFUSED_DB))) as app:
        found = [each for each in checks.run(app) if each.id == "celery_unique.E012"]
    assert len(found) == 1
    assert "refuses what its settings ask" in found[0].message
    assert "improperly_configured" in found[0].hint
