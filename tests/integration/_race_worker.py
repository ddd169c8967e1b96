"""The body of each racing process of ``test_races.py`` (imported by spawned children).

A child builds its own Celery app and store connection (nothing crosses the
process boundary but plain values), warms its connections up, then runs every
round in lockstep with the other children: all wait on one barrier, then
dispatch the round's key at the same instant. It reports one :class:`Outcome`
per round, in a single message on the result queue, when it is done.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass
from typing import Any

#: How long a child waits at the barrier for the others before giving up (seconds).
BARRIER_TIMEOUT_S = 60.0
#: The window of the window-key race: far longer than the test.
RACE_WINDOW_S = 600
TASK_NAME = "race.job"


@dataclass(frozen=True)
class Race:
    """What every child of one race needs to know, as plain picklable values."""

    kind: str  # "active" or "window"
    queue: str
    store_url: str
    namespace: str
    rounds: int


@dataclass(frozen=True)
class Outcome:
    """What one dispatch of one child returned in one round."""

    round: int
    child: int
    #: "created", "reused" or the code of the UniquenessError raised.
    result: str
    job_id: str | None
    match: str | None = None
    conflicting_job_id: str | None = None


def payload_of(child: int) -> str:
    """Window race: half the children send request "A", the other half request "B"."""
    return "A" if child % 2 == 0 else "B"


def round_key(race: Race, number: int) -> str:
    return f"{race.kind}-round-{number}"


def build(race: Race) -> Any:
    """A Celery app on the race's queue and store, and its unique task."""

    from celery_unique import UniqueTask
    from tests.conftest import redis_publisher

    app = redis_publisher("race", race.store_url, queue=race.queue, unique_namespace=race.namespace)

    @app.task(shared=False, base=UniqueTask, name=TASK_NAME)
    def job(value: Any) -> Any:
        return value

    app.finalize()
    return app, job


def warm_up(app: Any) -> None:
    """Open the store and broker connections before the first round, not during it."""
    from celery_unique.config import runtime

    runtime(app).store.ping()
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=1)


def dispatch(race: Race, job: Any, child: int, number: int) -> Outcome:
    from celery_unique import UniquenessConflict, UniquenessError

    key = round_key(race, number)
    try:
        if race.kind == "active":
            # Each child sends its own index: the published message tells who won.
            result = job.apply_async((child,), unique_key=key, unique_while="active")
        else:
            result = job.apply_async(
                (payload_of(child),), unique_window_key=key, unique_window=RACE_WINDOW_S
            )
    except UniquenessConflict as exc:
        return Outcome(number, child, exc.code, None, conflicting_job_id=exc.conflicting_job_id)
    except UniquenessError as exc:
        return Outcome(number, child, exc.code, None)
    match = result.duplicate_match.value if result.duplicate_match else None
    return Outcome(number, child, result.disposition.value, result.id, match)


def run(race: Race, child: int, barrier: threading.Barrier, results: Any) -> None:
    """Run every round of ``race`` as child number ``child``; put ``(child, outcomes, error)``."""
    outcomes: list[Outcome] = []
    error = None
    app = None
    try:
        app, job = build(race)
        warm_up(app)
        for number in range(race.rounds):
            barrier.wait(BARRIER_TIMEOUT_S)
            outcomes.append(dispatch(race, job, child, number))
    except BaseException:
        error = traceback.format_exc()
        barrier.abort()  # the others stop waiting for this child
    finally:
        results.put((child, outcomes, error))
        if app is not None:
            from celery_unique.config import reset

            reset(app)
            app.close()
