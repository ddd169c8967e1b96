"""Prometheus counters for uniqueness outcomes, fed by :mod:`celery_unique.signals`.

Needs ``prometheus-client`` (``pip install 'celery-unique[prometheus]'``)::

    from celery_unique import metrics

    metrics.install()  # once per process: the producers' (web app), and each worker's

Releases are counted where they happen, in a worker's main process (connect
``install`` to ``worker_init``); creations, reuses and conflicts where the
dispatch is made (a pool child dispatching jobs counts its own: connect it to
``worker_process_init`` too).

Counters (all labelled by ``task``):

* ``celery_unique_jobs_created_total``
* ``celery_unique_jobs_reused_total`` (``match``: ``active`` | ``window``;
  ``policy_drift``: ``true`` | ``false``)
* ``celery_unique_conflicts_total`` (``reason``: the error code)
* ``celery_unique_keys_released_total`` (``reason``: ``started``, ``finished``,
  ``operator``, ``reaped``)
* ``celery_unique_reruns_owed_total``: ``latest``/``debounce`` duplicates that met
  their job running (one run follows the job, however many there are)
* ``celery_unique_postponed_total``: ``debounce`` duplicates that moved their job's start

Exposing them (``prometheus_client.start_http_server``, multiprocess mode for
prefork workers) is the application's choice, as for any other counter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery.utils.dispatch import Signal

from celery_unique import signals
from celery_unique.exceptions import ImproperlyConfigured


@dataclass(frozen=True)
class Installed:
    """The counters :func:`install` created and the receivers feeding them."""

    created: Any
    reused: Any
    conflicts: Any
    released: Any
    reruns_owed: Any
    postponed: Any
    receivers: tuple[tuple[Signal, Callable[..., None], str], ...]


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImproperlyConfigured(
            "celery_unique.metrics needs prometheus-client: pip install 'celery-unique[prometheus]'"
        ) from exc
    return prometheus_client


def _label(value: Any) -> str:
    return str(getattr(value, "value", value) or "")


def install(registry: Any = None, prefix: str = "celery_unique") -> Installed:
    """Create the counters in ``registry`` (default: the global one) and connect them."""
    prometheus = _prometheus()
    registry = prometheus.REGISTRY if registry is None else registry

    def counter(name: str, doc: str, *labels: str) -> Any:
        return prometheus.Counter(f"{prefix}_{name}", doc, ("task", *labels), registry=registry)

    created = counter("jobs_created", "Unique dispatches that created a job.")
    reused = counter(
        "jobs_reused", "Dispatches that returned an existing job.", "match", "policy_drift"
    )
    conflicts = counter("conflicts", "Dispatches refused by a uniqueness conflict.", "reason")
    released = counter("keys_released", "Active keys released.", "reason")
    reruns = counter("reruns_owed", "Duplicates that met their job running and owe it a run.")
    postponements = counter("postponed", "Duplicates that moved their job's start later.")

    def on_created(task_name: str = "", **_: Any) -> None:
        created.labels(task_name).inc()

    def on_reused(
        task_name: str = "", match: Any = None, policy_drift: bool = False, **_: Any
    ) -> None:
        reused.labels(task_name, _label(match), str(bool(policy_drift)).lower()).inc()

    def on_conflict(task_name: str = "", reason: str = "", **_: Any) -> None:
        conflicts.labels(task_name, reason).inc()

    def on_released(task_name: str | None = None, reason: Any = None, **_: Any) -> None:
        released.labels(task_name or "", _label(reason)).inc()

    def on_rerun_owed(task_name: str = "", **_: Any) -> None:
        reruns.labels(task_name).inc()

    def on_postponed(task_name: str = "", **_: Any) -> None:
        postponements.labels(task_name).inc()

    receivers: tuple[tuple[Signal, Callable[..., None], str], ...] = tuple(
        (signal, receiver, f"celery_unique.metrics.{receiver.__name__}.{id(registry)}")
        for signal, receiver in (
            (signals.job_created, on_created),
            (signals.job_reused, on_reused),
            (signals.uniqueness_conflict, on_conflict),
            (signals.key_released, on_released),
            (signals.rerun_owed, on_rerun_owed),
            (signals.postponed, on_postponed),
        )
    )
    for signal, receiver, uid in receivers:
        signal.connect(receiver, weak=False, dispatch_uid=uid)
    return Installed(created, reused, conflicts, released, reruns, postponements, receivers)


def uninstall(installed: Installed) -> None:
    """Disconnect the counters' receivers (the counters stay in their registry)."""
    for signal, _, uid in installed.receivers:
        signal.disconnect(dispatch_uid=uid)
