"""Bad input gets a code before anything is written or published: store URLs that cannot be
used exactly as written, a countdown or eta that names no time, arguments nested too deeply.

No URL here reaches a server: each is refused while the store is built.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery

from celery_unique import (
    ImproperlyConfigured,
    InvalidPayload,
    InvalidSchedule,
    UniqueTask,
    dispatch_many,
)
from celery_unique import config as unique_config
from celery_unique.stores import open_store

SECRET = "plantedSecret42"

#: Each URL, and what its error says. None connects: each is refused as it is read.
REFUSED = [
    ("reddis://:{pw}@127.0.0.1:6379/0", "has no known scheme"),
    ("redis:/:{pw}@127.0.0.1:6379/0", "has no known scheme"),
    ("sqlite:///", "names no file"),
    ("sqlite://", "names no file"),
    ("redis+sentinel://:{pw}@h1:26x79,h2:26379/main", "names sentinel 'h1:26x79'"),
    ("redis+sentinel://:{pw}@h1:70000/main", "names sentinel 'h1:70000'"),
    ("redis+sentinel://:{pw}@h1:26379/main/abc", "names database 'abc'"),
    ("redis+sentinel://:{pw}@h1:26379/main?socket_timeout=soon", "has socket_timeout='soon'"),
    ("redis+sentinel://:{pw}@h1:26379/main?ssl_cert_reqs=none", "is not rediss+sentinel"),
    ("redis+sentinel://:{pw}@h1:26379,:{pw}x@h2:26379/main", "gives credentials more than once"),
    ("redis://:{pw}@127.0.0.1:6379/0?socket_timeout=abc", "Invalid value for 'socket_timeout'"),
    ("redis://:{pw}@127.0.0.1:6379/0?socket_timeout=nan", "a timeout is a number of seconds"),
    ("redis://:{pw}@127.0.0.1:6379/0?socket_connect_timeout=0", "a timeout is a number"),
    ("redis://:{pw}@[::1:6379/0", "Invalid IPv6 URL"),
    ("redis://:{pw}@127.0.0.1:99999/0", "Port out of range"),
    ("redis://:{pw}@127.0.0.1:63x79/0", "cannot be used as written"),
    ("redis://:{pw}@127.0.0.1:6379/abc", "names database 'abc'"),
    ("redis://:{pw}@127.0.0.1:6379/1/2", "names database '1/2'"),
    ("redis://:{pw}@127.0.0.1:6379/-1", "names database '-1'"),
    ("redis://:{pw}@127.0.0.1:6379/0?db=3", "names its database twice"),
    ("redis://:{pw}@127.0.0.1:6379/0?health_check_interval=1&health_check_interval=2",
     "gives health_check_interval more than once"),
    ("redis://:{pw}@127.0.0.1:6379/0?frobnicate=1", "an option its connections do not take"),
    ("unix:///tmp/redis.sock?db=abc", "names database 'abc'"),
    ("redis+cluster://:{pw}@127.0.0.1:7000/3", "a cluster has database 0 only"),
]  # fmt: skip


def told(error: BaseException) -> str:
    """Everything an error shows: its message, its repr, its traceback with its causes."""
    return "\n".join([str(error), repr(error), *traceback.format_exception(error)])


@pytest.mark.parametrize(("url", "says"), REFUSED, ids=[url for url, _ in REFUSED])
def test_a_url_that_cannot_be_used_as_written_is_refused_with_its_password_masked(
    url: str, says: str
) -> None:
    url = url.format(pw=SECRET)
    with pytest.raises(ImproperlyConfigured) as refused:
        open_store(url)
    assert refused.value.code == "improperly_configured"
    assert says in str(refused.value)
    assert SECRET not in told(refused.value)


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/abc", "reddis://:{pw}@127.0.0.1:6379/0", "sqlite:///"]
)
def test_a_dispatch_to_such_a_url_publishes_nothing(
    app: Celery, published: list[dict[str, Any]], url: str
) -> None:
    app.conf.unique_backend = url.format(pw=SECRET)

    @app.task(shared=False, base=UniqueTask, unique_key="k")
    def job() -> None: ...

    with pytest.raises(ImproperlyConfigured):
        job.delay()
    assert published == []


def nested(depth: int, make: Callable[[Any], Any]) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = make(value)
    return value


@pytest.mark.parametrize("make", [lambda inner: [inner], lambda inner: {"a": inner}])
@pytest.mark.parametrize(
    "options",
    [
        {"unique_key": "payload"},
        {"unique_window_key": "payload", "unique_window": 60},
        {"unique_window_key": "literal", "unique_window": 60},
    ],
    ids=["payload key", "payload window key", "fingerprint"],
)
def test_arguments_nested_too_deeply_are_invalid_payload(
    app: Celery, published: list[dict[str, Any]], options: dict[str, Any], make: Any
) -> None:
    """Deeper than the JSON encoder goes: a coded error, not a RecursionError.

    How deep that is depends on the interpreter (Python 3.11 stops at its
    recursion limit, 1,000; 3.13's C encoder goes past 5,000), so the payload
    here is deeper than any of them.
    """

    @app.task(shared=False, base=UniqueTask, **options)
    def job(value: Any) -> None: ...

    deep = nested(100_000, make)
    with pytest.raises(InvalidPayload, match="nested too deeply"):
        job.delay(deep)
    with pytest.raises(InvalidPayload):
        dispatch_many([job.s(deep)])
    assert published == []
    assert list(unique_config.runtime(app).store.scan()) == []


@pytest.mark.parametrize(
    "start",
    [
        {"countdown": math.nan},
        {"countdown": math.inf},
        {"countdown": -math.inf},
        {"countdown": 1e300},
        {"countdown": "5"},
        {"countdown": True},
        {"eta": "next tuesday"},
        {"eta": 1_700_000_000},
    ],
    ids=repr,
)
@pytest.mark.parametrize(
    "options",
    [{"unique_key": "k"}, {"unique_window_key": "w", "unique_window": 60}],
    ids=["active key", "window key"],
)
def test_a_start_that_names_no_time_is_invalid_schedule_and_nothing_is_written(
    app: Celery, published: list[dict[str, Any]], options: dict[str, Any], start: dict[str, Any]
) -> None:
    @app.task(shared=False, base=UniqueTask, **options)
    def job() -> None: ...

    with pytest.raises(InvalidSchedule) as refused:
        job.apply_async(**start)
    assert refused.value.code == "invalid_schedule"
    assert published == []
    assert list(unique_config.runtime(app).store.scan()) == []


@pytest.mark.parametrize(
    "start",
    [
        {"countdown": 0},
        {"countdown": -5},
        {"countdown": 2.5},
        {"eta": datetime.now(timezone.utc) + timedelta(seconds=30)},
    ],
    # The eta's value is the collection's clock: an id must not change between
    # two collections (pytest-xdist's workers each collect and must agree).
    ids=["countdown 0", "countdown -5", "countdown 2.5", "eta in 30 s"],
)
def test_a_start_celery_can_schedule_is_published(
    app: Celery, published: list[dict[str, Any]], start: dict[str, Any]
) -> None:
    @app.task(shared=False, base=UniqueTask, unique_key="k")
    def job() -> None: ...

    job.apply_async(**start)
    assert len(published) == 1


def test_the_checks_say_a_url_cannot_be_used_as_written(app: Celery) -> None:
    """Not "cannot be reached": the URL is refused as it is read, its password masked."""
    from celery_unique import checks

    app.conf.unique_backend = f"redis://:{SECRET}@127.0.0.1:6379/abc"
    found = [each for each in checks.run(app) if each.subject == "unique_backend"]
    assert [each.id for each in found] == ["celery_unique.E001"]
    assert "cannot be used as written" in found[0].message
    assert "names database 'abc'" in found[0].message
    assert SECRET not in found[0].message
