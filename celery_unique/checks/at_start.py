"""The checks a worker runs as it starts, before its pool forks."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from celery_unique.checks import run
from celery_unique.checks.app import uses_celery_unique
from celery_unique.checks.catalogue import Finding
from celery_unique.config import flag
from celery_unique.exceptions import ImproperlyConfigured

logger = logging.getLogger("celery_unique")


def check_at_worker_start(app: Any) -> None:
    """Log each finding once (errors at ERROR); stop the worker on an error if strict.

    Only for an app that uses celery-unique (a unique task, a task with ``unique_*``
    options, a ``unique_*`` setting): the ``celery`` program imports the plugin for
    every app, and a worker of another app has nothing to be told.
    """
    if not uses_celery_unique(app):
        return
    findings = run(app)
    log_findings(findings)
    errors = [each.id for each in findings if each.is_error]
    try:
        strict = flag(app, "unique_strict_checks")
    except ImproperlyConfigured as exc:
        raise SystemExit(f"celery-unique: the worker does not start: {exc}") from exc
    if errors and strict:
        raise SystemExit(
            f"celery-unique: the worker does not start: {', '.join(errors)} "
            "(unique_strict_checks=True)"
        )


def log_findings(findings: Iterable[Finding]) -> None:
    """One log line per finding: errors at ERROR, warnings at WARNING."""
    for each in findings:
        logger.log(
            logging.ERROR if each.is_error else logging.WARNING,
            "%s %s (fix: %s)",
            each.id,
            each.message,
            each.hint,
        )
