"""The one message header that carries a job's keys from producer to worker.

Keys are computed once, on the producer; the worker only reads them back.
One namespaced header, so nothing collides with Celery's own header names.
"""

from __future__ import annotations

from typing import Any, TypedDict

HEADER = "celery_unique"
VERSION = 1


class KeyHeader(TypedDict, total=False):
    v: int
    #: Storage key of the active-type key, if any.
    a: str
    #: Its scope: "queued" | "active" | "exists".
    s: str
    #: For "exists": ms to keep the key after the job finishes (None: forever).
    r: int | None
    #: Storage key of the window key, if any (never released; for operators).
    w: str
    #: The job id, on a message that continues a job under its id from another
    #: job's worker (the last task of a replacement chain): a re-send, not a dispatch.
    j: str
    #: What duplicates do to the job, when not "reuse": "l" (latest), "d" (debounce).
    p: str


def read_header(source: Any) -> KeyHeader | None:
    """The key header of a task request, a worker request, a message or a headers dict.

    ``None`` without one.

    Tolerates jobs sent by producers without the plugin and headers from a
    future version (ignored rather than misread).
    """
    headers = source if isinstance(source, dict) else getattr(source, "headers", None)
    if not isinstance(headers, dict):
        # A worker's Request (main process) keeps the message headers in request_dict.
        headers = getattr(source, "request_dict", None)
    value = headers.get(HEADER) if isinstance(headers, dict) else None
    if value is None and not isinstance(source, dict):
        value = getattr(source, HEADER, None)
    if isinstance(value, dict) and value.get("v") == VERSION:
        return value  # type: ignore[return-value]
    return None
