"""Active keys in each scope: a job, then duplicates while it waits, runs and has finished."""

from __future__ import annotations

from typing import Any

from celery.result import AsyncResult

from celery_unique.demo.report import Labels, Row, dispatched
from celery_unique.demo.stage import Demo, describe


def play(demo: Demo, scope: str) -> tuple[list[Row], str | None]:
    """One job and three duplicates: while it waits, while it runs, after it finished.

    Returns the rows and the moment the first job's key was seen free, if it was.
    """
    task, labels, rows = demo.tasks[scope], Labels(), []

    def send(step: str) -> AsyncResult[Any]:
        before = describe(demo.held(task, "tenant:7"), labels)
        result = task.delay(7)
        rows.append(dispatched(step, result, labels, before))
        return result

    with demo.worker_busy():
        first = send("first dispatch (worker busy)")
        demo.stage.hold(first.id)  # it cannot start before the worker is free
        send("J1 waits in the queue")
    demo.stage.wait_started(first.id, demo.store)
    send("J1 is running")
    demo.stage.let_go(first.id)
    demo.stage.wait_finished(labels.ids, demo.store)
    send("J1 has finished")
    demo.stage.wait_finished(labels.ids, demo.store)

    freed = {"J1 is running": "when J1 started", "J1 has finished": "when J1 finished"}
    moment = next((row.step for row in rows[1:] if row.key_before == "free"), None)
    return rows, freed.get(moment) if moment else None
