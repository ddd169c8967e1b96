"""A chord whose body is unique is refused before the chord sends anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chain, chord, group

from celery_unique import UniqueTask, UnsupportedCombination


@pytest.fixture
def tasks(app: Celery) -> tuple[Any, Any]:
    """A plain task, and a unique one keyed by its argument."""

    @app.task(name="chords.add", shared=False)
    def add(*numbers: Any) -> int:
        return 0

    @app.task(name="chords.total", shared=False, base=UniqueTask, unique_key=lambda j: j.n)
    def total(n: str) -> int:
        return 0

    return add, total


def test_a_backend_that_polls_the_header_gets_no_chord_unlock(
    app: Celery, tasks: tuple[Any, Any], published: list[dict[str, Any]], tmp_path: Path
) -> None:
    """With a result backend that cannot count the header, Celery sends chord_unlock first
    (the body is its argument): that message is refused, so nothing is sent."""
    app.conf.result_backend = f"file://{tmp_path}"
    add, total = tasks
    with pytest.raises(UnsupportedCombination, match="body of a chord"):
        chord([add.s(1), add.s(2)])(total.si("7"))
    assert published == []


def test_a_chord_with_a_plain_body_is_sent(
    app: Celery, tasks: tuple[Any, Any], published: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A plain body: the chord goes out as Celery sends it, chord_unlock first."""
    app.conf.result_backend = f"file://{tmp_path}"
    add, _ = tasks
    chord([add.s(1), add.s(2)])(add.s())
    assert [headers["task"] for headers in published] == [
        "celery.chord_unlock",
        "chords.add",
        "chords.add",
    ]


def test_a_chain_that_goes_on_to_a_chord_with_a_unique_body_is_refused_at_its_first_step(
    app: Celery, tasks: tuple[Any, Any], published: list[dict[str, Any]], tmp_path: Path
) -> None:
    """``a | group | unique``: the chord is the chain's second step, sent later by a worker;
    the chain is refused as its first step is sent."""
    app.conf.result_backend = f"file://{tmp_path}"
    add, total = tasks
    with pytest.raises(UnsupportedCombination, match="body of a chord"):
        chain(add.s(1), group(add.s(2), add.s(3)), total.si("7")).apply_async()
    assert published == []
