"""The admin: held keys of any store, and the Django store's table.

Two entries under "Celery unique":

**Held keys** (:class:`StoreKeyAdmin`)
    The keys of the Celery app's namespace, read through the store contract
    (``scan``), so it works whatever the store: Redis, SQLite, memory or the
    Django database. Search (key, job id, task), filters (kind, task,
    expiry), pages of 100, and a release action. It scans the namespace on
    every page view: fine for thousands of keys, slow for millions.

**Database keys** (:class:`UniqueKeyAdmin`)
    The rows of the Django store's table (``django://``), on the database
    the store uses, every namespace; searched, filtered and paginated by the
    database, so it stays fast on large tables.

Both are read-only. Releasing needs the permission
``celery_unique.release_key`` ("Can release held uniqueness keys") besides
view permission; it is a compare-and-delete through the store contract: a
key that another job took over since the page was rendered is left alone.
Releasing a key does not stop its job: the next dispatch with that key
creates a new job, which may run beside it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import router
from django.db.models import BigIntegerField, QuerySet, Value
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.html import format_html

from celery_unique import operations
from celery_unique.config import configured_backend_url, runtime
from celery_unique.exceptions import UniquenessError
from celery_unique.keys import keyspace
from celery_unique.operations import KeyInfo, format_ms
from celery_unique.stores.base import KeyKind
from celery_unique.stores.masking import masked
from celery_unique_django.conf import celery_app
from celery_unique_django.models import DatabaseNowMs, StoreKey, UniqueKey
from celery_unique_django.store import DjangoStore

RELEASE_PERMISSION = "release_key"
#: Keys longer than this are shortened in lists (a payload key is 64 hex digits).
SHORT_KEY = 40
PER_PAGE = 100
MINUTE_MS = 60_000
HOUR_MS = 3_600_000

#: Expiry buckets: query value -> (label, test on "ms until expiry", None for never).
EXPIRY: dict[str, tuple[str, Callable[[int | None], bool]]] = {
    "never": ("never", lambda ms: ms is None),
    "minute": ("within a minute", lambda ms: ms is not None and ms <= MINUTE_MS),
    "hour": ("within an hour", lambda ms: ms is not None and ms <= HOUR_MS),
    "later": ("in more than an hour", lambda ms: ms is not None and ms > HOUR_MS),
}


def can_release(request: HttpRequest) -> bool:
    user: Any = request.user
    return bool(user.has_perm(f"{UniqueKey._meta.app_label}.{RELEASE_PERMISSION}"))


def short_key(storage_key: str) -> str:
    """The key as HTML: without its task name (a column of its own), shortened; whole on hover."""
    _, _, scope, key = keyspace.split_storage_key(storage_key)
    short = key if len(key) <= SHORT_KEY else f"{key[: SHORT_KEY - 1]}…"
    return format_html(
        '<span title="{}">{}</span>',
        keyspace.shown(keyspace.display_key(scope, key)),
        keyspace.shown(short),
    )


def describe_expiry(ms: int | None) -> str:
    if ms is None:
        return "never"
    return "expired" if ms <= 0 else f"in {format_ms(ms)}"


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Keys are written by dispatches and released by jobs, never edited by hand."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_release_permission(self, request: HttpRequest) -> bool:
        return can_release(request)


# -- held keys of any store ---------------------------------------------------------


def _token(info: KeyInfo) -> str:
    """The selection value of one key: its storage key and the job it was held by."""
    raw = json.dumps([info.storage_key, info.job_id]).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _untoken(token: str) -> tuple[str, str] | None:
    try:
        key, job_id = json.loads(base64.urlsafe_b64decode(token.encode()))
    except (ValueError, TypeError):
        return None
    return (key, job_id) if isinstance(key, str) and isinstance(job_id, str) else None


class StoreKeyAdmin(ReadOnlyAdmin):
    """A changelist of the app's held keys, built on the store contract (any store)."""

    template = "celery_unique/admin/held_keys.html"

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        view = self.admin_site.admin_view(self.changelist_view)
        return [path("", view, name="{}_{}_changelist".format(*info))]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        app = celery_app()
        if request.method == "POST":
            return self._release(request, app)
        query = request.GET.get("q", "").strip()
        chosen = {name: request.GET.get(name, "") for name in ("kind", "task", "expires")}
        store_url = masked(configured_backend_url(app) or "-")
        try:
            everything = list(operations.iter_keys(app))
            namespace = runtime(app).namespace
        except UniquenessError as exc:
            messages.error(request, f"The uniqueness store cannot be read: {exc}")
            everything, namespace = [], "-"
        shown = sorted(
            (info for info in everything if _matches(info, query, chosen)),
            key=lambda info: info.storage_key,
        )
        page = Paginator(shown, PER_PAGE).get_page(request.GET.get("p"))
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Held keys",
            "subtitle": None,
            "page": page,
            "rows": [
                (
                    info,
                    _token(info),
                    short_key(info.storage_key),
                    describe_expiry(info.expires_in_ms),
                )
                for info in page
            ],
            "query": query,
            "filters": list(_filters(request, everything, chosen)),
            "filtered": bool(query or any(chosen.values())),
            "total": len(everything),
            "can_release": self.has_release_permission(request),
            "store_url": store_url,
            "namespace": namespace,
            **(extra_context or {}),
        }
        return TemplateResponse(request, self.template, context)

    def _release(self, request: HttpRequest, app: Celery) -> HttpResponse:
        if not self.has_release_permission(request):
            raise PermissionDenied
        selected = [_untoken(token) for token in request.POST.getlist("selected")]
        wanted = [pair for pair in selected if pair is not None]
        if not wanted or request.POST.get("action") != "release":
            messages.warning(request, "Select keys to release.")
            return HttpResponseRedirect(request.get_full_path())
        released, spared = 0, []
        try:
            for key, job_id in wanted:
                try:
                    released += operations.release(app, key, job_id=job_id)
                except operations.OwedToDuplicates as kept:
                    spared.append(kept.info.display_key)
        except UniquenessError as exc:
            messages.error(request, f"The uniqueness store failed: {exc}")
        messages.success(request, _released_message(released, len(wanted) - len(spared)))
        _warn_spared(request, spared)
        return HttpResponseRedirect(request.get_full_path())


def _warn_spared(request: HttpRequest, spared: list[str]) -> None:
    if spared:
        messages.warning(
            request,
            f"{len(spared)} kept: a latest/debounce job holds what its duplicates left it (a "
            f"run owed to them, their arguments) ({', '.join(spared)}); release them with "
            "`celery unique release --drop-owed` to drop that",
        )


def _released_message(released: int, selected: int) -> str:
    message = f"Released {released} key{'s' if released != 1 else ''}."
    if released < selected:
        message += (
            f" {selected - released} had expired or been taken over by another job "
            "and were left alone."
        )
    return message


def _matches(info: KeyInfo, query: str, chosen: dict[str, str]) -> bool:
    if chosen["kind"] and info.kind.value != chosen["kind"]:
        return False
    if chosen["task"] and info.task != chosen["task"]:
        return False
    bucket = EXPIRY.get(chosen["expires"])
    if bucket is not None and not bucket[1](info.expires_in_ms):
        return False
    needle = query.casefold()
    return not needle or any(
        needle in text.casefold() for text in (info.display_key, info.job_id, info.task)
    )


def _filters(
    request: HttpRequest, everything: list[KeyInfo], chosen: dict[str, str]
) -> Iterator[dict[str, Any]]:
    """The sidebar: per filter a title and its choices (label, link, selected)."""
    options = {
        "kind": [(kind.value, kind.value) for kind in KeyKind],
        "task": [(task, task) for task in sorted({info.task for info in everything})],
        "expires": [(value, label) for value, (label, _) in EXPIRY.items()],
    }
    for name, title in (("kind", "kind"), ("task", "task"), ("expires", "expiry")):
        choices = [("All", _link(request, name, ""), not chosen[name])]
        choices += [
            (label, _link(request, name, value), chosen[name] == value)
            for value, label in options[name]
        ]
        yield {"title": title, "choices": choices}


def _link(request: HttpRequest, name: str, value: str) -> str:
    params = request.GET.copy()
    params.pop("p", None)
    if value:
        params[name] = value
    else:
        params.pop(name, None)
    return f"?{params.urlencode()}" if params else "?"


# -- the Django store's table ---------------------------------------------------------


class ExpiryFilter(admin.SimpleListFilter):
    """Rows by when they expire, on the database's clock."""

    title = "expiry"
    parameter_name = "expires"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(value, label) for value, (label, _) in EXPIRY.items()] + [
            ("expired", "expired, awaiting sweep")
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        now = DatabaseNowMs()
        value = self.value()
        chosen: QuerySet[Any] = queryset
        if value == "never":
            chosen = queryset.filter(expires_at__isnull=True)
        elif value == "expired":
            chosen = queryset.filter(expires_at__lte=now)
        elif value in ("minute", "hour"):
            horizon = Value(MINUTE_MS if value == "minute" else HOUR_MS, BigIntegerField())
            chosen = queryset.filter(expires_at__gt=now, expires_at__lte=now + horizon)
        elif value == "later":
            chosen = queryset.filter(expires_at__gt=now + Value(HOUR_MS, BigIntegerField()))
        return chosen


class UniqueKeyAdmin(ReadOnlyAdmin):
    """The Django store's rows, on the database the app's store uses."""

    list_display = ["display_key", "task", "kind", "scope", "job_id", "expiry", "namespace"]
    list_filter = ["kind", "scope", "finished", ExpiryFilter, "task"]
    search_fields = ["key", "job_id", "task"]
    search_help_text = "Search the storage key, the job id and the task name."
    ordering = ["key"]
    list_per_page = PER_PAGE
    actions = ["release_keys"]
    # Stored arguments may hold anything a task is given (a card number, a token): staff
    # who may view keys see a digest, enough to tell two apart, as the CLI shows.
    exclude = ["key_hash", "arguments"]
    readonly_fields = ["latest_arguments"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[UniqueKey]:
        # Release notes are not held keys: nothing for an operator to release.
        queryset: QuerySet[UniqueKey] = (
            super().get_queryset(request).exclude(key__startswith=keyspace.RELEASE_NOTE)
        )
        annotated: QuerySet[UniqueKey] = queryset.using(self.database()).annotate(
            db_now=DatabaseNowMs()
        )
        return annotated

    def database(self) -> str:
        """The alias the app's Django store uses; else where the routers read the table."""
        try:
            store = runtime(celery_app()).store
        except UniquenessError:
            store = None
        if isinstance(store, DjangoStore):
            return store.alias
        return router.db_for_read(UniqueKey) or "default"

    @admin.display(description="key", ordering="key")
    def display_key(self, row: UniqueKey) -> str:
        """The key without its task name (a column of its own), shortened; in full on hover."""
        return short_key(row.key)

    @admin.display(description="namespace")
    def namespace(self, row: UniqueKey) -> str:
        return keyspace.split_storage_key(row.key)[0]

    @admin.display(description="latest arguments (digest)")
    def latest_arguments(self, row: UniqueKey) -> str:
        return operations.arguments_digest(row.arguments) or "-"

    @admin.display(description="expires", ordering="expires_at")
    def expiry(self, row: UniqueKey) -> str:
        if row.expires_at is None:
            return "never"
        left = row.expires_at - row.db_now  # type: ignore[attr-defined]
        return format_html(
            '<span title="{}">{}</span>',
            row.expires.isoformat() if row.expires else "",
            describe_expiry(left),
        )

    @admin.action(description="Release the selected keys", permissions=["release"])
    def release_keys(self, request: HttpRequest, queryset: QuerySet[UniqueKey]) -> None:
        rows = list(queryset.values_list("key", "job_id"))
        released, spared = 0, []
        with _store_on(queryset.db) as store:
            for key, job_id in rows:
                if store.delete(key, job_id=job_id, spare_owed=True):
                    released += 1
                elif operations.kept_for_duplicates(store, key, job_id) is not None:
                    spared.append(short_key(key))
        self.message_user(
            request, _released_message(released, len(rows) - len(spared)), messages.SUCCESS
        )
        _warn_spared(request, spared)


@contextmanager
def _store_on(alias: str) -> Iterator[DjangoStore]:
    """The app's Django store when it uses ``alias``; else one opened for the action."""
    try:
        store = runtime(celery_app()).store
    except UniquenessError:
        store = None
    if isinstance(store, DjangoStore) and store.alias == alias:
        yield store
        return
    own = DjangoStore(alias)
    try:
        yield own
    finally:
        own.close()


admin.site.register(StoreKey, StoreKeyAdmin)
admin.site.register(UniqueKey, UniqueKeyAdmin)
