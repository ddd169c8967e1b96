"""Configuration checks: a misconfiguration is reported before it costs a job.

Every check has a stable id (``celery_unique.E0xx`` for errors,
``celery_unique.W0xx`` for warnings), the same wherever it runs:

* ``celery -A proj unique check`` (exit code 1 on an error; ``--json``;
  ``--fleet`` asks the running workers too);
* when a worker of an app that uses celery-unique starts (each finding logged
  once; the worker stops on an error only with ``unique_strict_checks=True``);
* ``manage.py check`` in a Django project (the store-reaching ones with
  ``--deploy``);
* at a task's first dispatch in a process, those about the task alone
  (:mod:`~celery_unique.checks.at_dispatch`).

A check that raises is a finding of its own (E013): the others still report. A task
refused as a check defines it (its ``unique_*`` options are malformed) is E014.

:mod:`~celery_unique.checks.catalogue` lists them all, with their fixes;
:mod:`~celery_unique.checks.app` holds the checks that read only the app
(its tasks and settings), :mod:`~celery_unique.checks.store` those that ask
the store, :mod:`~celery_unique.checks.fleet` the one that asks the workers.
"""

from __future__ import annotations

from typing import Any

from celery_unique.checks.app import app_findings
from celery_unique.checks.catalogue import (
    CATALOGUE,
    Finding,
    Level,
    invalid_declaration,
    isolated,
    unfinished,
)
from celery_unique.checks.fleet import fleet_findings
from celery_unique.checks.store import store_findings
from celery_unique.exceptions import InvalidDeclaration

__all__ = [
    "CATALOGUE",
    "Finding",
    "Level",
    "app_findings",
    "import_task_modules",
    "run",
    "store_findings",
]


def run(app: Any, *, store: bool = True, fleet: bool = False) -> list[Finding]:
    """Every finding for ``app``: its tasks and settings, then its store, then its workers.

    They see the tasks registered so far: outside a worker, call
    :func:`import_task_modules` first.
    """
    findings = app_findings(app)
    if store:
        findings += store_findings(app, findings)
    if fleet:
        broker = app.conf.broker_url if isinstance(app.conf.broker_url, str) else None
        findings += isolated("celery_unique.W027", "workers", fleet_findings, app, url=broker)
    return findings


def import_task_modules(app: Any) -> list[Finding]:
    """Import the app's task modules as its worker would (``imports``, ``include`` and
    ``autodiscover_tasks()``), so that the checks see every task.

    A module that cannot be imported is a finding (E013); the checks then see the tasks
    registered until then.
    """
    try:
        app.loader.import_default_modules()
    except InvalidDeclaration as exc:  # A task of a module imported after the app finalized.
        return [invalid_declaration(exc)]
    except Exception as exc:
        hint = "make the module import: a worker of the app does not start either"
        return [unfinished("every task (its modules must import)", "imports", exc, None, hint)]
    return []
