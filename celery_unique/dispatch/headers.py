"""The one message header that carries a job's keys from producer to worker.

Keys are computed once, on the producer; the worker only reads them back.
One namespaced header, so nothing collides with Celery's own header names.
A worker acts only on keys of its app's own namespace (:func:`own_header`):
a message naming any other key in the store (another application's, or
another namespace's) has that key ignored.
"""

from __future__ import annotations

import logging
from typing import Any, TypedDict

from celery_unique.config import own_namespace
from celery_unique.keys.keyspace import namespace_prefixes

logger = logging.getLogger("celery_unique")

#: The header's fields that name a storage key.
#: Header fields that name keys (``x``: through its ``a``).
_KEY_FIELDS = ("a", "w", "x")

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
    #: The task of the job whose duplicates are owed a run (with ``p``): a replacement
    #: of another task carries it on, so the owed run is the job's own task even where
    #: its key (``unique_prefix=False``) names none.
    t: str
    #: The active key (``a``, ``s``, ``r``) a replacement of another task holds of its
    #: own, beside the replaced job's keys it carries on: released as its scope says.
    x: KeyHeader
    #: The dispatch's generation (see ``ActiveClaim.generation``): the job's releases
    #: end only the hold this dispatch created, not one of a later dispatch of its id.
    g: str


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


def own_header(app: Any, source: Any, job_id: object) -> KeyHeader | None:
    """:func:`read_header`, without any key outside ``app``'s namespace (each logged)."""
    header = read_header(source)
    return None if header is None else confined(header, own_namespace(app), job_id)


def confined(header: KeyHeader, namespace: str, job_id: object) -> KeyHeader:
    """``header`` without the keys that lie outside ``namespace``; each one dropped is
    logged. The same ``header`` when every key is the namespace's."""
    prefixes = namespace_prefixes(namespace)
    foreign = [
        field
        for field in _KEY_FIELDS
        if field in header and not _within(_key_in(header, field), prefixes)
    ]
    if not foreign:
        return header
    for field in foreign:
        logger.warning(
            "job %s: its message names the key %r, outside this app's namespace %r: the "
            "key is ignored (only a message not sent by this app's producers names one)",
            job_id,
            _key_in(header, field),
            namespace,
        )
    return {name: value for name, value in header.items() if name not in foreign}  # type: ignore[return-value]


def _key_in(header: KeyHeader, field: str) -> object:
    value: object = header[field]  # type: ignore[literal-required]
    if field == "x":
        return value.get("a") if isinstance(value, dict) else None
    return value


def _within(key: object, prefixes: tuple[str, ...]) -> bool:
    return isinstance(key, str) and key.startswith(prefixes)
