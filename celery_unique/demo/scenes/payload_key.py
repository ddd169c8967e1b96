"""A key derived from some paths of the payload: ``Payload(only=[...])``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from celery_unique import Payload
from celery_unique.demo.report import Labels, Report, dispatched
from celery_unique.demo.stage import Demo, describe


def play(demo: Demo, report: Report) -> None:
    """A key derived from two paths of the payload; other arguments do not count."""
    task, labels = demo.tasks["payload"], Labels()
    spec = Payload(only=[".user_id", ".template"])
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("send_digest(42, 'weekly', '09:00')", (42, "weekly", "09:00"), {}),
        (
            "send_digest(42, template='weekly', requested_at='09:05')",
            (42,),
            {"template": "weekly", "requested_at": "09:05"},
        ),
        ("send_digest(42, 'monthly', '09:05')", (42, "monthly", "09:05"), {}),
    ]
    with demo.worker_busy():
        for step, args, kwargs in calls:
            # The same computation the dispatch does, by hand: the payload is the
            # arguments by parameter name.
            names = ("user_id", "template", "requested_at")
            payload = dict(zip(names, args, strict=False), **kwargs)
            digest = spec.key(payload)
            before = describe(demo.held(task, digest), labels)
            result = task.apply_async(args, kwargs)
            row = dispatched(step, result, labels, before)
            held = demo.held(task, digest)
            report.payload.append(replace(row, detail=f"{task.name}:{digest}"))
            report.payload_keys_held.append(held is not None and held.job_id == result.id)
    demo.stage.wait_finished(labels.ids, demo.store)
