"""Keys derived from the payload, end to end: what reuses one job, what never does.

Runs on Redis and on RabbitMQ as broker (see conftest), with the store on
Redis and a real worker where a job has to run. Keys are held with
``unique_while="exists"`` so a reuse never depends on how fast the worker is.
The test process is the only producer: a ``before_task_publish`` receiver
sees every message it publishes.
"""

from __future__ import annotations

import datetime
import decimal
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals
from celery.result import AsyncResult
from celery.worker import WorkController
from kombu.utils.json import dumps as kombu_dumps

from celery_unique import Disposition, DuplicateMatch, InvalidPayload, Payload, UniqueTask
from celery_unique.keys.keyspace import namespace_prefix
from celery_unique.stores.redis import RedisStore

from .conftest import NAMESPACE, active_key

HELD: dict[str, Any] = {"unique_while": "exists", "unique_retention": 30}
TIMEOUT_S = 15


class Runs:
    """Counts, in Redis, how many times the worker ran a job for each label."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def mark(self, label: str) -> None:
        self.client.incr(f"runs:{label}")

    def count(self, label: str) -> int:
        return int(self.client.get(f"runs:{label}") or 0)


@pytest.fixture
def runs(store: RedisStore, redis_client: Any) -> Runs:
    """Run counters in the store's (freshly flushed) database, outside the key namespace."""
    return Runs(redis_client)


@pytest.fixture
def published() -> Iterator[list[str]]:
    """Ids of the jobs this process publishes during the test, in order."""
    ids: list[str] = []

    def record(headers: dict[str, Any] | None = None, **_: Any) -> None:
        ids.append((headers or {})["id"])

    signals.before_task_publish.connect(record, weak=False)
    yield ids
    signals.before_task_publish.disconnect(record)


def assert_reused(result: Any, job: AsyncResult[Any]) -> None:
    assert (result.disposition, result.duplicate, result.duplicate_match, result.id) == (
        Disposition.REUSED,
        True,
        DuplicateMatch.ACTIVE,
        job.id,
    )


def assert_created(result: Any) -> None:
    assert (result.disposition, result.duplicate, result.duplicate_match) == (
        Disposition.CREATED,
        False,
        None,
    )


def keys_of(store: RedisStore, task_name: str) -> list[str]:
    return [
        held.key
        for held in store.scan(prefix=namespace_prefix(NAMESPACE))
        if held.task == task_name
    ]


def test_fields_outside_only_do_not_make_a_new_job(
    celery_app: Celery, celery_worker: WorkController, runs: Runs, published: list[str]
) -> None:
    """Two dispatches that differ only outside ``only`` reuse one job, which runs once."""

    @celery_app.task(
        shared=False,
        base=UniqueTask,
        name="payload.only",
        unique_key=Payload(only=[".user_id", ".template"]),
        **HELD,
    )
    def notify(user_id: int, template: str, requested_at: str = "", trace: Any = None) -> str:
        runs.mark(f"only:{template}")
        return template

    celery_worker.reload()
    first = notify.delay(7, "welcome", "2024-01-01T00:00:00", {"attempt": 1})
    assert_created(first)
    again = notify.delay(template="welcome", user_id=7, requested_at="2024-06-30T23:59:59")
    assert_reused(again, first)
    other = notify.delay(7, "reminder", "2024-01-01T00:00:00", {"attempt": 1})
    assert_created(other)

    assert first.get(timeout=TIMEOUT_S) == "welcome"
    assert other.get(timeout=TIMEOUT_S) == "reminder"
    assert (runs.count("only:welcome"), runs.count("only:reminder")) == (1, 1)
    assert published == [first.id, other.id]


@pytest.mark.parametrize("spec", [Payload(), "payload"], ids=["Payload()", "payload-string"])
def test_positional_and_keyword_arguments_are_one_payload(
    spec: Any,
    celery_app: Celery,
    celery_worker: WorkController,
    store: RedisStore,
    runs: Runs,
    published: list[str],
) -> None:
    """``send(42)``, ``send(user_id=42)`` and the defaults spelled out all reuse one job."""

    @celery_app.task(shared=False, base=UniqueTask, name="payload.send", unique_key=spec, **HELD)
    def send(user_id: int, template: str = "welcome") -> int:
        runs.mark(f"send:{user_id}")
        return user_id

    celery_worker.reload()
    first = send.delay(42)
    assert_created(first)
    assert_reused(send.delay(user_id=42), first)
    assert_reused(send.apply_async(kwargs={"template": "welcome", "user_id": 42}), first)
    reminder = send.delay(42, "reminder")
    assert_created(reminder)

    assert (first.get(timeout=TIMEOUT_S), reminder.get(timeout=TIMEOUT_S)) == (42, 42)
    # The stored key is the one Payload().key computes by hand for this payload.
    digest = Payload().digest({"user_id": 42, "template": "welcome"})
    assert (
        Payload().key({"user_id": 42, "template": "welcome"}, send.name) == f"{send.name}:{digest}"
    )
    held = store.get(active_key(send.name, digest))
    assert held is not None
    assert held.job_id == first.id
    assert runs.count("send:42") == 2  # the first job and the "reminder" one
    assert published == [first.id, reminder.id]


@pytest.mark.parametrize(
    ("options", "shared"),
    [
        pytest.param({"unique_key": Payload(prefix=False)}, True, id="Payload(prefix=False)"),
        pytest.param(
            {"unique_key": Payload(), "unique_prefix": False}, True, id="unique_prefix=False"
        ),
        pytest.param({"unique_key": Payload()}, False, id="default"),
    ],
)
def test_unprefixed_payload_keys_are_shared_across_task_types(
    options: dict[str, Any],
    shared: bool,
    celery_app: Celery,
    celery_worker: WorkController,
    runs: Runs,
    published: list[str],
) -> None:
    """Without the task-name prefix two task types share a key on purpose; by default never."""

    @celery_app.task(shared=False, base=UniqueTask, name="payload.shared.a", **options, **HELD)
    def task_a(user_id: int) -> str:
        runs.mark("shared:a")
        return f"a:{user_id}"

    @celery_app.task(shared=False, base=UniqueTask, name="payload.shared.b", **options, **HELD)
    def task_b(user_id: int) -> str:
        runs.mark("shared:b")
        return f"b:{user_id}"

    celery_worker.reload()
    first = task_a.delay(5)
    second = task_b.delay(user_id=5)
    assert_created(first)
    if shared:
        assert_reused(second, first)
        assert second.get(timeout=TIMEOUT_S) == "a:5"  # the other type's job
        assert (runs.count("shared:a"), runs.count("shared:b")) == (1, 0)
        assert published == [first.id]
    else:
        assert_created(second)
        assert (first.get(timeout=TIMEOUT_S), second.get(timeout=TIMEOUT_S)) == ("a:5", "b:5")
        assert (runs.count("shared:a"), runs.count("shared:b")) == (1, 1)
        assert published == [first.id, second.id]


def test_excluded_fields_do_not_make_a_new_job(
    celery_app: Celery, celery_worker: WorkController, runs: Runs, published: list[str]
) -> None:
    """``Payload(exclude=[".requested_at"])``: only the excluded field may differ for a reuse."""

    @celery_app.task(
        shared=False,
        base=UniqueTask,
        name="payload.exclude",
        unique_key=Payload(exclude=[".requested_at"]),
        **HELD,
    )
    def charge(order: str, amount: int, requested_at: str | None = None) -> int:
        runs.mark(f"charge:{amount}")
        return amount

    celery_worker.reload()
    first = charge.delay("o-1", 10, requested_at="2024-01-01T00:00:00")
    assert_created(first)
    assert_reused(charge.delay("o-1", 10, requested_at="2024-01-01T00:00:05"), first)
    assert_reused(charge.delay("o-1", 10), first)
    larger = charge.delay("o-1", 11, requested_at="2024-01-01T00:00:00")
    assert_created(larger)

    assert (first.get(timeout=TIMEOUT_S), larger.get(timeout=TIMEOUT_S)) == (10, 11)
    assert (runs.count("charge:10"), runs.count("charge:11")) == (1, 1)
    assert published == [first.id, larger.id]


def test_payload_spec_given_per_dispatch(
    celery_app: Celery, celery_worker: WorkController, runs: Runs, published: list[str]
) -> None:
    """A task declaring no key deduplicates on ``Payload(only=[".x"])`` given per dispatch."""

    @celery_app.task(shared=False, base=UniqueTask, name="payload.per_dispatch")
    def pair(x: int, y: int) -> int:
        runs.mark(f"pair:{x}")
        return x + y

    celery_worker.reload()
    by_x: dict[str, Any] = {"unique_key": Payload(only=[".x"]), **HELD}
    first = pair.apply_async((1, 2), **by_x)
    assert_created(first)
    assert_reused(pair.apply_async(kwargs={"x": 1, "y": 3}, **by_x), first)
    assert_reused(pair.s(1, 4).set(**by_x).delay(), first)
    plain = pair.delay(1, 5)  # no key given: a plain dispatch
    assert_created(plain)

    assert (first.get(timeout=TIMEOUT_S), plain.get(timeout=TIMEOUT_S)) == (3, 6)
    assert runs.count("pair:1") == 2
    assert published == [first.id, plain.id]


WHEN = datetime.datetime(2024, 5, 6, 7, 8, 9, 123000, tzinfo=datetime.timezone.utc)
IDENT = uuid.UUID("12345678-1234-5678-1234-567812345678")
AMOUNT = decimal.Decimal("12.50")


def describe(*values: Any) -> list[str]:
    """What a job received: the type and the text of each argument."""
    return [f"{type(value).__name__}:{value}" for value in values]


def test_arguments_hash_as_the_worker_receives_them(
    celery_app: Celery, celery_worker: WorkController, runs: Runs, published: list[str]
) -> None:
    """A datetime/UUID/Decimal/tuple and its kombu JSON form are one payload, as on the worker."""

    @celery_app.task(
        shared=False, base=UniqueTask, name="payload.typed", unique_key=Payload(), **HELD
    )
    def typed(when: Any, ident: Any, amount: Any, items: Any) -> list[str]:
        runs.mark("typed")
        return describe(when, ident, amount, items)

    @celery_app.task(shared=False, name="payload.echo")
    def echo(when: Any, ident: Any, amount: Any, items: Any) -> list[str]:
        return describe(when, ident, amount, items)

    celery_worker.reload()
    native = (WHEN, IDENT, AMOUNT, (1, 2))
    # What a producer speaking kombu's JSON (another language, say) would send.
    wire = json.loads(kombu_dumps(list(native)))
    assert wire[0] == {"__type__": "datetime", "__value__": WHEN.isoformat()}

    first = typed.delay(*native)
    assert_created(first)
    assert_reused(typed.delay(*wire), first)
    assert_reused(typed.delay(WHEN, IDENT, AMOUNT, [1, 2]), first)
    received = first.get(timeout=TIMEOUT_S)
    assert received == describe(WHEN, IDENT, AMOUNT, [1, 2])
    # The worker really receives the same values from the JSON form.
    assert echo.delay(*wire).get(timeout=TIMEOUT_S) == received

    # Values the worker receives differently hash differently.
    as_text = typed.delay(WHEN.isoformat(), str(IDENT), str(AMOUNT), [1, 2])
    assert_created(as_text)
    assert as_text.get(timeout=TIMEOUT_S) != received
    assert runs.count("typed") == 2
    assert len(published) == 3  # first, echo, as_text


@pytest.mark.parametrize(
    ("arguments", "path"),
    [
        pytest.param({"tags": {1, 2}}, ".tags", id="set"),
        pytest.param({"tags": [1, object()]}, ".tags[1]", id="object-in-list"),
        pytest.param({"tags": {"a": {"b c": object()}}}, '.tags.a."b c"', id="object-in-dict"),
        pytest.param({"meta": {1, 2}}, ".meta", id="outside-only"),
    ],
)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"unique_key": Payload(only=[".tags"])}, id="active-key"),
        pytest.param(
            {"unique_window_key": Payload(only=[".tags"]), "unique_window": 60}, id="window-key"
        ),
        pytest.param({"unique_window_key": "fixed", "unique_window": 60}, id="window-fingerprint"),
    ],
)
def test_unencodable_argument_is_invalid_payload_and_touches_nothing(
    arguments: dict[str, Any],
    path: str,
    options: dict[str, Any],
    celery_app: Celery,
    store: RedisStore,
    published: list[str],
) -> None:
    """A set or an arbitrary object: invalid_payload with its path; nothing written or sent."""

    @celery_app.task(shared=False, base=UniqueTask, name="payload.unencodable", **options)
    def record(tags: Any = None, meta: Any = None) -> None:
        return None

    with pytest.raises(InvalidPayload) as caught:
        record.apply_async(kwargs=arguments)
    assert caught.value.code == "invalid_payload"
    assert caught.value.path == path
    assert keys_of(store, record.name) == []
    assert published == []
    # The same task with encodable arguments is decided and published.
    assert_created(record.delay(tags=[1, 2]))
    assert len(keys_of(store, record.name)) == 1
    assert len(published) == 1
