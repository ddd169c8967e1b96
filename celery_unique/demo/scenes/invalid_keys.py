"""Invalid keys: refused before anything is written to the store or published."""

from __future__ import annotations

from collections.abc import Callable

from celery_unique import UniquenessError
from celery_unique.demo.report import Refusal, Report
from celery_unique.demo.stage import Demo


def play(demo: Demo, report: Report) -> None:
    """Keys that break the key rules: refused before the store or the broker is touched."""
    export, notify = demo.tasks["export"], demo.tasks["notify"]
    attempts: list[tuple[str, Callable[[], object]]] = [
        ("unique_key=''", lambda: export.apply_async((7,), unique_key="")),
        ("unique_key='x' * 513", lambda: export.apply_async((7,), unique_key="x" * 513)),
        ("unique_key='tenant\\t7'", lambda: export.apply_async((7,), unique_key="tenant\t7")),
        ("unique_key='\\ud800'", lambda: export.apply_async((7,), unique_key="\ud800")),
        ("unique_key=7", lambda: export.apply_async((7,), unique_key=7)),
        ("selector -> 'user:ann\\nbob'", lambda: notify.delay("ann\nbob")),
    ]
    for given, attempt in attempts:
        keys, messages = demo.store_keys(), len(demo.published)
        try:
            attempt()
        except UniquenessError as error:
            code, message = error.code, str(error)
        else:
            code, message = "accepted", "the dispatch was accepted"
        report.invalid.append(
            Refusal(
                given=given,
                code=code,
                message=message,
                keys_written=demo.store_keys() - keys,
                messages_published=len(demo.published) - messages,
            )
        )
