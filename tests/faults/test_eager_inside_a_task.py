"""A unique task run eagerly (``.apply()``) inside another task's body, in a prefork pool child.

The eager run's end is not the end of the run it happens in: the outer task's
soft time limit must still strike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ._apps import OUTER, Spec
from .conftest import Worker, eventually, producer, task_of

pytestmark = pytest.mark.slow


def test_an_eager_unique_run_leaves_the_outer_tasks_soft_time_limit_armed(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """The outer task (soft_time_limit=1) runs a UniqueTask with .apply(), then waits: its
    soft time limit strikes in its body."""
    spec = make_spec()
    start_worker(spec)
    with producer(spec) as app:
        outer = task_of(app, OUTER).delay(n=1)
        struck = f"{spec.marks}:soft_limit"
        eventually(
            lambda: outer.id.encode() in marks.lrange(struck, 0, -1),
            what="the outer task's soft time limit",
        )
