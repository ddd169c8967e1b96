"""A real in-thread Celery worker on the local Redis runs a plain task.

Pins down the test harness itself (plugin setup, broker, backend, fixtures),
not celery-unique: when this fails, every worker-based integration test would.
"""

from __future__ import annotations

from celery import Celery
from celery.worker import WorkController


def test_worker_runs_task_and_stores_result(
    celery_app: Celery, celery_worker: WorkController
) -> None:
    """A task defined after the worker started runs there once reloaded, and its result is kept."""

    @celery_app.task(name="smoke.add")
    def add(x: int, y: int) -> int:
        return x + y

    celery_worker.reload()

    result = add.delay(2, 3)

    assert result.get(timeout=10) == 5
    assert result.state == "SUCCESS"
    assert celery_app.conf.broker_url.startswith("redis://")
    assert celery_app.conf.result_backend.startswith("redis://")
    assert celery_app.conf.task_default_queue.startswith("celery-unique-tests-")
