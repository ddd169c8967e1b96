"""Configuration checks: a misconfiguration is reported before it costs a job.

Every check has a stable id (``celery_unique.E0xx`` for errors,
``celery_unique.W0xx`` for warnings), the same wherever it runs:

* ``celery -A proj unique check`` (exit code 1 on an error; ``--json``;
  ``--fleet`` asks the running workers too);
* when a worker starts (each finding logged once; the worker stops on an
  error only with ``unique_strict_checks=True``);
* ``manage.py check`` in a Django project (the store-reaching ones with
  ``--deploy``).

:mod:`~celery_unique.checks.catalogue` lists them all, with their fixes;
:mod:`~celery_unique.checks.app` holds the checks that read only the app
(its tasks and settings), :mod:`~celery_unique.checks.store` those that ask
the store, :mod:`~celery_unique.checks.fleet` the one that asks the workers.
"""

from __future__ import annotations

from typing import Any

from celery_unique.checks.app import app_findings
from celery_unique.checks.catalogue import CATALOGUE, Finding, Level
from celery_unique.checks.fleet import fleet_findings
from celery_unique.checks.store import store_findings

__all__ = ["CATALOGUE", "Finding", "Level", "app_findings", "run", "store_findings"]


def run(app: Any, *, store: bool = True, fleet: bool = False) -> list[Finding]:
    """Every finding for ``app``: its tasks and settings, then its store, then its workers."""
    findings = app_findings(app)
    if store:
        findings += store_findings(app, findings)
    if fleet:
        findings += fleet_findings(app)
    return findings
