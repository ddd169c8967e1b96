"""The embedded worker, started so that it leaves this process as it found it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery, current_app, signals
from celery.contrib.testing.worker import start_worker

from celery_unique.demo.stage import Demo, Stage, build_app


class _Collect(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


@contextmanager
def collected_warnings(lines: list[str]) -> Iterator[None]:
    """Gather celery_unique's warnings for the report instead of mixing them into the tables."""
    logger = logging.getLogger("celery_unique")
    handler, propagate = _Collect(lines), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


@contextmanager
def counting_publishes(demo: Demo) -> Iterator[None]:
    def record(headers: dict[str, Any] | None = None, **_: Any) -> None:
        demo.published.append(str((headers or {}).get("id")))

    with _connected(signals.before_task_publish, record, f"celery_unique.demo.publish.{id(demo)}"):
        yield


@contextmanager
def current_app_kept() -> Iterator[None]:
    """Undo the embedded worker making the demo's app this process's current and default app."""
    # current_app is a proxy; the stubs type it as the app itself.
    previous: Celery = current_app._get_current_object()  # type: ignore[attr-defined]
    try:
        yield
    finally:
        previous.set_current()
        previous.set_default()


@contextmanager
def logging_left_alone() -> Iterator[None]:
    """Keep the embedded worker from configuring the root logger of this process."""

    def leave(**_: Any) -> None:
        return None

    with _connected(signals.setup_logging, leave, "celery_unique.demo.logging"):
        yield


@contextmanager
def _connected(signal: Any, receiver: Any, uid: str) -> Iterator[None]:
    """``receiver`` connected to ``signal`` for the length of the block."""
    signal.connect(receiver, weak=False, dispatch_uid=uid)
    try:
        yield
    finally:
        signal.disconnect(dispatch_uid=uid)


@contextmanager
def demo_running(store_url: str, warnings: list[str]) -> Iterator[Demo]:
    """The demo's app on ``store_url`` with its worker in a thread; the store closed after.

    The library's warnings go to ``warnings``, not to this process's log.
    """
    stage = Stage()
    demo = build_app(store_url, stage)
    try:
        with (
            collected_warnings(warnings),
            counting_publishes(demo),
            stage.watching(),
            logging_left_alone(),
            current_app_kept(),
            start_worker(demo.app, pool="solo", perform_ping_check=False, loglevel="WARNING"),
        ):
            yield demo
    finally:
        demo.close()
