"""Settings, read from the Celery app's configuration at first use, and the store they name.

In Django, ``CELERY_UNIQUE_BACKEND`` and friends arrive through
``config_from_object("django.conf:settings", namespace="CELERY")``.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

from celery import Celery

from celery_unique.config.booleans import parse_bool
from celery_unique.config.durations import parse_duration_ms
from celery_unique.config.eager import EagerRuns
from celery_unique.config.recently_held import RecentlyHeld
from celery_unique.exceptions import ImproperlyConfigured
from celery_unique.keys.keyspace import SPREADS, validate_namespace
from celery_unique.stores import open_store, signing
from celery_unique.stores.base import Store
from celery_unique.stores.masking import masked

logger = logging.getLogger("celery_unique")

#: Every setting with its default.
DEFAULTS: dict[str, Any] = {
    "unique_backend": None,
    "unique_namespace": None,
    "unique_fail_open": False,
    "unique_lease": timedelta(hours=1),
    "unique_strict_checks": False,
    "unique_colocated": "auto",
    "unique_key_spread": "namespace",
    "unique_signing_key": None,
}

_lock = threading.Lock()


@dataclass
class Runtime:
    """One app's settings and store in this process."""

    backend_url: str
    namespace: str
    fail_open: bool
    lease_ms: int | None
    #: ``result_expires`` in ms: how long ``exists`` keys outlive their job by default.
    default_retention_ms: int | None
    #: ``unique_key_spread = "key"``: keys scoped to a task get hash tags of their own.
    spread_keys: bool = False
    pid: int = field(default_factory=os.getpid)
    _store: Store | None = None
    #: Set while the store is unreachable under fail-open, to warn once per outage.
    outage: bool = False
    #: ``unique_colocated``: whether store and broker may share a script.
    colocated: bool = True
    #: The server shared by store and broker (:mod:`celery_unique.dispatch.colocated`);
    #: ``False`` until worked out.
    colocation: Any = False
    recently_held: RecentlyHeld = field(default_factory=RecentlyHeld)
    #: Outcomes of the jobs run eagerly here, for the receipts of their duplicates.
    eager_runs: EagerRuns = field(default_factory=EagerRuns)

    def __repr__(self) -> str:
        # A repr lands in logs and tracebacks; the store's URL may hold its password.
        shown = (
            f"{each.name}={masked(value) if each.name == 'backend_url' else value!r}"
            for each in fields(self)
            if each.repr
            for value in [getattr(self, each.name)]
        )
        return f"{type(self).__name__}({', '.join(shown)})"

    #: The HMAC key of the arguments ``latest``/``debounce`` keys keep
    #: (:mod:`~celery_unique.stores.signing`).
    signing_key: bytes = field(default=b"", repr=False)

    @property
    def store(self) -> Store:
        if self._store is None:
            with _lock:
                if self._store is None:
                    self._store = open_store(self.backend_url)
        return self._store


def runtime(app: Celery) -> Runtime:
    """The app's runtime in this process, built at first use (never at import)."""
    current: Runtime | None = getattr(app, "_celery_unique_runtime", None)
    if current is None or current.pid != os.getpid():
        current = _build(app)
        app._celery_unique_runtime = current  # type: ignore[attr-defined]
    return current


def reset(app: Celery) -> None:
    """Forget the app's runtime (after changing its settings, e.g. in tests)."""
    current: Runtime | None = getattr(app, "_celery_unique_runtime", None)
    if current is not None and current._store is not None and current.pid == os.getpid():
        current._store.close()
    app._celery_unique_runtime = None  # type: ignore[attr-defined]


def setting(app: Celery, name: str) -> Any:
    value = app.conf.get(name)
    return DEFAULTS[name] if value is None else value


def flag(app: Celery, name: str) -> bool:
    """A boolean setting, parsed strictly (:func:`celery_unique.config.booleans.parse_bool`)."""
    return parse_bool(setting(app, name), name)


def colocating(app: Celery) -> bool:
    """``unique_colocated``: ``"auto"`` (or true) lets store and broker share a script;
    false never does."""
    value = setting(app, "unique_colocated")
    if isinstance(value, str) and value.lower() == "auto":
        return True
    try:
        return parse_bool(value, "unique_colocated")
    except ImproperlyConfigured:
        raise ImproperlyConfigured(
            f'unique_colocated must be "auto" or False, not {value!r}'
        ) from None


def _build(app: Celery) -> Runtime:
    lease = setting(app, "unique_lease")
    expires = app.conf.get("result_expires")
    try:
        lease_ms = parse_duration_ms(lease, "unique_lease")
        retention_ms = parse_duration_ms(expires, "result_expires")
    except Exception as exc:
        raise ImproperlyConfigured(str(exc)) from exc
    colocated = colocating(app)
    spread = setting(app, "unique_key_spread")
    if spread not in SPREADS:
        raise ImproperlyConfigured(
            f'unique_key_spread must be "namespace" or "key", not {spread!r}'
        )
    namespace = own_namespace(app)
    return Runtime(
        backend_url=_backend_url(app),
        namespace=namespace,
        fail_open=flag(app, "unique_fail_open"),
        lease_ms=lease_ms or None,
        # Celery reads a result_expires of 0 or None as "never expire".
        default_retention_ms=retention_ms or None,
        spread_keys=spread == "key",
        colocated=colocated,
        signing_key=_signing_key(app, namespace),
    )


def own_namespace(app: Celery) -> str:
    """The namespace of every key of ``app`` (``unique_namespace``, else the app's name)."""
    return validate_namespace(str(setting(app, "unique_namespace") or app.main or "celery"))


def _signing_key(app: Celery, namespace: str) -> bytes:
    secret = setting(app, "unique_signing_key")
    if secret is not None and (not isinstance(secret, str | bytes) or not secret):
        # Never the value itself: it is a secret, and this message reaches logs.
        given = "an empty one" if isinstance(secret, str | bytes) else type(secret).__name__
        raise ImproperlyConfigured(
            f"unique_signing_key must be a non-empty string or bytes, not {given}"
        )
    return signing.signing_key(app, namespace)


def configured_backend_url(app: Celery) -> str | None:
    """The store's URL as the app will open it: ``unique_backend``, else a Redis broker's;
    ``None`` when there is neither."""
    url = setting(app, "unique_backend")
    if url:
        return str(url)
    broker = app.conf.broker_url or ""
    if isinstance(broker, str) and broker.split("://", 1)[0] in ("redis", "rediss"):
        return with_broker_tls(broker, app.conf.get("broker_use_ssl"))
    return None


#: ``broker_use_ssl`` entries the store's Redis client takes as they are.
_TLS_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")


def with_broker_tls(url: str, use_ssl: object) -> str:
    """The broker's Redis URL as the store opens it: over TLS, with the broker's
    certificates, when ``broker_use_ssl`` puts the broker on TLS.

    kombu connects a ``redis://`` broker over TLS when ``broker_use_ssl`` is set;
    a store opened from the same URL without it would talk in plain text, its
    password (``AUTH``) included, or fail against a TLS-only server.
    """
    if not use_ssl:
        return url
    scheme, _, rest = url.partition("://")
    query: dict[str, str] = {}
    if isinstance(use_ssl, Mapping):
        for name, value in use_ssl.items():
            if name not in _TLS_OPTIONS:
                raise ImproperlyConfigured(
                    f"broker_use_ssl option {name!r} cannot be passed on to the uniqueness "
                    "store, which uses the broker's Redis: set unique_backend to a rediss:// "
                    f"URL with its TLS options (the store takes {', '.join(_TLS_OPTIONS)})"
                )
            query[name] = (
                _CERT_REQS.get(value, str(value)) if name == "ssl_cert_reqs" else str(value)
            )
    elif use_ssl is not True:
        raise ImproperlyConfigured(
            f"broker_use_ssl must be True or a dict of TLS options, not {use_ssl!r}"
        )
    tls_url = f"rediss://{rest}" if scheme == "redis" else url
    if not query:
        return tls_url
    return f"{tls_url}{'&' if '?' in rest else '?'}{urlencode(query)}"


_CERT_REQS = {ssl.CERT_NONE: "none", ssl.CERT_OPTIONAL: "optional", ssl.CERT_REQUIRED: "required"}


def _backend_url(app: Celery) -> str:
    url = configured_backend_url(app)
    if url is not None:
        return url
    raise ImproperlyConfigured(
        "celery-unique has no store: set the Celery setting unique_backend "
        "(CELERY_UNIQUE_BACKEND in Django), e.g. 'redis://localhost:6379/0' or "
        "'sqlite:///unique.db'; only a Redis broker is used as the store by default"
    )
