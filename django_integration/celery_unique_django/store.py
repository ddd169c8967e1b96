"""The Django store: keys in a table of a Django database (``django://[alias]``).

Every operation that writes runs in one transaction that first **locks every
key it names, whether the key exists or not**: it upserts a placeholder row
for each key (sorted by ``key_hash``), then reads the rows, the database's
clock with them, and applies the shared rules of
:mod:`celery_unique.stores._records`. Row locks alone could not serialise two
dispatches of a key that does not exist yet (there is no row to lock); the
upsert makes one:

* **PostgreSQL**: ``INSERT ... ON CONFLICT (key_hash) DO UPDATE`` either
  inserts the row or locks the existing one, waiting for a concurrent
  transaction that inserted or deleted it, so that afterwards the row exists
  and only this transaction holds it. Keys are locked in ``key_hash`` order,
  so two decisions never deadlock.
* **MySQL / MariaDB** (InnoDB): ``INSERT ... ON DUPLICATE KEY UPDATE`` takes an
  exclusive lock on the duplicate (``INSERT IGNORE`` would take a shared one,
  and two shared locks upgrading to exclusive deadlock). InnoDB's gap locks
  can still deadlock two transactions on neighbouring keys; the victim is
  retried.
* **SQLite**: the first statement writes, so the transaction takes the
  database's write lock at once (busy-waiting up to the connection's
  ``timeout``) and decisions run one at a time.

Placeholders that stay vacant, and expired rows a decision touches, are
deleted before commit, so readers never see them. Other expired rows are
swept at most every 30 s, in a short transaction of their own that skips
rows other transactions hold.

Which connection
    On PostgreSQL and MySQL the store uses a connection of its own per thread
    (a copy of the alias's settings, in autocommit between operations, READ
    COMMITTED). A decision therefore commits before the message is published,
    even when ``delay()`` is called inside the caller's ``transaction.atomic()``:
    a worker always finds the key it must release, and a caller's long
    transaction never holds key locks. On SQLite a second connection would wait
    for the caller's own write lock, so the store uses the thread's connection:
    inside ``atomic()`` its writes commit with the caller's transaction (prefer
    :func:`celery_unique_django.on_commit.dispatch_on_commit` there).

Time is the database server's clock (:class:`~celery_unique_django.models.DatabaseNowMs`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from django.db import DEFAULT_DB_ALIAS, Error, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Count, Q, QuerySet
from django.db.utils import load_backend

from celery_unique.exceptions import BackendUnavailable, ImproperlyConfigured
from celery_unique.keys.keyspace import RELEASE_NOTE, is_release_note
from celery_unique.stores import _records, cleanup
from celery_unique.stores.base import (
    Claim,
    Decision,
    HeldKey,
    KeyKind,
    StoreStats,
)

if TYPE_CHECKING:
    # Imported where used: defining a model needs Django's app registry, and
    # from_url() must first be able to say what is missing.
    from celery_unique_django.models import UniqueKey

logger = logging.getLogger("celery_unique")

T = TypeVar("T")

APP_NAME = "celery_unique_django"
VENDORS = ("postgresql", "mysql", "sqlite")
#: Attempts of one operation: deadlock victims and serialization failures are retried.
_ATTEMPTS = 8
_SWEEP_LIMIT = 1000
#: Keys per statement (bound parameters), rows per scan page.
_SLICE = 500
#: PostgreSQL SQLSTATEs and MySQL error numbers of a transaction worth retrying.
_RETRY_SQLSTATES = frozenset({"40001", "40P01"})
_RETRY_MYSQL_ERRORS = frozenset({1213})  # ER_LOCK_DEADLOCK

#: Connections a forked child inherited: their socket is the parent's, so the
#: child neither uses nor closes them (closing would end the parent's session).
_inherited: list[BaseDatabaseWrapper] = []
_instances = itertools.count()


class Misconfiguration(NamedTuple):
    """Why ``django://alias`` cannot work here, as a system check reports it."""

    id: str
    msg: str
    hint: str


def misconfiguration(alias: str) -> Misconfiguration | None:
    """The first reason the Django store cannot use ``alias`` in this process, if any."""
    from django.apps import apps

    if not apps.ready:
        return Misconfiguration(
            "celery_unique.E010",
            "the django:// uniqueness store needs Django to be set up",
            "call django.setup() first (Celery's Django fixup does it in workers)",
        )
    if not apps.is_installed(APP_NAME):
        return Misconfiguration(
            "celery_unique.E003",
            f"the uniqueness store is django://{alias} but {APP_NAME!r} is not in INSTALLED_APPS",
            f"add {APP_NAME!r} to INSTALLED_APPS and run `manage.py migrate celery_unique`",
        )
    if alias not in connections.settings:
        known = ", ".join(sorted(connections.settings)) or "none"
        return Misconfiguration(
            "celery_unique.E002",
            f"the uniqueness store django://{alias} names the database alias {alias!r}, "
            f"which DATABASES does not define (defined: {known})",
            "use django:// for the default database or django://<alias> of DATABASES",
        )
    vendor = connections[alias].vendor
    if vendor not in VENDORS:
        return Misconfiguration(
            "celery_unique.E004",
            f"the uniqueness store django://{alias} is on {vendor}, which it does not support",
            "use a PostgreSQL, MySQL/MariaDB or SQLite database, or another store",
        )
    return None


def alias_of(url: str) -> str:
    """``django://`` -> ``"default"``; ``django://replica`` -> ``"replica"``."""
    return url.split("://", 1)[1].strip("/") or DEFAULT_DB_ALIAS


def _slices(items: Sequence[T]) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), _SLICE):
        yield items[start : start + _SLICE]


class DjangoStore(_records.RecordStore):
    """Keys in the ``celery_unique_key`` table of the Django database ``alias``."""

    def __init__(self, alias: str = DEFAULT_DB_ALIAS, *, sweep_every_s: float = 30.0) -> None:
        self.alias = alias
        #: Expired rows no decision touches are swept at most this often (seconds).
        self.sweep_every_s = sweep_every_s
        #: The name this store's own connection is known by, in this process's threads.
        self._name = f"celery_unique:{alias}:{next(_instances)}"
        self._local = threading.local()
        self._guard = threading.Lock()
        self._opened: list[tuple[int, BaseDatabaseWrapper]] = []
        self._swept_at = 0.0

    @classmethod
    def from_url(cls, url: str) -> DjangoStore:
        """``django://`` (the default database) or ``django://<alias>``."""
        alias = alias_of(url)
        problem = misconfiguration(alias)
        if problem is not None:
            raise ImproperlyConfigured(f"{problem.msg}: {problem.hint}")
        return cls(alias)

    @property
    def vendor(self) -> str:
        vendor: str = connections[self.alias].vendor
        return vendor

    # -- connections ------------------------------------------------------------

    def _db(self) -> str:
        """The connection alias this thread's operations go through."""
        if self.vendor == "sqlite":
            return self.alias
        wrapper: BaseDatabaseWrapper | None = getattr(self._local, "wrapper", None)
        pid = os.getpid()
        if wrapper is None or self._local.pid != pid:
            if wrapper is not None:
                _inherited.append(wrapper)
            wrapper = self._open()
            self._local.wrapper, self._local.pid = wrapper, pid
            with self._guard:
                self._opened.append((pid, wrapper))
        # Registered per thread (Django keeps connections in a thread local), so the
        # ORM and transaction.atomic() find it by name; it is never in DATABASES.
        connections[self._name] = wrapper
        return self._name

    def _open(self) -> BaseDatabaseWrapper:
        settings = dict(connections[self.alias].settings_dict)  # the test database in tests
        options = dict(settings.get("OPTIONS") or {})
        options.pop("pool", None)
        if self.vendor == "postgresql":
            options.pop("isolation_level", None)  # READ COMMITTED, PostgreSQL's default
        else:
            options["isolation_level"] = "read committed"
        settings.update(
            OPTIONS=options, AUTOCOMMIT=True, CONN_MAX_AGE=None, CONN_HEALTH_CHECKS=False
        )
        backend = load_backend(settings["ENGINE"])
        wrapper: BaseDatabaseWrapper = backend.DatabaseWrapper(settings, self._name)
        return wrapper

    def close(self) -> None:
        """Close the connections this store opened in this process (from any thread)."""
        pid = os.getpid()
        with self._guard:
            opened, self._opened = self._opened, []
        for owner, wrapper in opened:
            if owner != pid:
                _inherited.append(wrapper)
                continue
            wrapper.inc_thread_sharing()
            try:
                wrapper.close()
            finally:
                wrapper.dec_thread_sharing()
        self._local = threading.local()
        with contextlib.suppress(AttributeError):
            del connections[self._name]

    # -- transactions -----------------------------------------------------------

    def _run(
        self,
        work: Callable[[str], T],
        *,
        atomic: bool,
        may_retry: Callable[[], bool] | None = None,
    ) -> T:
        """Run ``work(db)`` (in one transaction when ``atomic``); map database errors.

        A connection that died under the attempt is reopened for one more try,
        unless ``may_retry()`` says no: a decision whose COMMIT may have landed
        must not be tried again (it would find its own keys held, and call its
        never-published job a duplicate of itself).
        """
        reconnected = False
        failure: Error | None = None
        for attempt in range(1, _ATTEMPTS + 1):
            db = self._db()
            before = connections[db].connection
            try:
                if not atomic:
                    return work(db)
                with transaction.atomic(using=db):
                    return work(db)
            except Error as exc:
                failure = exc
                if self._conflict(exc) and attempt < _ATTEMPTS:
                    # A deadlock victim or a serialization failure: nothing was written.
                    logger.debug("Django store: retrying after %s", exc)
                    time.sleep(random.uniform(0, 0.002 * 2**attempt))
                    continue
                if (
                    not reconnected
                    and (may_retry is None or may_retry())
                    and self._dropped(db, before)
                ):
                    reconnected = True  # The server closed our connection: one fresh try.
                    continue
                break
        assert failure is not None
        raise BackendUnavailable(self._explain(failure)) from failure

    def _conflict(self, exc: Error) -> bool:
        cause = exc.__cause__
        if self.vendor == "postgresql":
            code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
            return code in _RETRY_SQLSTATES
        if self.vendor == "mysql":
            args: tuple[Any, ...] = getattr(cause, "args", ())
            return bool(args) and args[0] in _RETRY_MYSQL_ERRORS
        return False

    def _dropped(self, db: str, before: Any) -> bool:
        """Whether the store's own, open connection died under the attempt (now reopened)."""
        if db == self.alias or before is None:
            return False  # The thread's connection, or the server refused to connect.
        wrapper = connections[db]
        if wrapper.connection is not before:
            return True  # Django replaced the dead connection while rolling back.
        try:
            usable = wrapper.is_usable()
        except Exception:
            usable = False
        if not usable:
            try:
                wrapper.close()
            except Error:
                wrapper.connection = None
        return not usable

    def _explain(self, exc: Error) -> str:
        from celery_unique_django.models import UniqueKey

        message = f"Django store on database {self.alias!r} failed: {exc}"
        table = UniqueKey._meta.db_table
        if table in str(exc):
            message += f" (run `manage.py migrate celery_unique --database {self.alias}`)"
        return message

    # -- rows -------------------------------------------------------------------

    @staticmethod
    def _rows(db: str) -> QuerySet[UniqueKey]:
        from celery_unique_django.models import UniqueKey

        return UniqueKey.objects.using(db)

    def _lock(self, db: str, keys: Sequence[str]) -> tuple[dict[str, UniqueKey], int]:
        """Lock a row for every key (a placeholder where none exists); the rows and the clock."""
        from celery_unique_django.models import DatabaseNowMs, UniqueKey, key_hash

        by_hash = dict(sorted({key_hash(key): key for key in keys}.items()))
        features = connections[db].features
        self._rows(db).bulk_create(
            [UniqueKey.placeholder(key) for key in by_hash.values()],
            update_conflicts=True,
            update_fields=["key_hash"],
            unique_fields=["key_hash"] if features.supports_update_conflicts_with_target else None,
            batch_size=_SLICE,
        )
        rows: dict[str, UniqueKey] = {}
        for part in _slices(list(by_hash)):
            found = (
                self._rows(db)
                .filter(key_hash__in=part)
                .annotate(db_now=DatabaseNowMs())
                .order_by("key_hash")
                .select_for_update()
            )
            rows.update((row.key, row) for row in found)
        if len(rows) != len(by_hash):
            missing = [key for key in by_hash.values() if key not in rows]
            raise RuntimeError(f"Django store: rows for {missing!r} were not locked")
        now: int = next(iter(rows.values())).db_now  # type: ignore[attr-defined]
        return rows, now

    def _save(self, db: str, rows: dict[str, UniqueKey], writes: _records.Writes, now: int) -> None:
        from celery_unique_django.models import RECORD_FIELDS

        updates: list[UniqueKey] = []
        deletes: list[int] = []
        for key, row in rows.items():
            if key in writes:
                record = writes[key]
                if record is None:
                    deletes.append(row.pk)
                else:
                    row.assign(record)
                    updates.append(row)
            elif not row.record().alive(now):
                deletes.append(row.pk)  # A vacant placeholder, or a key that expired.
        if updates:
            self._rows(db).bulk_update(updates, RECORD_FIELDS, batch_size=_SLICE)
        for part in _slices(deletes):
            self._rows(db).filter(pk__in=part).delete()

    # -- contract ---------------------------------------------------------------

    def decide(self, claims: Sequence[Claim], *, all_or_nothing: bool = True) -> list[Decision]:
        keys = [key for claim in claims for key in _records.claim_keys(claim)]
        if not keys:
            return _records.decide(claims, lambda key: None, 0, all_or_nothing=all_or_nothing)[0]

        committing = [False]

        def work(db: str) -> list[Decision]:
            committing[0] = False
            rows, now = self._lock(db, keys)

            def lookup(key: str) -> _records.Record | None:
                return rows[key].record()

            decisions, writes = _records.decide(claims, lookup, now, all_or_nothing=all_or_nothing)
            self._save(db, rows, writes, now)
            committing[0] = True
            return decisions

        try:
            decisions = self._run(work, atomic=True, may_retry=lambda: not committing[0])
        except BackendUnavailable as error:
            if committing[0]:
                # The connection failed while committing: the server may have
                # committed. Undo it (the claims' jobs were never published).
                error.maybe_applied = True
                cleanup.undo_decision(self, claims, error)
            raise
        self._maybe_sweep()
        return decisions

    def forget_decision(self, claims: Sequence[Claim], error: BackendUnavailable) -> bool:
        self.rollback_many(claims)
        # A commit the server is still finishing could land after this rollback.
        return False

    def _change(self, changes: Sequence[tuple[str, _records.Change]]) -> list[bool]:
        def work(db: str) -> list[bool]:
            rows, now = self._lock(db, [key for key, _ in changes])

            def lookup(key: str) -> _records.Record | None:
                record = rows[key].record()
                return record if record.alive(now) else None

            changed, writes = _records.apply_changes(changes, lookup, now)
            self._save(db, rows, writes, now)
            return changed

        return self._run(work, atomic=True) if changes else []

    def get(self, key: str) -> HeldKey | None:
        from celery_unique_django.models import DatabaseNowMs, key_hash

        def work(db: str) -> UniqueKey | None:
            found = self._rows(db).filter(key_hash=key_hash(key))
            row: UniqueKey | None = found.annotate(db_now=DatabaseNowMs()).first()
            return row

        row = self._run(work, atomic=False)
        if row is None or row.key != key:
            return None
        record, now = row.record(), row.db_now  # type: ignore[attr-defined]
        return record.held(key, now) if record.alive(now) else None

    def scan(self, *, kind: KeyKind | None = None, prefix: str = "") -> Iterator[HeldKey]:
        """Held keys in the order they were first stored, read a page at a time."""
        after = 0
        while True:
            page = self._run(
                functools.partial(self._page, kind=kind, prefix=prefix, after=after), atomic=False
            )
            for row in page:
                # LIKE folds case on some databases and collations: compare exactly here.
                if row.key.startswith(prefix) and not is_release_note(row.key):
                    yield row.record().held(row.key, row.db_now)  # type: ignore[attr-defined]
            if len(page) < _SLICE:
                return
            after = page[-1].pk

    def _page(self, db: str, *, kind: KeyKind | None, prefix: str, after: int) -> list[UniqueKey]:
        from celery_unique_django.models import DatabaseNowMs, alive

        rows = self._rows(db).filter(alive(), pk__gt=after)
        if kind is not None:
            rows = rows.filter(kind=kind.value)
        if prefix:
            rows = rows.filter(key__startswith=prefix)
        return list(rows.annotate(db_now=DatabaseNowMs()).order_by("pk")[:_SLICE])

    def stats(self) -> StoreStats:
        from celery_unique_django.models import DatabaseNowMs, alive

        def work(db: str) -> dict[str, Any]:
            return self._rows(db).aggregate(
                active=Count(
                    "pk",
                    filter=alive()
                    & Q(kind=KeyKind.ACTIVE.value)
                    & ~Q(key__startswith=RELEASE_NOTE),
                ),
                window=Count("pk", filter=alive() & Q(kind=KeyKind.WINDOW.value)),
                expired=Count("pk", filter=Q(expires_at__lte=DatabaseNowMs())),
            )

        counts = self._run(work, atomic=False)
        return StoreStats(
            active=counts["active"],
            window=counts["window"],
            extra={
                "database": self.alias,
                "vendor": self.vendor,
                "expired rows awaiting sweep": counts["expired"],
            },
        )

    def ping(self) -> None:
        self._run(lambda db: self._rows(db).exists(), atomic=False)

    # -- sweeping ---------------------------------------------------------------

    def _maybe_sweep(self) -> None:
        now = time.monotonic()
        if now - self._swept_at < self.sweep_every_s:
            return
        self._swept_at = now
        try:
            self.sweep()
        except BackendUnavailable:
            logger.debug("Django store: sweeping expired keys failed", exc_info=True)

    def sweep(self, limit: int = _SWEEP_LIMIT) -> int:
        """Delete up to ``limit`` expired rows that no transaction holds; return how many."""
        from celery_unique_django.models import DatabaseNowMs

        def work(db: str) -> int:
            expired = self._rows(db).filter(expires_at__lte=DatabaseNowMs()).order_by("key_hash")
            if connections[db].features.has_select_for_update_skip_locked:
                expired = expired.select_for_update(skip_locked=True)
            ids = list(expired.values_list("pk", flat=True)[:limit])
            for part in _slices(ids):
                self._rows(db).filter(pk__in=part).delete()
            return len(ids)

        return self._run(work, atomic=True)
