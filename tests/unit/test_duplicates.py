"""``unique_on_duplicate``: what is refused (at definition, per dispatch) and what receipts say.

The worker's side is proved on a real prefork worker in
``tests/faults/test_duplicates.py``; the store rules in
``tests/contract/test_duplicates_contract.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from kombu.serialization import dumps

from celery_unique import (
    Disposition,
    InvalidDeclaration,
    InvalidPayload,
    InvalidWindow,
    KeyMismatch,
    UniqueTask,
)
from celery_unique.config import runtime
from celery_unique.options.duplicates import decode_arguments, encode_arguments, parse_policy
from celery_unique.stores.base import OnDuplicate

_names = itertools.count()
#: A planned start is told to the millisecond (the store's clock, read in whole ms).
MS = timedelta(milliseconds=1)


def define(app: Celery, **options: Any) -> Any:
    options.setdefault("base", UniqueTask)
    options.setdefault("unique_key", lambda job: str(job["customer"]))
    options.setdefault("unique_while", "active")

    @app.task(name=f"dup.job{next(_names)}", shared=False, **options)
    def job(customer: int, note: str = "") -> None:
        return None

    return job


@pytest.mark.parametrize(
    ("options", "error", "says"),
    [
        ({"unique_on_duplicate": "newest"}, InvalidDeclaration, "must be one of"),
        (
            {"unique_on_duplicate": "latest", "unique_while": "queued"},
            InvalidDeclaration,
            "'active' or 'exists'",
        ),
        (
            {"unique_on_duplicate": "latest", "unique_window_key": "w", "unique_window": 60},
            InvalidDeclaration,
            "active keys only",
        ),
        ({"unique_on_duplicate": "debounce"}, InvalidDeclaration, "needs unique_debounce"),
        ({"unique_on_duplicate": "debounce", "unique_debounce": -1}, InvalidWindow, "positive"),
        ({"unique_on_duplicate": "debounce", "unique_debounce": "5s"}, InvalidWindow, "seconds"),
        (
            {"unique_on_duplicate": "debounce", "unique_debounce": 10, "unique_debounce_max": 5},
            InvalidWindow,
            "must not be shorter",
        ),
        ({"unique_debounce_max": 5}, InvalidWindow, "needs unique_debounce"),
        ({"unique_latest_max_bytes": 0}, InvalidDeclaration, "positive number of bytes"),
        ({"unique_latest_max_bytes": -1}, InvalidDeclaration, "not -1"),
        ({"unique_latest_max_bytes": True}, InvalidDeclaration, "not True"),
        ({"unique_latest_max_bytes": 1024.0}, InvalidDeclaration, "not 1024.0"),
        ({"unique_latest_max_bytes": "1024"}, InvalidDeclaration, "not '1024'"),
        ({"unique_latest_max_bytes": 16 * 2**20 + 1}, InvalidDeclaration, r"at most 16,777,216"),
    ],
)
def test_a_policy_that_cannot_work_is_refused_at_definition(
    app: Celery, options: dict[str, Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        define(app, **options)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"unique_window_key": "w", "unique_window": 60}, id="window key"),
        pytest.param({"unique_while": "queued"}, id="queued"),
        pytest.param(
            {"unique_on_duplicate": "debounce", "unique_debounce": 5, "unique_debounce_max": 5},
            id="cap equal to the debounce",
        ),
    ],
)
def test_what_the_policy_allows_is_defined(app: Celery, options: dict[str, Any]) -> None:
    """``reuse`` (the default) follows no duplicate, so any key suits it; a debounce may be
    capped at itself (each duplicate then leaves the start where the first put it)."""
    define(app, **options)


def test_a_policy_cannot_be_changed_once_checked() -> None:
    """A task's declared policy is shared by its dispatches: one given per dispatch is a
    new policy over it, never a change of it."""
    declared = parse_policy({"unique_on_duplicate": "latest"})
    given = parse_policy({"unique_on_duplicate": "reuse"}, base=declared)
    assert (declared.on_duplicate, given.on_duplicate) == (OnDuplicate.LATEST, OnDuplicate.REUSE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        declared.on_duplicate = OnDuplicate.REUSE  # type: ignore[misc]


@pytest.mark.parametrize("bound", [1, 16 * 2**20])
def test_a_bound_of_one_byte_or_exactly_16_mib_is_allowed(app: Celery, bound: int) -> None:
    job = define(app, unique_on_duplicate="latest", unique_latest_max_bytes=bound)
    assert job.unique_latest_max_bytes == bound


def test_a_policy_given_per_dispatch_needs_an_overridable_task(app: Celery) -> None:
    job = define(app)
    with pytest.raises(KeyMismatch, match="unique_overridable"):
        job.apply_async(kwargs={"customer": 1}, unique_on_duplicate="latest")
    assert list(runtime(app).store.scan()) == []


def test_a_policy_given_per_dispatch_is_checked_before_anything_is_written(app: Celery) -> None:
    job = define(app, unique_overridable=True)
    with pytest.raises(InvalidDeclaration, match="needs unique_debounce"):
        job.apply_async(kwargs={"customer": 1}, unique_on_duplicate="debounce")
    with pytest.raises(InvalidDeclaration, match="'active' or 'exists'"):
        job.apply_async(kwargs={"customer": 1}, unique_on_duplicate="latest", unique_while="queued")
    assert list(runtime(app).store.scan()) == []


def test_arguments_larger_than_the_bound_are_refused_before_the_store(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    job = define(app, unique_on_duplicate="latest", unique_latest_max_bytes=100)
    with pytest.raises(InvalidPayload, match="unique_latest_max_bytes"):
        job.delay(customer=1, note="x" * 200)
    assert list(runtime(app).store.scan()) == []
    assert published == []


def test_arguments_exactly_at_the_bound_are_kept_and_one_byte_more_refused(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    """``unique_latest_max_bytes`` is the most a key keeps: that many bytes are allowed,
    one byte more is ``invalid_payload``, refused before the store or the broker."""
    at_the_bound = {"customer": 1, "note": "x" * 50}
    size = len(dumps([[], at_the_bound], serializer="json")[2].encode())
    job = define(app, unique_on_duplicate="latest", unique_latest_max_bytes=size)
    assert job.delay(**at_the_bound).disposition is Disposition.CREATED
    with pytest.raises(InvalidPayload, match=f"{size + 1:,} bytes, more than") as refused:
        job.delay(customer=2, note="x" * 51)
    assert refused.value.code == "invalid_payload"
    assert [held.job_id for held in runtime(app).store.scan()] == [published[0]["id"]]
    assert len(published) == 1


def test_the_bound_is_64_kib_unless_declared(app: Celery, published: list[dict[str, Any]]) -> None:
    """Without ``unique_latest_max_bytes`` a key keeps arguments of 65,536 bytes, no more."""
    job = define(app, unique_on_duplicate="latest")
    overhead = len(dumps([[], {"customer": 1, "note": ""}], serializer="json")[2].encode())
    assert job.delay(customer=1, note="x" * (64 * 1024 - overhead)).disposition is (
        Disposition.CREATED
    )
    with pytest.raises(InvalidPayload, match="65,537 bytes, more than"):
        job.delay(customer=2, note="x" * (64 * 1024 - overhead + 1))
    assert len(published) == 1


def test_receipts_say_what_a_duplicate_did(app: Celery) -> None:
    job = define(app, unique_on_duplicate="latest", unique_overridable=True)
    first = job.delay(customer=3)
    assert first.disposition is Disposition.CREATED
    assert (first.arguments_replaced, first.rerun_requested, first.postponed_to) == (
        False,
        False,
        None,
    )
    again = job.delay(customer=3, note="newer")
    assert (again.id, again.disposition, again.arguments_replaced) == (
        first.id,
        Disposition.REUSED,
        True,
    )
    rt = runtime(app)
    held = rt.store.get(next(iter(rt.store.scan())).key)
    assert held is not None
    assert held.arguments is not None
    assert decode_arguments(job, held.key, held.arguments, rt.signing_key) == (
        [],
        {"customer": 3, "note": "newer"},
    )

    before = datetime.now(timezone.utc)
    debounced = job.apply_async(
        kwargs={"customer": 4}, unique_on_duplicate="debounce", unique_debounce=30
    )
    assert debounced.postponed_to is not None
    assert before + timedelta(seconds=29) < debounced.postponed_to
    moved = job.apply_async(
        kwargs={"customer": 4}, unique_on_duplicate="debounce", unique_debounce=30
    )
    assert (moved.id, moved.arguments_replaced) == (debounced.id, True)
    assert moved.postponed_to is not None
    assert moved.postponed_to >= debounced.postponed_to


@pytest.mark.parametrize("wait", ["countdown", "eta"])
def test_a_debounced_job_sent_for_later_is_planned_for_then(
    app: Celery, published: list[dict[str, Any]], wait: str
) -> None:
    """A countdown/eta longer than the debounce is the planned start: the created receipt
    names it, and a duplicate with the plain debounce is told that start, not an earlier."""
    job = define(app, unique_on_duplicate="debounce", unique_debounce=3)
    before = datetime.now(timezone.utc)
    later = {"countdown": 5} if wait == "countdown" else {"eta": before + timedelta(seconds=5)}
    first = job.apply_async(kwargs={"customer": 8}, **later)
    assert first.postponed_to is not None
    # The store tells the start to the millisecond of its own clock (the memory store's
    # reads the monotonic clock in whole ms, set against the wall clock once), and the
    # wait an eta gives is rounded to the ms: a few ms either way, never the 3 s debounce.
    assert before + timedelta(seconds=5) - 3 * MS <= first.postponed_to
    assert first.postponed_to <= datetime.now(timezone.utc) + timedelta(seconds=5) + MS
    assert datetime.fromisoformat(published[0]["eta"]) >= before + timedelta(seconds=5) - MS
    duplicate = job.delay(customer=8, note="newer")
    assert (duplicate.id, duplicate.arguments_replaced) == (first.id, True)
    assert duplicate.postponed_to == first.postponed_to


def test_postponed_to_never_goes_back_and_is_exactly_the_cap_once_capped(app: Celery) -> None:
    job = define(app, unique_on_duplicate="debounce", unique_debounce=0.05, unique_debounce_max=0.1)
    first = job.delay(customer=9)
    told = [first.postponed_to]
    for _ in range(200):
        told.append(job.delay(customer=9).postponed_to)
        if told[-3:].count(told[-1]) == 3:
            break
        time.sleep(0.005)
    assert told == sorted(told)
    assert first.postponed_to is not None
    assert told[-3:] == [first.postponed_to + timedelta(seconds=0.05)] * 3


def test_the_memory_store_tells_a_planned_start_from_one_reading_of_its_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The clock's millisecond turns between some readings and not others (a busy
    machine): every duplicate at the cap is told the same start, the cap, never one ms
    off, and no start told goes back."""
    from celery_unique.stores import memory
    from celery_unique.stores.base import ActiveClaim, Claim, Scope

    readings = itertools.count()
    monkeypatch.setattr(memory, "_now", lambda: 1_000_000 + next(readings) // 3)
    store = memory.MemoryStore()

    def claim(job: str) -> Claim:
        active = ActiveClaim("k", Scope.ACTIVE, 60_000, OnDuplicate.DEBOUNCE, "a", 50, 100)
        return Claim(job, "job", active)

    created = store.decide([claim("j1")])[0]
    told = [store.decide([claim(f"d{n}")])[0].starts_at_ms for n in range(200)]
    assert created.starts_at_ms is not None
    assert told[-3:] == [created.starts_at_ms + 50] * 3
    assert told == sorted(told)


def test_stored_arguments_read_back_as_sent(app: Celery) -> None:
    job = define(app)
    key, signing_key = "unique:v1:{ns}:a:job\x1fk", runtime(app).signing_key
    stored = encode_arguments(
        job, (1,), {"note": "ü"}, 1024, storage_key=key, signing_key=signing_key
    )
    assert "\x1f" not in stored
    assert decode_arguments(job, key, stored, signing_key) == ([1], {"note": "ü"})


def test_explain_and_operators_see_what_duplicates_left(app: Celery) -> None:
    from celery_unique.operations import KeyInfo

    job = define(app, unique_on_duplicate="latest")
    first = job.delay(customer=8)
    explained = job.unique_explain(customer=8, note="newer")
    assert explained.job_id == first.id
    assert "it would run with these arguments" in explained.verdict
    job.delay(customer=8, note="newer")
    (held,) = list(runtime(app).store.scan())
    info = KeyInfo.of(held)
    assert info.arguments_digest is not None
    assert info.duplicates == f"latest arguments {info.arguments_digest}"
    assert "duplicates:" in str(job.unique_explain(customer=8))
