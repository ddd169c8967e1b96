"""The check that asks the running workers whether they run the plugin."""

from __future__ import annotations

from typing import Any

from celery_unique.checks.catalogue import Finding, finding

#: The remote control command a worker with the plugin answers (see ``worker.control``).
COMMAND = "unique_plugin"


def fleet_findings(app: Any, timeout: float = 2.0) -> list[Finding]:
    """One finding per worker of the app that answers without the plugin."""
    return [
        finding(
            "celery_unique.W027",
            worker,
            f"worker {worker} runs without celery-unique: jobs it runs are neither "
            "marked nor released, their keys wait for the lease",
        )
        for worker, version in plugin_versions(app, timeout).items()
        if version is None
    ]


def plugin_versions(app: Any, timeout: float = 2.0) -> dict[str, str | None]:
    """Each answering worker and the plugin version it runs (``None``: without the plugin)."""
    replies = app.control.inspect(timeout=timeout)._request(COMMAND) or {}
    return {
        worker: reply.get("version") if isinstance(reply, dict) and reply.get("installed") else None
        for worker, reply in sorted(replies.items())
    }
