"""The checks a worker runs as it starts, before its pool forks."""

from __future__ import annotations

import logging
from typing import Any

from celery_unique.checks import run
from celery_unique.config import setting

logger = logging.getLogger("celery_unique")


def check_at_worker_start(app: Any) -> None:
    """Log each finding once (errors at ERROR); stop the worker on an error if strict."""
    findings = run(app)
    for each in findings:
        logger.log(
            logging.ERROR if each.is_error else logging.WARNING,
            "%s %s (fix: %s)",
            each.id,
            each.message,
            each.hint,
        )
    errors = [each.id for each in findings if each.is_error]
    if errors and setting(app, "unique_strict_checks"):
        raise SystemExit(
            f"celery-unique: the worker does not start: {', '.join(errors)} "
            "(unique_strict_checks=True)"
        )
