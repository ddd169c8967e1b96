"""Defects found by trying the first release as users would, each pinned by a test of its own."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from celery import Celery, chain

from celery_unique import (
    Disposition,
    ImproperlyConfigured,
    InvalidJobId,
    Payload,
    UniquenessConflict,
    UniqueTask,
    config,
)
from celery_unique.keys.keyspace import validate_job_id, validate_namespace
from celery_unique.options.declaration import parse_window


def test_window_reuse_with_another_chain_is_a_conflict(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    """A different ``chain=`` continuation is a different request, never silently dropped."""

    @app.task(
        shared=False,
        base=UniqueTask,
        name="fixes.order",
        unique_window_key=lambda job: job.request_id,
        unique_window=60,
    )
    def order(request_id: str) -> str:
        return request_id

    @app.task(shared=False, name="fixes.email")
    def email(to: str) -> None:
        return None

    chain(order.si("R-1"), email.si("a@example.com")).apply_async()
    # The same request again (its chain's steps get fresh ids: no difference): reused.
    chain(order.si("R-1"), email.si("a@example.com")).apply_async()
    assert len(published) == 1
    with pytest.raises(UniquenessConflict):
        chain(order.si("R-1"), email.si("b@example.com")).apply_async()
    assert len(published) == 1


def test_arguments_named_like_mapping_methods_are_read_as_arguments(app: Celery) -> None:
    """A selector's ``job.items``/``keys``/``values``/``get`` name the task's arguments."""
    seen: list[Any] = []

    def selector(job: Any) -> str:
        seen.append((job.items, job.keys, job.values, job.get, dict(job)))
        return f"{job.items}-{job.keys}-{job.values}-{job.get}"

    @app.task(shared=False, base=UniqueTask, unique_key=selector)
    def ship(items: int, keys: str, values: str = "v", get: str = "g") -> None:
        return None

    ship.delay(3, "k")
    assert seen == [(3, "k", "v", "g", {"items": 3, "keys": "k", "values": "v", "get": "g"})]


class Customer(pydantic.BaseModel):
    id: int
    name: str


def test_pydantic_arguments_are_hashed_as_they_will_be_sent(app: Celery) -> None:
    """A ``pydantic=True`` task's model arguments are keyed by their dumped form."""

    @app.task(shared=False, base=UniqueTask, pydantic=True, unique_key=Payload(only=[".c.id"]))
    def reindex(c: Customer) -> None:
        return None

    if getattr(reindex, "_dump_pydantic_arguments", None) is None:
        pytest.skip("this Celery (before 5.7) does not dump pydantic arguments on the producer")
    first = reindex.delay(Customer(id=42, name="Ann"))
    second = reindex.delay(Customer(id=42, name="Bob"))
    assert (first.disposition, second.disposition) == (Disposition.CREATED, Disposition.REUSED)
    assert reindex.delay({"id": 42, "name": "Cy"}).id == first.id


def test_every_whole_millisecond_float_window_is_accepted() -> None:
    """``unique_window=1.001`` is 1,001 ms: every float of whole ms up to 200 s is accepted."""
    assert parse_window(1.001) == 1001
    for ms in range(1, 200_001):
        assert parse_window(ms / 1000) == ms


@pytest.mark.parametrize("namespace", ["", "a}:b", "{tag}", "a\x1fb", "line\nbreak"])
def test_namespaces_that_could_collide_are_refused(app: Celery, namespace: str) -> None:
    """A namespace with braces or control characters is refused, naming the setting."""
    with pytest.raises(ImproperlyConfigured, match="unique_namespace"):
        validate_namespace(namespace)
    app.conf.unique_namespace = namespace or "\x00"
    config.reset(app)
    with pytest.raises(ImproperlyConfigured, match="unique_namespace"):
        config.runtime(app)


@pytest.mark.parametrize("job_id", ["a\x1fb", "a\x1eb", "nul\x00", "del\x7f", "lone\ud800", ""])
def test_job_ids_no_store_can_hold_are_refused(job_id: str) -> None:
    """Control characters, lone surrogates and the empty string: invalid_job_id."""
    with pytest.raises(InvalidJobId):
        validate_job_id(job_id)


def test_job_ids_any_store_can_hold_are_accepted() -> None:
    """Separators, long ids and characters outside the BMP are valid job ids."""
    for job_id in ("a:b{c}", "x" * 2000, "\U0001f600", "é" * 700):
        assert validate_job_id(job_id) == job_id
