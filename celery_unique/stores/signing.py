"""The signature on the arguments a ``latest``/``debounce`` key keeps in the store.

A worker runs a job with the arguments its latest duplicate left in the store
(:mod:`celery_unique.options.duplicates`). The store is not where jobs come from, the
broker is: so the producer signs what it stores, an HMAC-SHA256 over the
storage key and the encoded arguments, and the worker runs only arguments
whose signature holds for the key it reads them from. Arguments moved from
one key to another, edited, or written by anything without the key fail the
check and are refused.

The key is the setting ``unique_signing_key`` (a string or bytes, the same on
every producer and worker of the app). When it is not set, an app configured
from the Django settings (``config_from_object("django.conf:settings", ...)``)
with ``celery_unique_django`` installed derives it from ``SECRET_KEY``.
Elsewhere an unset key falls back to one derived from the app's namespace:
that still catches damaged and misplaced records, but anyone who can write
the store can forge it, which the check ``celery_unique.W030`` reports.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable
from typing import Any

#: Prefix of a signed stored value; a future algorithm gets another.
MARK = "s1:"
#: What the signature covers is prefixed with this, so it signs nothing else.
_PURPOSE = b"celery-unique latest arguments v1"
_SEPARATOR = b"\x1f"

#: Where an app's key comes from when ``unique_signing_key`` is not set: Django's
#: ``SECRET_KEY`` for an app configured from the Django settings (given by the
#: Django app as it starts); ``None`` for any other app.
_default_secret: Callable[[Any], str | bytes | None] | None = None


def use_default_secret(source: Callable[[Any], str | bytes | None]) -> None:
    """Derive an app's key from ``source(app)`` when its ``unique_signing_key`` is not set."""
    global _default_secret
    _default_secret = source


def configured_secret(app: Any) -> str | bytes | None:
    """``unique_signing_key``, else the default secret (Django's); ``None`` when neither."""
    value = app.conf.get("unique_signing_key")
    if value:
        return value  # type: ignore[no-any-return]
    return _default_secret(app) if _default_secret is not None else None


def signing_key(app: Any, namespace: str) -> bytes:
    """The HMAC key of ``app``: derived from its secret, else from its ``namespace``."""
    secret = configured_secret(app)
    if secret is None:
        secret = f"celery-unique unsigned namespace {namespace}"
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    # Derived rather than used as is: SECRET_KEY signs other things too.
    return hmac.new(raw, _PURPOSE, hashlib.sha256).digest()


def sign(key: bytes, storage_key: str, encoded: str) -> str:
    """``encoded`` (arguments for ``storage_key``) with its signature in front."""
    return f"{MARK}{_signature(key, storage_key, encoded)}|{encoded}"


def verified(key: bytes, storage_key: str, stored: str) -> str | None:
    """The encoded arguments of ``stored`` if its signature holds for ``storage_key``;
    else ``None``."""
    if not stored.startswith(MARK):
        return None
    signature, _, encoded = stored[len(MARK) :].partition("|")
    expected = _signature(key, storage_key, encoded)
    if not hmac.compare_digest(signature.encode(), expected.encode()):
        return None
    return encoded


def _signature(key: bytes, storage_key: str, encoded: str) -> str:
    message = _SEPARATOR.join((_PURPOSE, storage_key.encode(), encoded.encode()))
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")
