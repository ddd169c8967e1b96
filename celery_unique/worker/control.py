"""Which apps have the worker side, and the remote control command by which a worker says so.

``celery unique check --fleet`` broadcasts it; a worker without celery-unique
answers with an error instead (no such command), which is how a mixed fleet
shows itself, as does a worker whose app has no unique task (its worker
side is not installed: it releases no key).
"""

from __future__ import annotations

import importlib.metadata
import weakref
from typing import Any

from celery import Celery
from celery.worker.control import inspect_command

from celery_unique.checks.fleet import COMMAND

#: Apps whose worker side is installed (a worker prepares only those).
_installed: weakref.WeakSet[Celery] = weakref.WeakSet()


def mark_installed(app: Celery) -> None:
    """Note that ``app`` has the worker side (its tasks bound here release their keys)."""
    _installed.add(app)


def installed_in(app: Celery) -> bool:
    """Whether ``app`` has the worker side (a unique task of it was bound in this process)."""
    return app in _installed


def installed_apps() -> list[Celery]:
    """The apps with the worker side in this process."""
    return list(_installed)


@inspect_command(name=COMMAND)
def unique_plugin(state: Any) -> dict[str, Any]:
    """This worker's celery-unique version, and whether its app has the worker side."""
    # The command is registered in every process that imports the package
    # (the ``celery`` program loads it as a subcommand): what counts is
    # whether the worker's own app installed the worker side.
    return {"version": _version(), "installed": installed_in(state.consumer.app)}


def _version() -> str:
    try:
        return importlib.metadata.version("celery-unique")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree
        return "unknown"
