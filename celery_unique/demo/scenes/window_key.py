"""A window key: the same request reused, a different request refused, a policy change."""

from __future__ import annotations

from typing import Any

from celery_unique import UniquenessError
from celery_unique.demo.report import Labels, Report, dispatched, refused
from celery_unique.demo.stage import Demo, describe


def play(demo: Demo, report: Report) -> None:
    """An idempotency window: replays reuse the job long after it finished."""
    task, labels = demo.tasks["window"], Labels()

    def send(step: str, amount: int, request_id: str = "R1", **options: Any) -> None:
        before = describe(demo.held(task, request_id, window=True), labels)
        try:
            result = task.apply_async(("A-1", amount), {"request_id": request_id}, **options)
        except UniquenessError as error:
            report.window.append(refused(step, error, labels, before))
            return
        row = dispatched(step, result, labels, before)
        report.window.append(row)
        if row.outcome == "CREATED":
            demo.stage.wait_finished([result.id], demo.store)

    send("place_order('A-1', 30, request_id='R1')", 30)
    send("the same, after J1 finished", 30)
    send("R1 again, but amount=45", 45)
    send("the same as 1, time_limit=30", 30, time_limit=30, soft_time_limit=20)
    send("a new request_id='R2'", 30, request_id="R2")
