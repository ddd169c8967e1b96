"""The Django store's table, and the admin's entry for keys of any store.

``UniqueKey`` mirrors :class:`celery_unique.stores._records.Record`, one row
per storage key. The unique constraint is on ``key_hash``, the SHA-256 of the
storage key: a storage key can be longer than MySQL will index, and a digest
compares bytes exactly whatever the column's collation (keys are compared
exactly, without case folding or trailing-space padding). ``expires_at`` is
absolute milliseconds on the **database's** clock (:class:`DatabaseNowMs`), so
producers and workers with skewed clocks agree.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from typing import Any

from django.db import NotSupportedError, models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.sql.compiler import SQLCompiler

from celery_unique.stores._records import Record
from celery_unique.stores.base import KeyKind, OnDuplicate, Scope

#: ``expires_at`` of a row a decision inserts only to lock a key nobody holds.
PLACEHOLDER_EXPIRY = 0

SQL = tuple[str, tuple[str | int, ...]]


def key_hash(key: str) -> str:
    """The digest the unique constraint is on."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class DatabaseNowMs(models.Expression):
    """The database server's clock in milliseconds since the Unix epoch (UTC)."""

    output_field = models.BigIntegerField()

    def as_sql(self, compiler: SQLCompiler, connection: BaseDatabaseWrapper) -> SQL:
        raise NotSupportedError(
            f"celery-unique's Django store supports PostgreSQL, MySQL/MariaDB and SQLite, "
            f"not {connection.vendor}"
        )

    def as_postgresql(
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra: Any
    ) -> SQL:
        # The start of this statement: after the locks the previous statement waited for.
        return "FLOOR(EXTRACT(EPOCH FROM STATEMENT_TIMESTAMP()) * 1000)::bigint", ()

    def as_mysql(self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra: Any) -> SQL:
        # Pure UTC arithmetic: no session time zone, no daylight-saving ambiguity.
        return "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)", ()

    def as_sqlite(
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra: Any
    ) -> SQL:
        return "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)", ()

    def get_group_by_cols(self) -> list[Any]:
        return []


def alive() -> models.Q:
    """Rows whose key has not expired, on the database's clock."""
    return models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=DatabaseNowMs())


_KINDS = [(kind.value, kind.value) for kind in KeyKind]
_SCOPES = [(scope.value, scope.value) for scope in Scope]


class UniqueKey(models.Model):
    """A key held in the Django store (``django://[alias]``)."""

    key_hash: models.CharField[str, str] = models.CharField(max_length=64, editable=False)
    key: models.TextField[str, str] = models.TextField(
        help_text="The storage key: unique:v1:{namespace}:kind:task\\x1fkey."
    )
    kind: models.CharField[str, str] = models.CharField(max_length=6, choices=_KINDS)
    job_id: models.TextField[str, str] = models.TextField("job id")
    task: models.TextField[str, str] = models.TextField()
    scope: models.CharField[str | None, str | None] = models.CharField(
        max_length=6, choices=_SCOPES, null=True, blank=True
    )
    finished: models.BooleanField[bool, bool] = models.BooleanField(
        default=False, help_text="The job has finished; the key is kept for retention."
    )
    expires_at: models.BigIntegerField[int | None, int | None] = models.BigIntegerField(
        null=True,
        blank=True,
        db_index=True,
        help_text="Epoch milliseconds on the database's clock; empty: never.",
    )
    fingerprint: models.TextField[str | None, str | None] = models.TextField(null=True, blank=True)
    policy: models.TextField[str | None, str | None] = models.TextField(null=True, blank=True)
    since: models.BigIntegerField[int | None, int | None] = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="When a decision wrote the key: epoch milliseconds on the database's clock.",
    )
    run: models.TextField[str | None, str | None] = models.TextField(
        null=True, blank=True, help_text="The delivery of the job running now, if one is."
    )
    handed_from: models.TextField[str | None, str | None] = models.TextField(
        null=True, blank=True, help_text="The running job that handed the key over to this one."
    )
    on_duplicate: models.CharField[str | None, str | None] = models.CharField(
        max_length=8,
        null=True,
        blank=True,
        help_text="latest or debounce: the job's duplicates change it; empty: reuse.",
    )
    owed: models.TextField[str | None, str | None] = models.TextField(
        null=True, blank=True, help_text="The job owed a run once this one ends (latest/debounce)."
    )
    arguments: models.TextField[str | None, str | None] = models.TextField(
        null=True, blank=True, help_text="The latest duplicate's arguments, encoded."
    )
    due: models.BigIntegerField[int | None, int | None] = models.BigIntegerField(
        null=True, blank=True, help_text="Debounce: the planned start, epoch milliseconds."
    )
    cap: models.BigIntegerField[int | None, int | None] = models.BigIntegerField(
        null=True, blank=True, help_text="Debounce: the latest planned start allowed."
    )
    alive_until: models.BigIntegerField[int | None, int | None] = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="Until when the running delivery is vouched alive by its worker.",
    )
    passed_on_by: models.TextField[str | None, str | None] = models.TextField(
        null=True,
        blank=True,
        help_text="The ended job's delivery that passed the key on, until this one starts.",
    )

    class Meta:
        db_table = "celery_unique_key"
        verbose_name = "database key"
        verbose_name_plural = "database keys"
        constraints = [
            models.UniqueConstraint(fields=["key_hash"], name="celery_unique_key_hash_uniq"),
        ]
        permissions = [("release_key", "Can release held uniqueness keys")]

    def __str__(self) -> str:
        return self.key

    @classmethod
    def placeholder(cls, key: str) -> UniqueKey:
        """A row that locks ``key`` for one transaction; already expired, so nobody holds it."""
        return cls(
            key_hash=key_hash(key),
            key=key,
            kind=KeyKind.ACTIVE.value,
            job_id="",
            task="",
            expires_at=PLACEHOLDER_EXPIRY,
        )

    def record(self) -> Record:
        # An active key's generation sits in the column a window key's fingerprint does.
        window = self.kind == KeyKind.WINDOW.value
        return Record(
            job_id=self.job_id,
            task=self.task,
            kind=KeyKind(self.kind),
            scope=Scope(self.scope) if self.scope else None,
            finished=self.finished,
            expires_at=self.expires_at,
            fingerprint=self.fingerprint if window else None,
            generation=None if window else self.fingerprint,
            policy=self.policy,
            since=self.since,
            run=self.run,
            handed_from=self.handed_from,
            on_duplicate=OnDuplicate(self.on_duplicate) if self.on_duplicate else OnDuplicate.REUSE,
            owed=self.owed,
            arguments=self.arguments,
            due=self.due,
            cap=self.cap,
            alive_until=self.alive_until,
            passed_on_by=self.passed_on_by,
        )

    def assign(self, record: Record) -> None:
        self.job_id = record.job_id
        self.task = record.task
        self.kind = record.kind.value
        self.scope = record.scope.value if record.scope else None
        self.finished = record.finished
        self.expires_at = record.expires_at
        window = record.kind is KeyKind.WINDOW
        self.fingerprint = record.fingerprint if window else record.generation
        self.policy = record.policy
        self.since = record.since
        self.run = record.run
        self.handed_from = record.handed_from
        follows = record.on_duplicate
        self.on_duplicate = None if follows is OnDuplicate.REUSE else follows.value
        self.owed = record.owed
        self.arguments = record.arguments
        self.due = record.due
        self.cap = record.cap
        self.alive_until = record.alive_until
        self.passed_on_by = record.passed_on_by

    @property
    def expires(self) -> datetime | None:
        """``expires_at`` as an aware UTC datetime."""
        if self.expires_at is None:
            return None
        return datetime.fromtimestamp(self.expires_at / 1000, tz=timezone.utc)


#: Every column a decision writes.
RECORD_FIELDS = [
    "job_id",
    "task",
    "kind",
    "scope",
    "finished",
    "expires_at",
    "fingerprint",
    "policy",
    "since",
    "run",
    "handed_from",
    "on_duplicate",
    "owed",
    "arguments",
    "due",
    "cap",
    "alive_until",
    "passed_on_by",
]


class StoreKey(models.Model):
    """The admin's entry for the keys of whatever store the Celery app uses (no table).

    Its changelist reads the store through the store contract (``scan``,
    ``delete``), so it shows Redis, SQLite and memory stores as well as this
    app's own table.
    """

    class Meta:
        managed = False
        db_table = "celery_unique_store_key"
        verbose_name = "held key"
        verbose_name_plural = "held keys"
        default_permissions = ("view",)
