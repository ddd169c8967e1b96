"""The remote control command by which a worker says it runs the plugin.

``celery unique check --fleet`` broadcasts it; a worker without celery-unique
answers with an error instead (no such command), which is how a mixed fleet
shows itself, as does a worker whose app has no unique task (its worker
side is not installed: it releases no key).
"""

from __future__ import annotations

from typing import Any

from celery.worker.control import inspect_command

from celery_unique.checks.fleet import COMMAND


@inspect_command(name=COMMAND)
def unique_plugin(state: Any) -> dict[str, Any]:
    """This worker's celery-unique version, and whether its app has the worker side."""
    from celery_unique import __version__
    from celery_unique.worker import installed_in

    # The command is registered in every process that imports the package
    # (the ``celery`` program loads it as a subcommand): what counts is
    # whether the worker's own app installed the worker side.
    return {"version": __version__, "installed": installed_in(state.consumer.app)}
