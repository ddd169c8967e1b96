"""The request fingerprint stored with a window key, and the policy digest beside it.

Two dispatches are "the same request" when everything that shapes the job's
effect matches: task, payload, routing, priority, requested start time, the
uniqueness keys themselves, user headers and callbacks. Retry and time-limit
settings are kept apart, in the policy digest: a difference there is drift
(the existing job keeps its settings), not a conflict.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery_unique.keys.arguments import json_payload
from celery_unique.keys.canonical import canonical_digest

#: Version of what a fingerprint covers; part of the digest.
FINGERPRINT_VERSION = 1
#: Stored digests are truncated: 128 bits tell requests apart, 64 bits tell policies apart.
FINGERPRINT_HEX = 32
POLICY_HEX = 16

_ROUTING = ("queue", "exchange", "routing_key", "priority")
_TASK_POLICY = (
    "max_retries",
    "retry_backoff",
    "retry_backoff_max",
    "retry_jitter",
    "default_retry_delay",
    "time_limit",
    "soft_time_limit",
    "expires",
)


def _name(value: Any) -> Any:
    # Queue and Exchange objects are identified by their names.
    return getattr(value, "name", value)


def _when(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def request_fingerprint(
    *,
    task_name: str,
    payload: Mapping[str, Any],
    options: Mapping[str, Any],
    keys: Mapping[str, Any],
    headers: Mapping[str, Any] | None,
    link: Any,
    link_error: Any,
    chain: Any = None,
) -> str:
    """Digest of everything that makes two dispatches the same request."""
    document = {
        "v": FINGERPRINT_VERSION,
        "task": task_name,
        "payload": payload,
        "routing": {name: _name(options.get(name)) for name in _ROUTING},
        # countdown=0 and no countdown both mean "start now".
        "start": {"eta": _when(options.get("eta")), "countdown": options.get("countdown") or None},
        "keys": dict(keys),
        "extra": _extra(headers, link, link_error, chain),
    }
    # Payload and extras come out of json.loads, the rest are names, numbers
    # and times: no container here can smuggle in a key that encodes like
    # another, which is what the full check guards against.
    return canonical_digest(document, checked=False)[:FINGERPRINT_HEX]


#: What :func:`_extra` returns for most dispatches, worked out once.
_NO_EXTRA = json_payload({"headers": {}, "link": None, "link_error": None})


#: Options of a signature that name its job rather than say what it does: a
#: frozen continuation gets fresh ids on every dispatch of the same request.
_JOB_IDENTITY = frozenset({"task_id", "root_id", "parent_id", "group_id", "group_index"})


def _extra(
    headers: Mapping[str, Any] | None, link: Any, link_error: Any, chain: Any
) -> dict[str, Any]:
    if not headers and link is None and link_error is None and not chain:
        return _NO_EXTRA
    # Headers and callbacks may hold any serializable value: hash them in the
    # form the broker will carry.
    extra = {"headers": dict(headers or {}), "link": link, "link_error": link_error}
    if chain:
        # Only when there is one: digests of requests without a chain stay as
        # they were before chains were covered.
        extra["chain"] = chain
    cleaned: dict[str, Any] = _without_identity(json_payload(extra))
    return cleaned


def _without_identity(value: Any) -> Any:
    """``value`` with the job-naming options of every signature in it removed."""
    if isinstance(value, list):
        return [_without_identity(item) for item in value]
    if not isinstance(value, dict):
        return value
    signature = "task" in value and isinstance(value.get("options"), dict)
    return {
        name: (
            {k: _without_identity(v) for k, v in item.items() if k not in _JOB_IDENTITY}
            if signature and name == "options"
            else _without_identity(item)
        )
        for name, item in value.items()
    }


def policy_digest(task: Any, options: Mapping[str, Any]) -> str:
    """Digest of retry, time-limit and expiry settings: differences are drift only."""
    settings = (
        _when(options[name]) if options.get(name) is not None else getattr(task, name, None)
        for name in _TASK_POLICY
    )
    # Types are part of the cache key: True == 1 == 1.0, but they digest apart.
    typed = tuple((type(value), value) for value in settings)
    try:
        return _policy_digest(typed)
    except TypeError:  # an unhashable setting (a list, say)
        return _policy_digest.__wrapped__(typed)


@functools.lru_cache(maxsize=256)
def _policy_digest(typed: tuple[tuple[type, Any], ...]) -> str:
    # Settings rarely change, so a task's digest is worked out once, not per dispatch.
    document = {name: value for name, (_, value) in zip(_TASK_POLICY, typed, strict=True)}
    return canonical_digest(json_payload(document))[:POLICY_HEX]
