"""What a duplicate does to the job holding its key: ``unique_on_duplicate``.

``"reuse"`` (the default) hands the duplicate the holder and changes nothing.
``"latest"`` and ``"debounce"`` make the holder follow its duplicates:

* while the holder has not started, a duplicate's arguments replace the ones
  it will run with (stored with its key; the worker reads them in the round
  trip that marks the run); under ``"debounce"`` its start also moves to
  ``unique_debounce`` after the duplicate, never past ``unique_debounce_max``
  after the dispatch that created it;
* while the holder runs, a duplicate leaves its arguments and one owed run:
  when the holder ends for good, the worker that frees its key hands it, in
  the same store operation, to that run and publishes it
  (:mod:`celery_unique.worker.follow_up`).

The store sees the arguments as an opaque string: the task's own serializer's
bytes, base64-encoded (no separator a store uses can appear in it), signed for
the key that keeps them (:mod:`celery_unique.stores.signing`). The worker decodes them
only with the task's own serializer, and only when the signature holds.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from kombu.exceptions import EncodeError
from kombu.serialization import dumps, loads
from kombu.serialization import registry as serializers  # type: ignore[attr-defined]

from celery_unique.config.durations import parse_window
from celery_unique.exceptions import InvalidDeclaration, InvalidPayload, InvalidWindow
from celery_unique.stores import signing
from celery_unique.stores.base import OnDuplicate, Scope

if TYPE_CHECKING:
    from celery import Task

#: ``unique_latest_max_bytes`` unless declared: the largest arguments a key stores.
DEFAULT_LATEST_MAX_BYTES = 64 * 1024
#: The most ``unique_latest_max_bytes`` may allow: a duplicate's arguments travel in
#: its decision, which holds the store (a Redis server: every client) while it runs.
MAX_LATEST_MAX_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class DuplicatePolicy:
    """A task's (or one dispatch's) ``unique_on_duplicate`` and its parameters, checked."""

    on_duplicate: OnDuplicate = OnDuplicate.REUSE
    debounce_ms: int | None = None
    debounce_max_ms: int | None = None
    latest_max_bytes: int = DEFAULT_LATEST_MAX_BYTES

    @property
    def follows(self) -> bool:
        """Whether the holder follows its duplicates (anything but ``reuse``)."""
        return self.on_duplicate is not OnDuplicate.REUSE

    def check_keys(self, *, has_active_key: bool, has_window_key: bool, scope: Scope) -> None:
        """Refuse keys this policy cannot follow (at definition, and per dispatch)."""
        if not self.follows:
            return
        name = f"unique_on_duplicate={self.on_duplicate.value!r}"
        if has_window_key:
            raise InvalidDeclaration(
                f"{name} applies to active keys only: a window key answers the same request "
                "with the same job and another request with a conflict, never with new "
                "arguments (drop unique_window_key, or keep the default 'reuse')"
            )
        if has_active_key and scope is Scope.QUEUED:
            raise InvalidDeclaration(
                f"{name} needs unique_while='active' or 'exists': a 'queued' key is freed "
                "as the job starts, so no job would be there to take new arguments or to "
                "owe a run"
            )
        if self.on_duplicate is OnDuplicate.DEBOUNCE and self.debounce_ms is None:
            raise InvalidDeclaration(f"{name} needs unique_debounce (a timedelta or seconds)")


def parse_on_duplicate(value: object) -> OnDuplicate:
    try:
        return OnDuplicate(value)
    except ValueError:
        names = ", ".join(repr(policy.value) for policy in OnDuplicate)
        raise InvalidDeclaration(
            f"unique_on_duplicate must be one of {names}, not {value!r}"
        ) from None


def parse_policy(
    options: Mapping[str, Any], base: DuplicatePolicy | None = None
) -> DuplicatePolicy:
    """The policy ``options`` give (``unique_on_duplicate``, ``unique_debounce``...) over
    ``base``."""
    base = base or DuplicatePolicy()
    on_duplicate = base.on_duplicate
    if options.get("unique_on_duplicate") is not None:
        on_duplicate = parse_on_duplicate(options["unique_on_duplicate"])
    debounce_ms, debounce_max_ms = base.debounce_ms, base.debounce_max_ms
    if options.get("unique_debounce") is not None:
        debounce_ms = parse_window(options["unique_debounce"], "unique_debounce")
    if options.get("unique_debounce_max") is not None:
        debounce_max_ms = parse_window(options["unique_debounce_max"], "unique_debounce_max")
    if debounce_max_ms is not None:
        if debounce_ms is None:
            raise InvalidWindow("unique_debounce_max needs unique_debounce")
        if debounce_max_ms < debounce_ms:
            raise InvalidWindow(
                f"unique_debounce_max ({debounce_max_ms} ms) must not be shorter than "
                f"unique_debounce ({debounce_ms} ms)"
            )
    latest_max_bytes = base.latest_max_bytes
    raw = options.get("unique_latest_max_bytes")
    if raw is not None:
        if isinstance(raw, bool) or not isinstance(raw, int) or not 0 < raw <= MAX_LATEST_MAX_BYTES:
            raise InvalidDeclaration(
                "unique_latest_max_bytes must be a positive number of bytes, at most "
                f"{MAX_LATEST_MAX_BYTES:,} (16 MiB), not {raw!r}"
            )
        latest_max_bytes = raw
    return DuplicatePolicy(on_duplicate, debounce_ms, debounce_max_ms, latest_max_bytes)


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def planned_start(starts_at_ms: int | None) -> datetime | None:
    """A planned start the store answered (ms since the epoch, its clock) as a UTC datetime,
    to the millisecond: no other clock is read, so successive answers keep their order."""
    return None if starts_at_ms is None else _EPOCH + timedelta(milliseconds=starts_at_ms)


def encode_arguments(
    task: Task[Any, Any],
    args: Any,
    kwargs: Any,
    max_bytes: int,
    *,
    storage_key: str,
    signing_key: bytes,
) -> str:
    """``(args, kwargs)`` as the store keeps them under ``storage_key``, signed;
    :class:`InvalidPayload` if too large."""
    try:
        content_type, encoding, body = dumps(
            [list(args or ()), dict(kwargs or {})], serializer=task.serializer
        )
    except EncodeError as exc:
        raise InvalidPayload(f"the arguments of {task.name} cannot be stored: {exc}") from exc
    raw = body.encode(encoding) if isinstance(body, str) else body
    if len(raw) > max_bytes:
        raise InvalidPayload(
            f"the arguments of {task.name} are {len(raw):,} bytes, more than "
            f"unique_latest_max_bytes ({max_bytes:,}) allows a key to keep"
        )
    encoded = f"{content_type}|{encoding}|{base64.b64encode(raw).decode('ascii')}"
    return signing.sign(signing_key, storage_key, encoded)


class RefusedArguments(Exception):
    """Stored arguments that must not be run: unsigned, forged, moved from another key,
    or not in the task's own serializer's format. The message says which."""


def decode_arguments(
    task: Task[Any, Any], storage_key: str, stored: str, signing_key: bytes
) -> tuple[list[Any], dict[str, Any]]:
    """The ``(args, kwargs)`` :func:`encode_arguments` stored for ``task`` under
    ``storage_key``; :class:`RefusedArguments` unless the signature holds and they are in
    the task's own serializer's format (the store never chooses a decoder)."""
    encoded = signing.verified(signing_key, storage_key, stored)
    if encoded is None:
        raise RefusedArguments(
            "their signature does not match (written without the app's unique_signing_key, "
            "changed in the store, or moved from another key)"
        )
    content_type, encoding, body = encoded.split("|", 2)
    own = serializers.name_to_type.get(task.serializer, task.serializer)
    if content_type != own:
        raise RefusedArguments(
            f"they are {content_type!r}, not the task's own serializer's {own!r}"
        )
    try:
        args, kwargs = loads(base64.b64decode(body), content_type, encoding, accept=[own])
    except Exception as exc:
        raise RefusedArguments(f"they cannot be decoded: {exc!r}") from exc
    return list(args), dict(kwargs)
