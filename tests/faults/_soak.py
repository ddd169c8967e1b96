"""The body of each producer process of the soak (imported by spawned children).

A producer builds its own app from the soak's spec, opens its connections,
waits for the others at a barrier, then dispatches as fast as it can, each
time to a key drawn at random. Even-numbered keys are held while ``queued``,
odd-numbered ones while ``active``. It reports every dispatch's key and job
id, split into created and reused, in one message when it is done.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from tests.faults._apps import SOAK, Spec, unique_app

#: How long a producer waits at the barrier for the others (seconds).
BARRIER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Soak:
    """What every producer needs to know, as picklable values."""

    spec: Spec
    dispatches: int
    keys: int
    seed: int


@dataclass
class Report:
    """What one producer did: ``(key, job id)`` of each dispatch, and how long it took."""

    producer: int
    created: list[tuple[str, str]] = field(default_factory=list)
    reused: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None


def key_name(number: int) -> str:
    return f"k{number}"


def scope_of(key: str) -> str:
    """``queued`` for even-numbered keys, ``active`` for odd-numbered ones."""
    return "queued" if int(key[1:]) % 2 == 0 else "active"


def produce(soak: Soak, producer: int, barrier: threading.Barrier, results: Any) -> None:
    """Dispatch ``soak.dispatches`` jobs; put one :class:`Report` on ``results``."""
    from celery_unique import Disposition
    from celery_unique.config import reset, runtime

    report = Report(producer)
    app = None
    try:
        app = unique_app(soak.spec)
        job: Any = app.tasks[SOAK]
        runtime(app).store.ping()
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1)
        draw = random.Random(soak.seed * 1000 + producer)
        barrier.wait(BARRIER_TIMEOUT_S)
        started = time.perf_counter()
        for _ in range(soak.dispatches):
            key = key_name(draw.randrange(soak.keys))
            result = job.apply_async((key,), unique_key=key, unique_while=scope_of(key))
            created = result.disposition is Disposition.CREATED
            (report.created if created else report.reused).append((key, result.id))
        report.seconds = time.perf_counter() - started
    except BaseException:
        report.error = traceback.format_exc()
        barrier.abort()
    finally:
        results.put(report)
        if app is not None:
            reset(app)
            app.close()
