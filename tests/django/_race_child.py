"""The body of each process of ``test_race.py`` (imported by spawned children).

A child configures Django from the example project, pointed at the parent's
test database, and dispatches the example shop's tasks through their ordinary
``apply_async``: the store is ``django://<alias>``, the broker kombu's
in-memory transport (each child counts what it publishes). It waits on the
barrier before every round, so all children dispatch the round's key at the
same instant, and reports everything in one message when done.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

BARRIER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Race:
    """What every child needs, as plain picklable values."""

    kind: str  # "active": recalculate_totals; "window": charge
    alias: str
    databases: dict[str, dict[str, Any]]
    namespace: str
    rounds: int


@dataclass
class Report:
    child: int
    #: One ``(round, "created" | "reused" | error code, job id)`` per round.
    outcomes: list[tuple[int, str, str | None]] = field(default_factory=list)
    #: Ids of the jobs this child published.
    published: list[str] = field(default_factory=list)
    error: str | None = None


def run(race: Race, child: int, barrier: threading.Barrier, results: Any) -> None:
    """Dispatch once per round in lockstep with the other children; put a :class:`Report`."""
    report = Report(child)
    try:
        from celery import signals

        from tests.django import project

        project.configure(race.databases)

        from celery_unique import UniquenessError
        from celery_unique.config import runtime
        from tests.django.example.celery import app
        from tests.django.example.shop.tasks import charge, recalculate_totals

        app.conf.update(unique_backend=f"django://{race.alias}", unique_namespace=race.namespace)

        def sent(headers: dict[str, Any] | None = None, **_: Any) -> None:
            report.published.append((headers or {}).get("id", "?"))

        signals.before_task_publish.connect(sent, weak=False)
        runtime(app).store.ping()  # connect before the first round, not during it
        for number in range(race.rounds):
            barrier.wait(BARRIER_TIMEOUT_S)
            try:
                if race.kind == "active":
                    result = recalculate_totals.apply_async(kwargs={"customer": f"r{number}"})
                else:
                    # Half the children send one request, half another, under one window key.
                    amount = 100 if child % 2 else 200
                    result = charge.apply_async(kwargs={"order_id": number, "amount_cents": amount})
            except UniquenessError as exc:
                report.outcomes.append((number, exc.code, None))
            else:
                report.outcomes.append((number, result.disposition.value, result.id))
        runtime(app).store.close()
    except BaseException:
        report.error = traceback.format_exc()
        barrier.abort()
    finally:
        results.put(report)
