"""A store in one SQLite file: the embedded default, safe across processes on one host.

Each decision runs in a ``BEGIN IMMEDIATE`` transaction, which takes the
database's write lock before reading, so two processes racing on one key are
serialised by SQLite itself. Time is this host's wall clock, shared by every
process that opens the file.
"""

from __future__ import annotations

import os
import random
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import cast

from celery_unique.exceptions import BackendUnavailable, ImproperlyConfigured
from celery_unique.keys.keyspace import is_release_note
from celery_unique.stores import _records
from celery_unique.stores.base import Claim, Decision, HeldKey, KeyKind, OnDuplicate, Scope
from celery_unique.stores.masking import masked

_SCHEMA = """
CREATE TABLE IF NOT EXISTS celery_unique_keys (
    key TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    job_id TEXT NOT NULL,
    task TEXT NOT NULL,
    scope TEXT,
    finished INTEGER NOT NULL DEFAULT 0,
    expires_at INTEGER,
    fingerprint TEXT,
    policy TEXT,
    since INTEGER,
    run TEXT,
    handed_from TEXT,
    on_duplicate TEXT,
    owed TEXT,
    arguments TEXT,
    due INTEGER,
    cap INTEGER,
    alive_until INTEGER,
    passed_on_by TEXT
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS celery_unique_keys_expires ON celery_unique_keys (expires_at);
"""
_COLUMNS = (
    "key, kind, job_id, task, scope, finished, expires_at, fingerprint, policy, since, "
    "run, handed_from, on_duplicate, owed, arguments, due, cap, alive_until, passed_on_by"
)
#: Columns a file made by an earlier version may lack, with their types.
_LATER_COLUMNS = {
    "since": "INTEGER",
    "run": "TEXT",
    "handed_from": "TEXT",
    "on_duplicate": "TEXT",
    "owed": "TEXT",
    "arguments": "TEXT",
    "due": "INTEGER",
    "cap": "INTEGER",
    "alive_until": "INTEGER",
    "passed_on_by": "TEXT",
}
#: Expired rows are swept at most this often, so decisions stay one short transaction.
_SWEEP_EVERY_MS = 30_000

Row = tuple[
    str,
    str,
    str,
    str,
    "str | None",
    int,
    "int | None",
    "str | None",
    "str | None",
    "int | None",
    "str | None",
    "str | None",
    "str | None",
    "str | None",
    "str | None",
    "int | None",
    "int | None",
    "int | None",
    "str | None",
]


def _now() -> int:
    return time.time_ns() // 1_000_000


def _record(row: Row) -> _records.Record:
    _, kind, job_id, task, scope, finished, expires_at, fingerprint, policy, since, *rest = row
    run, handed, follows, owed, arguments, due, cap, alive_until, passed_on_by = cast(
        "tuple[str | None, str | None, str | None, str | None, str | None, int | None, "
        "int | None, int | None, str | None]",
        tuple(rest),
    )
    # An active key's generation sits in the column a window key's fingerprint does.
    active = kind != KeyKind.WINDOW.value
    return _records.Record(
        job_id=job_id,
        task=task,
        kind=KeyKind(kind),
        scope=Scope(scope) if scope else None,
        finished=bool(finished),
        expires_at=expires_at,
        fingerprint=None if active else fingerprint,
        generation=fingerprint if active else None,
        policy=policy,
        since=since,
        run=run,
        handed_from=handed,
        on_duplicate=OnDuplicate(follows) if follows else OnDuplicate.REUSE,
        owed=owed,
        arguments=arguments,
        due=due,
        cap=cap,
        alive_until=alive_until,
        passed_on_by=passed_on_by,
    )


def _create_private(path: Path) -> None:
    """Create the store's file readable by its owner alone (it keeps task arguments), unless
    it exists: an existing file keeps its mode. SQLite gives its ``-wal`` and ``-shm``
    files the same mode. The directory must exist: a mistyped path is an error, not a
    tree of new directories."""
    if path.exists():
        return
    if not path.parent.is_dir():
        raise ImproperlyConfigured(
            f"the SQLite store's directory {str(path.parent)!r} does not exist: create it, "
            "or correct unique_backend"
        )
    with suppress(FileExistsError):  # Another process created it first.
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


#: The stores of this process with a connection open.
_open: weakref.WeakSet[SQLiteStore] = weakref.WeakSet()


def _close_before_fork() -> None:
    """Close every connection of this process before it forks (each reopens at its next use).

    SQLite keeps what a process knows of a file's locks in process memory, which a
    fork copies: a connection the child opens takes the parent's locks for its own
    and never asks the system for them. The parent, closing later, then finds no
    other user of the file, checkpoints it and deletes its write-ahead log while
    the child still writes there: what the child wrote after that is lost. A Celery
    worker forks its pool children with its own connection open.
    """
    for store in list(_open):
        store.close()


os.register_at_fork(before=_close_before_fork)


class SQLiteStore(_records.RecordStore):
    """Keys in a SQLite database file (``sqlite:///relative.db``, ``sqlite:////abs/path.db``)."""

    def __init__(self, path: str | os.PathLike[str], *, timeout_s: float = 30.0) -> None:
        self.path = Path(path)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._swept_at = 0

    @classmethod
    def from_url(cls, url: str) -> SQLiteStore:
        path = url.split("://", 1)[1]
        if path.startswith("/"):
            path = path[1:]  # sqlite:///rel.db -> rel.db; sqlite:////abs.db -> /abs.db
        if not path:
            raise ImproperlyConfigured(
                f"unique_backend {masked(url)!r} names no file: use sqlite:///relative/path.db "
                "or sqlite:////absolute/path.db"
            )
        return cls(path)

    # -- connection -------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        # A connection must never cross a fork: reopen in each process.
        if self._conn is None or self._pid != os.getpid():
            try:
                _create_private(self.path)
                conn = sqlite3.connect(
                    self.path,
                    timeout=self._timeout_s,
                    isolation_level=None,
                    check_same_thread=False,
                )
                try:
                    self._use_wal(conn)
                    conn.execute("PRAGMA synchronous=NORMAL")
                    conn.executescript(_SCHEMA)
                    _add_missing_columns(conn)
                except BaseException:
                    conn.close()
                    raise
            except (sqlite3.Error, OSError) as exc:
                raise BackendUnavailable(f"cannot open SQLite store {self.path}: {exc}") from exc
            self._conn, self._pid = conn, os.getpid()
            _open.add(self)
        return self._conn

    def _use_wal(self, conn: sqlite3.Connection) -> None:
        """Switch the file to WAL, waiting out other processes doing the same.

        Changing the journal mode takes an exclusive lock, and SQLite reports
        "database is locked" at once, without its busy timeout, while another
        process opens the same new file: retry until the timeout instead.
        """
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if not _busy(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(random.uniform(0.001, 0.02))  # apart, not in lockstep

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; a failure of the database (locked for too long, disk
        full, I/O error, a damaged file) is :class:`BackendUnavailable`.

        SQLite commits atomically: a transaction that fails, at any point, wrote
        nothing, so there is never anything to undo.
        """
        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise BackendUnavailable(f"SQLite store {self.path} is unavailable: {exc}") from exc
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                if conn.in_transaction:
                    with suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                if _outage(exc):
                    raise BackendUnavailable(f"SQLite store {self.path}: {exc}") from exc
                raise

    def _read(self, conn: sqlite3.Connection, keys: Sequence[str]) -> dict[str, _records.Record]:
        found: dict[str, _records.Record] = {}
        unique = list(dict.fromkeys(keys))
        # SQLite caps bound parameters per statement; read large batches in slices.
        for start in range(0, len(unique), 500):
            part = unique[start : start + 500]
            marks = ",".join("?" * len(part))
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM celery_unique_keys WHERE key IN ({marks})", part
            )
            found.update((row[0], _record(row)) for row in rows)
        return found

    def _write(self, conn: sqlite3.Connection, writes: _records.Writes) -> None:
        deletes = [(key,) for key, record in writes.items() if record is None]
        upserts = [
            (
                key,
                r.kind.value,
                r.job_id,
                r.task,
                r.scope.value if r.scope else None,
                int(r.finished),
                r.expires_at,
                r.fingerprint if r.kind is KeyKind.WINDOW else r.generation,
                r.policy,
                r.since,
                r.run,
                r.handed_from,
                None if r.on_duplicate is OnDuplicate.REUSE else r.on_duplicate.value,
                r.owed,
                r.arguments,
                r.due,
                r.cap,
                r.alive_until,
                r.passed_on_by,
            )
            for key, r in writes.items()
            if r is not None
        ]
        if deletes:
            conn.executemany("DELETE FROM celery_unique_keys WHERE key = ?", deletes)
        if upserts:
            conn.executemany(
                f"INSERT OR REPLACE INTO celery_unique_keys ({_COLUMNS}) "
                f"VALUES ({', '.join('?' * len(_COLUMNS.split(',')))})",
                upserts,
            )

    def _sweep(self, conn: sqlite3.Connection, now: int) -> None:
        if now - self._swept_at >= _SWEEP_EVERY_MS:
            conn.execute("DELETE FROM celery_unique_keys WHERE expires_at <= ?", (now,))
            self._swept_at = now

    # -- contract ---------------------------------------------------------------

    def decide(self, claims: Sequence[Claim], *, all_or_nothing: bool = True) -> list[Decision]:
        keys = [key for claim in claims for key in _records.claim_keys(claim)]
        with self._transaction() as conn:
            now = _now()
            existing = self._read(conn, keys)
            decisions, writes = _records.decide(
                claims, existing.get, now, all_or_nothing=all_or_nothing
            )
            self._write(conn, writes)
            self._sweep(conn, now)
        return decisions

    def _change(self, changes: Sequence[tuple[str, _records.Change]]) -> list[bool]:
        with self._transaction() as conn:
            now = _now()
            existing = self._read(conn, [key for key, _ in changes])
            changed, writes = _records.apply_changes(changes, existing.get, now)
            self._write(conn, writes)
            return changed

    def get(self, key: str) -> HeldKey | None:
        with self._transaction() as conn:
            record = self._read(conn, [key]).get(key)
        now = _now()
        return record.held(key, now) if record is not None and record.alive(now) else None

    def scan(self, *, kind: KeyKind | None = None, prefix: str = "") -> Iterator[HeldKey]:
        now = _now()
        with self._lock:
            try:
                rows = (
                    self._connection()
                    .execute(
                        f"SELECT {_COLUMNS} FROM celery_unique_keys "
                        "WHERE substr(key, 1, ?) = ? AND (expires_at IS NULL OR expires_at > ?) "
                        "ORDER BY key",
                        (len(prefix), prefix, now),
                    )
                    .fetchall()
                )
            except sqlite3.Error as exc:
                raise BackendUnavailable(f"SQLite store {self.path}: {exc}") from exc
        for row in rows:
            if is_release_note(row[0]):
                continue
            record = _record(row)
            if kind in (None, record.kind):
                yield record.held(row[0], now)

    def ping(self) -> None:
        with self._lock:
            try:
                self._connection().execute("SELECT 1")
            except sqlite3.Error as exc:
                raise BackendUnavailable(f"SQLite store {self.path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None


def _add_missing_columns(conn: sqlite3.Connection) -> None:
    """Bring a file made by an earlier version up to date."""
    have = {row[1] for row in conn.execute("PRAGMA table_info(celery_unique_keys)")}
    for column, kind in _LATER_COLUMNS.items():
        if column not in have:
            with suppress(sqlite3.OperationalError):  # another process added it meanwhile
                conn.execute(f"ALTER TABLE celery_unique_keys ADD COLUMN {column} {kind}")


def _outage(error: BaseException) -> bool:
    """A failure of the database, as opposed to a mistake in the statement."""
    return isinstance(error, sqlite3.DatabaseError) and not isinstance(
        error, sqlite3.ProgrammingError | sqlite3.IntegrityError | sqlite3.DataError
    )


#: SQLITE_BUSY and SQLITE_LOCKED (sqlite3.h); the module names them only from Python 3.11.
_BUSY_CODES = (5, 6)


def _busy(error: sqlite3.OperationalError) -> bool:
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return (code & 0xFF) in _BUSY_CODES  # the primary code of an extended one
    message = str(error)
    return "locked" in message or "busy" in message
