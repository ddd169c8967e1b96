"""Checks that ask the store: can it be reached, can it lose keys, who else uses the namespace."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_unique.checks.catalogue import Finding, finding, isolated, unfinished
from celery_unique.config import configured_backend_url, runtime
from celery_unique.exceptions import BackendUnavailable, ImproperlyConfigured
from celery_unique.options.declaration import declared
from celery_unique.stores.base import EvictionUnknown
from celery_unique.stores.masking import masked, redacted

#: How long an app's entry in the namespace registry counts without being renewed.
REGISTRY_KEEP_MS = 7 * 24 * 3600 * 1000
_EVICTION_FREE = ("noeviction", "")
#: What cannot be checked when the store cannot even be built.
_STORE_CHECKS = "the store (celery_unique.E012, W012, E026, W025)"


def store_findings(app: Any, earlier: Sequence[Finding] = ()) -> list[Finding]:
    """Findings that need the store; none when the app's own checks found no usable store.

    Each check runs on its own: one that raises is reported (E013) beside the others.
    """
    url = configured_backend_url(app)
    if url is None or any(each.id == "celery_unique.E001" for each in earlier):
        return []
    try:
        rt = runtime(app)
    except Exception as exc:  # A setting the store is built with is wrong (unique_lease).
        return [unfinished(_STORE_CHECKS, "unique_backend", exc, url)]
    try:
        store = rt.store
        store.ping()
    except Exception as exc:  # Whatever it raises, the store cannot be used.
        return [_unusable(rt.fail_open, url, exc)]
    findings = isolated("celery_unique.E026", "unique_backend", _eviction, store, url, url=url)
    findings += isolated(
        "celery_unique.W025",
        "unique_namespace",
        _shared_namespace,
        app,
        store,
        rt.namespace,
        url=url,
    )
    return findings


def _unusable(fail_open: bool, url: str, exc: Exception) -> Finding:
    """E001 for a URL that cannot be used as written; else E012 (W012 failing open), which
    names why the store cannot be used: its login or what its settings ask refused, no
    table yet, or no answer."""
    said = redacted(str(exc), url)
    if (
        isinstance(exc, ImproperlyConfigured)
        and not isinstance(exc, BackendUnavailable)
        and not _not_set_up(exc)
    ):
        return finding(
            "celery_unique.E001",
            "unique_backend",
            f"unique_backend cannot be used as written: {said}",
            "correct unique_backend: a URL is used exactly as written, or refused",
        )
    code = (
        "improperly_configured" if isinstance(exc, ImproperlyConfigured) else "backend_unavailable"
    )
    consequence = (
        "unique dispatches are published without uniqueness (fail-open)"
        if fail_open
        else f"unique dispatches fail with {code} (fail-closed)"
    )
    what, fix = unusable_because(exc)
    if (
        isinstance(exc, BackendUnavailable)
        and isinstance(exc, ImproperlyConfigured)
        and not (what.startswith("refuses the credentials"))
    ):
        # A refused database or an ACL refusal: the store answers, and says no.
        what = "refuses what its settings ask"
        fix = "correct unique_backend or the store's ACL"
    return finding(
        "celery_unique.W012" if fail_open else "celery_unique.E012",
        "unique_backend",
        f"the uniqueness store {masked(url)} {what}: {said}",
        f"until then, {consequence}; {fix}",
    )


#: How stores and their clients word a refused login (redis-py raises ResponseError for some).
_AUTH_WORDS = ("NOAUTH", "WRONGPASS", "invalid username-password", "Authentication")


def unusable_because(error: BaseException) -> tuple[str, str]:
    """Why a store that raised ``error`` on its first command cannot be used, and the fix:
    its login refused, its table not migrated, the store not set up in this process, or no
    answer at all."""
    chain = _causes(error)
    kinds = {type(each).__name__ for each in chain}
    if any("Authentication" in kind for kind in kinds) or any(
        word in str(each) for each in chain for word in _AUTH_WORDS
    ):
        return (
            "refuses the credentials it is given",
            "correct the user name and password in unique_backend (or the store's ACL)",
        )
    if any("manage.py migrate" in str(each) for each in chain):
        return ("has no table yet", "run the migration the message names")
    if any(isinstance(each, (ImproperlyConfigured, ImportError)) for each in chain):
        return (
            "cannot be opened in this process",
            "install or configure what the message names (for django://, add "
            "celery_unique_django to INSTALLED_APPS and set Django up first)",
        )
    unreachable = kinds & {"ConnectionError", "TimeoutError"}
    if unreachable or any(isinstance(each, OSError) for each in chain):
        return (
            "cannot be reached",
            "start the store, or correct the host and port in unique_backend",
        )
    return ("does not answer its first command", "correct what the message names")


def _not_set_up(error: BaseException) -> bool:
    """Whether the store cannot be opened in this process (a client library missing, the
    Django app not installed or Django not set up), rather than its URL being wrong."""
    markers = ("INSTALLED_APPS", "Apps aren't loaded", "settings are not configured")
    return any(
        isinstance(each, ImportError) or any(marker in str(each) for marker in markers)
        for each in _causes(error)
    )


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from (a store wraps its client's errors)."""
    chain = [error]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) and len(chain) < 10:
        chain.append(cause)
    return chain


def _eviction(store: Any, url: str) -> list[Finding]:
    try:
        limits = store.eviction()
    except EvictionUnknown as exc:
        return [
            finding(
                "celery_unique.W029",
                "unique_backend",
                f"could not read maxmemory-policy of the uniqueness store {masked(url)} "
                f"({redacted(str(exc), url)}): whether it evicts keys is unknown",
            )
        ]
    if limits is None:
        return []
    maxmemory, policy = limits
    if maxmemory <= 0 or policy in _EVICTION_FREE:
        return []
    what = (
        "any key"
        if policy.startswith("allkeys")
        else "keys with an expiry, which every held key has while a lease or window runs"
    )
    return [
        finding(
            "celery_unique.E026",
            "unique_backend",
            f"the uniqueness store {masked(url)} has maxmemory {maxmemory} bytes and "
            f"maxmemory-policy {policy}: when full it evicts {what}, and an evicted key "
            "admits a duplicate",
        )
    ]


def _shared_namespace(app: Any, store: Any, namespace: str) -> list[Finding]:
    """W025: another app name noted in the namespace's registry, with other unique tasks.

    The registry keeps one entry per app name: the same name with other tasks (another
    version of the app, a second project under the default name) overwrites the entry,
    and cannot be told apart from a deploy of new code.
    """
    tasks = sorted(name for name, task in app.tasks.items() if declared(task) is not None)
    me = str(app.main or "celery")
    apps = store.register_app(namespace, me, tasks, REGISTRY_KEEP_MS)
    if apps is None:
        return []  # This store keeps no registry.
    mine = set(tasks)
    others = sorted(
        name
        for name, theirs in apps.items()
        if name != me and (not mine or not theirs or set(theirs) != mine)
    )
    if not others:
        return []
    who = ("app " if len(others) == 1 else "apps ") + ", ".join(repr(each) for each in others)
    return [
        finding(
            "celery_unique.W025",
            "unique_namespace",
            f"the key namespace {namespace!r} on this store is also used by {who}, with other "
            f"unique tasks than app {me!r}: the keys of these apps share one space",
            f"give each app its own unique_namespace (now {namespace!r})",
        )
    ]
