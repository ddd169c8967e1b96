"""The Redis users the security page documents are all a deployment needs, and need all they have.

The rules are read from docs/security.md itself ("Least privilege on Redis"),
for the test's namespace, so that the page and this test cannot drift. A
deployment does everything a deployment does with them: a created dispatch
and its duplicate, a window key (created, reused, refused for another
request), a batch, ``celery unique`` (list, show, explain, release, reap),
the checks, the undo of a decision whose reply was lost, and a worker of the
prefork pool that starts and ends jobs (one of them following its
duplicates, so that it runs the run they owed). Three deployments: the store
as a user of its own beside a broker that is not it (keys tagged by
namespace, or by key), and store and broker as one user (the broker's own
rules, plus what the page says co-location adds).

Each deployment runs on a redis-server of its own, its script cache empty so
that the first decision goes by ``EVAL``, and ends with the server's
``ACL LOG`` holding no refusal of the user: a refusal that redis-py or the
library swallows (the connection's name, the eviction check) would otherwise
go unseen.
"""

from __future__ import annotations

import fnmatch
import json
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, cast

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_unique import (
    BackendUnavailable,
    Disposition,
    UniquenessConflict,
    checks,
    dispatch_many,
    operations,
)
from celery_unique import config as unique_config
from celery_unique.cli import unique
from celery_unique.receipt import UniqueResult
from celery_unique.stores import cleanup
from celery_unique.stores.redis import RedisStore
from tests.conftest import HOST
from tests.processes import REPO, RedisServer

from ._apps import FOLLOW, JOB, WINDOWED, Spec
from .conftest import Worker, eventually, finished, follow_runs, producer, task_of

pytestmark = pytest.mark.slow

SECURITY = REPO / "docs" / "security.md"
#: The namespace the page's rules are written for.
DOC_NAMESPACE = "shop"
#: What would say the store refused something: a check that could not finish, a store
#: that cannot be used, an eviction policy that cannot be read.
REFUSED_CHECKS = {"celery_unique.E012", "celery_unique.E013", "celery_unique.W029"}

#: The broker's own user for a worker and its producers, as kombu's Redis transport
#: needs it (queues, bindings, unacknowledged messages, remote control, events): on
#: the broker's keys alone, with every command but ``TYPE``, which only co-location
#: sends.
BROKER_RULES = ["~{queue}*", "~_kombu.*", "~unacked*", "~*.pidbox*", "&*", "+@all", "-type"]


def documented_rules() -> tuple[list[str], list[str]]:
    """The rules of the page's two ``ACL SETUSER`` lines, without ``ACL SETUSER <name>``:
    the store's user, and what co-location adds to the broker's user."""
    text = SECURITY.read_text()
    section = text.split("\n## Least privilege on Redis\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```text\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 2, "the store's user, and what co-location adds"
    rules = []
    for block in blocks:
        words = block.split()
        assert words[:2] == ["ACL", "SETUSER"], block
        rules.append(words[3:])
    return rules[0], rules[1]


def for_namespace(rules: list[str], namespace: str, password: str) -> list[str]:
    """The page's rules for ``namespace``, with the test's password."""
    mine = []
    for rule in rules:
        if rule.startswith(">"):
            rule = f">{password}"
        elif rule.startswith("~"):
            rule = rule.replace(f"{{{DOC_NAMESPACE}}}", f"{{{namespace}}}")
            rule = rule.replace(f":{DOC_NAMESPACE}:", f":{namespace}:")
        mine.append(rule)
    return mine


def newer_servers(admin: Any) -> list[str]:
    """What the page adds on Redis 7.2 and later, where redis-py names its library."""
    version = str(admin.info("server")["redis_version"])
    major, minor = (int(part) for part in version.split(".")[:2])
    return ["+client|setinfo"] if (major, minor) >= (7, 2) else []


def refusals(admin: Any, user: str) -> list[dict[str, Any]]:
    """Every refusal the server logged for ``user`` (``ACL LOG``)."""
    return [entry for entry in admin.acl_log() if entry["username"] == user]


def url_as(user: str, password: str, server: RedisServer, db: int) -> str:
    return f"redis://{user}:{password}@{HOST}:{server.port}/{db}"


def store_user(
    admin: Any, server: RedisServer, namespace: str, *, without: str = "", db: int = 0
) -> str:
    """The page's store user for ``namespace`` (less the rule ``without``): its URL."""
    rules, _ = documented_rules()
    name, password = f"unique-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    mine = for_namespace([rule for rule in rules if rule != without], namespace, password)
    admin.execute_command("ACL", "SETUSER", name, "reset", *mine, *newer_servers(admin))
    return url_as(name, password, server, db)


def colocated_user(
    admin: Any, server: RedisServer, namespace: str, queue: str, *, without: str = ""
) -> str:
    """The broker's own user with what the page adds for co-location (less ``without``):
    its URL on db 0."""
    _, added = documented_rules()
    name, password = f"celery-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    broker = [rule.format(queue=queue) for rule in BROKER_RULES]
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *broker)
    mine = for_namespace([rule for rule in added if rule != without], namespace, password)
    admin.execute_command("ACL", "SETUSER", name, *mine, *newer_servers(admin))
    return url_as(name, password, server, 0)


def user_of(url: str) -> str:
    return url.split("://", 1)[1].split(":", 1)[0]


@dataclass(frozen=True)
class Deployment:
    """A server of the test's own, its default user, and an app whose store is an ACL user."""

    server: RedisServer
    admin: Any
    kind: str
    spec: Spec

    @property
    def user(self) -> str:
        return user_of(self.spec.store_url)


def spec_on(server: RedisServer, namespace: str, store: str, broker: str, spread: str) -> Spec:
    # The reaper's result backend is the default user's: the store's user has no part in it.
    return Spec(
        broker_url=broker,
        queue=f"q-{namespace}",
        store_url=store,
        namespace=namespace,
        marks_url=server.url(0),
        marks=f"marks-{namespace}",
        settings={
            "unique_signing_key": uuid.uuid4().hex,
            "result_backend": server.url(2),
            "unique_key_spread": spread,
        },
    )


@pytest.fixture(autouse=True)
def owes_nothing_afterwards() -> Iterator[None]:
    """Leave no write owed to a server this test stopped: a refused user's releases can
    never land, and the next test of this process would wait on them."""
    yield
    if cleanup.flush(2):
        return
    current = cleanup._cleanup
    if current is not None:
        for store in {id(item.store): item.store for item in list(current._owed)}.values():
            cleanup.discard(store)


@pytest.fixture
def fresh_server(redis_server: Callable[..., RedisServer]) -> Iterator[tuple[RedisServer, Any]]:
    """A redis-server of the test's own (no script cached, nothing logged), and its admin."""
    server = redis_server()
    admin = redis.Redis.from_url(server.url(0))
    yield server, admin
    admin.close()


def deploy(
    fresh: tuple[RedisServer, Any], kind: str, *, without: str = "", db: int = 0
) -> Deployment:
    """``separate``: the page's store user beside a broker of the default user (db 1),
    ``spread`` the same with ``unique_key_spread = "key"``; ``colocated``: one user for
    both, the broker's own plus what co-location adds."""
    server, admin = fresh
    namespace = f"lp-{uuid.uuid4().hex[:10]}"
    if kind in ("separate", "spread"):
        store = store_user(admin, server, namespace, without=without, db=db)
        broker = server.url(1)
    else:
        store = colocated_user(admin, server, namespace, f"q-{namespace}", without=without)
        broker = store.rsplit("/", 1)[0] + "/1"
    spread = "key" if kind == "spread" else "namespace"
    return Deployment(server, admin, kind, spec_on(server, namespace, store, broker, spread))


@dataclass
class Produced:
    """What the producer's side of a deployment left for its worker to run."""

    #: Ids of the jobs a worker is to run.
    jobs: list[str]
    #: Where the store holds their active keys.
    keys: list[str]


def lose_a_decision(app: Celery) -> None:
    """What follows a decision whose reply was lost: the connection that carried it is
    cut off (``CLIENT KILL``; gone already here), then its claims are rolled back."""
    store = unique_config.runtime(app).store
    assert isinstance(store, RedisStore)
    lost = BackendUnavailable("the reply was lost")
    lost._connection = ("ID", "999999999", "ADDR", f"{HOST}:1")  # type: ignore[attr-defined]
    assert store.forget_decision([], lost), "the connection was named, so the undo is final"


def operator(app: Celery, *args: str) -> Any:
    """``celery unique ARGS`` for ``app``; what it printed, read as JSON when it printed any."""
    ran = CliRunner().invoke(
        unique, list(args), obj=CLIContext(app=app, no_color=True, workdir=None)
    )
    assert ran.exit_code == 0, ran.output
    return json.loads(ran.output) if "--json" in args else ran.output


def produce(app: Celery, spec: Spec) -> Produced:
    """Everything a deployment's producers and operators do, checked as they go."""
    task, windowed = task_of(app), task_of(app, WINDOWED)
    first = task.apply_async(unique_key="k", unique_while="active")
    again = task.apply_async(unique_key="k", unique_while="active")
    assert (first.disposition, again.disposition) == (Disposition.CREATED, Disposition.REUSED)
    assert again.id == first.id

    window = windowed.apply_async(kwargs={"order": 1})
    window_again = windowed.apply_async(kwargs={"order": 1})
    assert (window.disposition, window_again.disposition) == (
        Disposition.CREATED,
        Disposition.REUSED,
    )
    with pytest.raises(UniquenessConflict) as conflict:
        windowed.apply_async(kwargs={"order": 1, "first_hold_s": 0.0})
    assert conflict.value.conflicting_job_id == window.id

    batch = [
        cast("UniqueResult", each)
        for each in dispatch_many(
            [task.s().set(unique_key=f"b{n}", unique_while="active") for n in range(3)]
            + [task.s().set(unique_key="k", unique_while="active")]
        )
    ]
    assert [each.disposition for each in batch] == [Disposition.CREATED] * 3 + [Disposition.REUSED]

    released = task.apply_async(unique_key="released", unique_while="active")
    listed = {
        info["job_id"]: info["storage_key"] for info in operator(app, "list", "--json")["keys"]
    }
    assert {first.id, released.id, window.id} <= set(listed)
    (shown,) = operator(app, "show", f"{JOB}:k", "--json")
    assert (shown["job_id"], shown["storage_key"]) == (first.id, listed[first.id])
    options = json.dumps({"unique_key": "k", "unique_while": "active"})
    assert operator(app, "explain", JOB, "--options", options, "--json")["job_id"] == first.id
    told = operator(app, "explain", WINDOWED, "--kwargs", '{"order": 1}', "--json")
    assert told["job_id"] == window.id
    operator(app, "release", f"{JOB}:released", "--job-id", released.id, "--yes")
    assert not operations.show(app, f"{JOB}:released")

    # A job whose end the result backend knows but whose key is still held: the
    # reaper's to free. Its message waits on a queue no worker reads.
    parked = task.apply_async(
        unique_key="parked", unique_while="active", queue=f"{spec.queue}-parked"
    )
    app.backend.mark_as_done(parked.id, None)
    reaped = operator(app, "reap", "--apply", "--json")
    assert [orphan["job_id"] for orphan in reaped["released"]] == [parked.id], reaped

    lose_a_decision(app)
    found = {each.id for each in checks.run(app)}
    assert not found & REFUSED_CHECKS, found
    jobs = [first.id, *(each.id for each in batch[:3]), released.id]
    return Produced([*jobs, window.id], [listed[job] for job in jobs])


def follow_through(app: Celery, spec: Spec, marks: Any) -> None:
    """A run of a task that follows its duplicates, and the run they owed it."""
    follow = task_of(app, FOLLOW)
    running = follow.apply_async(kwargs={"customer": 1, "version": 1, "until_let_go": True})
    eventually(lambda: marks.lrange(f"{spec.marks}:follow_started", 0, -1), what="the first run")
    owed = [follow.apply_async(kwargs={"customer": 1, "version": v}) for v in (2, 3)]
    assert {(each.disposition, each.id) for each in owed} == {(Disposition.REUSED, running.id)}
    marks.set(f"{spec.marks}:let_go", 1)
    eventually(lambda: len(follow_runs(marks, spec)) == 2, what="the owed run")
    assert [version for _, version, _, _ in follow_runs(marks, spec)] == [1, 3]
    eventually(lambda: not operations.show(app, f"{FOLLOW}:customer:1"), what="the key to be freed")


@pytest.mark.parametrize("kind", ["separate", "spread", "colocated"])
def test_a_deployment_needs_no_more_than_the_documented_user(
    kind: str,
    fresh_server: tuple[RedisServer, Any],
    start_worker: Callable[..., Worker],
) -> None:
    """Producers, operators, the reaper, the checks and a prefork worker, as the page's
    user: everything works, and the server refused that user nothing."""
    deployment = deploy(fresh_server, kind)
    spec, admin = deployment.spec, deployment.admin
    with producer(spec) as app:
        produced = produce(app, spec)
        assert bool(unique_config.runtime(app).colocation) is (kind == "colocated")
        start_worker(spec)
        eventually(
            lambda: set(produced.jobs) <= set(finished(admin, spec)), what="every job to run"
        )
        eventually(lambda: not admin.exists(*produced.keys), what="their keys to be freed")
        follow_through(app, spec, admin)
    assert refusals(admin, deployment.user) == []


def co_location_only() -> list[str]:
    """The rules co-location adds that the store's user does not have."""
    store, added = documented_rules()
    return [rule for rule in added if rule not in store]


def test_co_location_adds_the_store_user_s_rules_and_type() -> None:
    """The page's two lines agree: co-location adds the store's keys and commands, and
    ``TYPE``."""
    store, added = documented_rules()
    granted = [rule for rule in store if rule.startswith(("~", "+"))]
    assert [rule for rule in added if rule in store] == granted
    assert co_location_only() == ["+type"]


def touch_everything(app: Celery) -> None:
    """What ``produce`` does (a worker's scripts are the same commands), each step on its
    own: one that is refused does not keep the others from asking."""
    task = task_of(app)
    windowed = task_of(app, WINDOWED)
    steps: list[Callable[[], Any]] = [
        lambda: task.apply_async(unique_key="k", unique_while="active"),
        lambda: windowed.apply_async(kwargs={"order": 1}),
        lambda: dispatch_many(
            [task.s().set(unique_key=f"b{n}", unique_while="active") for n in range(3)]
        ),
        lambda: operations.list_keys(app),
        lambda: operations.show(app, f"{JOB}:k"),
        lambda: operations.release(app, f"{JOB}:k"),
        lambda: lose_a_decision(app),
        lambda: checks.run(app),
    ]
    for step in steps:
        # What was refused is the ACL LOG's to say.
        with suppress(Exception):
            step()


def spread_keys(pattern: str) -> bool:
    """Whether ``pattern`` is the page's for keys of their own hash tags."""
    return f":{DOC_NAMESPACE}:{{" in pattern


@pytest.mark.parametrize(
    ("kind", "command"),
    [("separate", rule) for rule in documented_rules()[0] if rule.startswith("+")]
    + [("colocated", rule) for rule in co_location_only()],
)
def test_each_documented_command_is_needed(
    kind: str, command: str, fresh_server: tuple[RedisServer, Any]
) -> None:
    """Without any one of the page's commands, something a deployment does is refused."""
    # The store on a database other than 0, so that its connections SELECT it.
    deployment = deploy(fresh_server, kind, without=command, db=3 if kind == "separate" else 0)
    with producer(deployment.spec) as app:
        touch_everything(app)
    refused = {entry["object"] for entry in refusals(deployment.admin, deployment.user)}
    assert command[1:] in refused, refused


@pytest.mark.parametrize(
    "pattern", [rule for rule in documented_rules()[0] if rule.startswith("~")]
)
def test_each_documented_key_pattern_is_needed(
    pattern: str, fresh_server: tuple[RedisServer, Any]
) -> None:
    """Without any one of the page's key patterns, a key the store writes is refused."""
    kind = "spread" if spread_keys(pattern) else "separate"
    deployment = deploy(fresh_server, kind, without=pattern)
    with producer(deployment.spec) as app:
        touch_everything(app)
    (mine,) = for_namespace([pattern], deployment.spec.namespace, "")
    refused = [
        entry["object"]
        for entry in refusals(deployment.admin, deployment.user)
        if entry["reason"] == "key"
    ]
    assert any(fnmatch.fnmatchcase(key, mine[1:]) for key in refused), refused
