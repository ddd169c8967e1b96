"""The SQLite store around the shared rules: files of an earlier version, batches larger
than one statement binds, the sweep of expired rows, other connections holding the
file's locks, failures inside a decision, and the connection itself (threads, closing).
Every store here is a real file in tmp_path; other connections are plain sqlite3 ones,
as another process would be."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_unique.exceptions import BackendUnavailable
from celery_unique.stores import sqlite as sqlite_store
from celery_unique.stores.base import ActiveClaim, Claim, Decision, KeyKind, Scope, Verdict
from celery_unique.stores.sqlite import SQLiteStore

A = "unique:v1:{ns}:a:tasks.recalc\x1ftenant:7"
B = "unique:v1:{ns}:a:tasks.recalc\x1ftenant:8"
C = "unique:v1:{ns}:a:tasks.recalc\x1ftenant:9"
LONG = 60_000


def active(job: str, key: str = A, lease: int | None = LONG) -> Claim:
    return Claim(job_id=job, task="tasks.recalc", active=ActiveClaim(key, Scope.QUEUED, lease))


def other_connection(path: Path) -> sqlite3.Connection:
    """A connection of its own to the file, in autocommit, usable from any thread."""
    return sqlite3.connect(path, isolation_level=None, check_same_thread=False)


def keys_in_file(path: Path) -> list[str]:
    conn = other_connection(path)
    try:
        return [row[0] for row in conn.execute("SELECT key FROM celery_unique_keys ORDER BY key")]
    finally:
        conn.close()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "unique.db"


@pytest.fixture
def store(path: Path) -> Iterator[SQLiteStore]:
    built = SQLiteStore(path)
    yield built
    built.close()


class Clock:
    """The store's clock, set by the test: ms since the epoch."""

    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    set_clock = Clock(1_700_000_000_000)
    monkeypatch.setattr(sqlite_store, "_now", set_clock)
    return set_clock


# -- files of an earlier version ------------------------------------------------------


def test_a_file_of_the_first_version_gains_the_later_columns_and_keeps_its_keys(
    path: Path, store: SQLiteStore
) -> None:
    conn = other_connection(path)
    conn.execute(
        "CREATE TABLE celery_unique_keys (key TEXT PRIMARY KEY, kind TEXT NOT NULL, "
        "job_id TEXT NOT NULL, task TEXT NOT NULL, scope TEXT, "
        "finished INTEGER NOT NULL DEFAULT 0, expires_at INTEGER, fingerprint TEXT, "
        "policy TEXT) WITHOUT ROWID"
    )
    conn.execute(
        "INSERT INTO celery_unique_keys (key, kind, job_id, task, scope) VALUES (?, ?, ?, ?, ?)",
        (A, "active", "old-job", "tasks.recalc", "queued"),
    )
    conn.close()

    held = store.get(A)
    assert held is not None
    assert (held.job_id, held.kind, held.scope, held.since_ms) == (
        "old-job",
        KeyKind.ACTIVE,
        Scope.QUEUED,
        None,
    )
    duplicate = store.decide([active("new-job")])[0]
    assert (duplicate.verdict, duplicate.job_id) == (Verdict.REUSED_ACTIVE, "old-job")
    assert store.decide([active("other", key=B)])[0].verdict is Verdict.CREATED
    written = store.get(B)
    assert written is not None
    assert written.since_ms is not None

    conn = other_connection(path)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(celery_unique_keys)")}
    conn.close()
    assert set(sqlite_store._LATER_COLUMNS) <= columns


# -- batches --------------------------------------------------------------------------


def test_a_batch_of_more_keys_than_one_statement_reads_sees_every_held_key(
    store: SQLiteStore,
) -> None:
    """The keys are read in slices: none may fall between two of them."""
    keys = [f"unique:v1:{{ns}}:a:tasks.recalc\x1ftenant:{n}" for n in range(1_201)]
    created = store.decide([active(f"first-{n}", key=key) for n, key in enumerate(keys)])
    assert {decision.verdict for decision in created} == {Verdict.CREATED}

    again = store.decide([active(f"second-{n}", key=key) for n, key in enumerate(keys)])
    assert [(decision.verdict, decision.job_id) for decision in again] == [
        (Verdict.REUSED_ACTIVE, f"first-{n}") for n in range(len(keys))
    ]


# -- the sweep of expired rows ---------------------------------------------------------


def test_expired_rows_are_swept_by_a_decision_at_most_every_thirty_seconds(
    path: Path, store: SQLiteStore, clock: Clock
) -> None:
    start = clock.now
    store.decide([active("j1", key=A, lease=10)])  # the first decision sweeps

    clock.now = start + 29_999
    store.decide([active("j2", key=B, lease=1)])
    assert store.get(A) is None  # expired, answered as gone...
    assert keys_in_file(path) == [A, B]  # ...but not swept yet

    clock.now = start + 30_000  # B expires at this very millisecond
    store.decide([active("j3", key=C)])
    assert keys_in_file(path) == [C]

    clock.now = start + 59_998  # the next sweep is due 30 s after the last one
    store.decide([active("j4", key=A, lease=1)])
    clock.now += 1
    store.decide([active("j5", key=B)])
    assert keys_in_file(path) == [A, B, C]
    clock.now += 1
    store.decide([active("j6", key=C)])
    assert keys_in_file(path) == [B, C]


def test_times_are_the_wall_clock_in_milliseconds(store: SQLiteStore) -> None:
    before = time.time_ns() // 1_000_000
    store.decide([active("j1", lease=LONG)])
    after = time.time_ns() // 1_000_000
    held = store.get(A)
    assert held is not None
    assert held.since_ms is not None
    assert before <= held.since_ms <= after
    assert held.expires_in_ms is not None
    assert LONG - (after - before) - 1_000 <= held.expires_in_ms <= LONG


# -- other connections holding the file's locks -----------------------------------------


def rollback_journal_file_being_written(path: Path) -> sqlite3.Connection:
    """A file not in WAL yet, with another connection in a write transaction on it: SQLite
    refuses a switch to WAL at once, without waiting for its busy timeout."""
    conn = other_connection(path)
    conn.execute("CREATE TABLE elsewhere (x INTEGER)")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO elsewhere VALUES (1)")
    return conn


def test_opening_a_file_being_written_waits_until_the_writer_is_done(path: Path) -> None:
    writer = rollback_journal_file_being_written(path)
    done = threading.Timer(0.3, writer.execute, ("COMMIT",))
    store = SQLiteStore(path, timeout_s=10.0)
    began = time.monotonic()
    done.start()
    try:
        store.ping()
        assert time.monotonic() - began >= 0.3
        assert store.decide([active("j1")])[0].verdict is Verdict.CREATED
    finally:
        done.join()
        store.close()
        writer.close()
    conn = other_connection(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


@pytest.mark.timeout(15)
def test_opening_a_file_written_for_longer_than_the_timeout_is_unavailable(path: Path) -> None:
    writer = rollback_journal_file_being_written(path)
    store = SQLiteStore(path, timeout_s=0.3)
    began = time.monotonic()
    try:
        with pytest.raises(BackendUnavailable, match="database is locked") as raised:
            store.ping()
        assert time.monotonic() - began >= 0.3
        assert raised.value.code == "backend_unavailable"
        assert str(path) in str(raised.value)
    finally:
        writer.close()
        store.close()


def test_a_decision_waiting_longer_than_the_timeout_for_the_lock_is_unavailable(
    path: Path,
) -> None:
    store = SQLiteStore(path, timeout_s=0.2)
    store.ping()
    writer = other_connection(path)
    writer.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(BackendUnavailable, match="unavailable: database is locked") as raised:
            store.decide([active("j1")])
        assert raised.value.code == "backend_unavailable"
        assert str(path) in str(raised.value)
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert store.get(A) is None
    assert store.decide([active("j2")])[0].verdict is Verdict.CREATED
    store.close()


# -- failures inside a decision ----------------------------------------------------------


def test_a_row_the_store_cannot_read_fails_that_decision_alone(
    path: Path, store: SQLiteStore
) -> None:
    """Not an outage: the error is raised as it is, the transaction is undone and the
    next decision goes through."""
    store.ping()
    conn = other_connection(path)
    conn.execute(
        "INSERT INTO celery_unique_keys (key, kind, job_id, task) VALUES (?, ?, ?, ?)",
        (A, "no-such-kind", "foreign", "tasks.recalc"),
    )
    conn.close()
    with pytest.raises(ValueError, match="no-such-kind"):
        store.decide([active("j1", key=A), active("j1", key=B)])
    assert store.decide([active("j2", key=B)])[0].verdict is Verdict.CREATED
    held = store.get(B)
    assert held is not None
    assert held.job_id == "j2"


def test_a_file_whose_table_is_gone_is_unavailable(path: Path, store: SQLiteStore) -> None:
    store.decide([active("j1")])
    conn = other_connection(path)
    conn.execute("DROP TABLE celery_unique_keys")
    conn.close()
    with pytest.raises(BackendUnavailable, match="no such table") as raised:
        store.decide([active("j2", key=B)])
    assert raised.value.code == "backend_unavailable"
    with pytest.raises(BackendUnavailable, match="no such table"):
        list(store.scan())


def test_a_file_that_cannot_be_opened_is_unavailable(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / ("x" * 300 + ".db"))
    with pytest.raises(BackendUnavailable, match="cannot open SQLite store") as raised:
        store.ping()
    assert raised.value.code == "backend_unavailable"


# -- scans ----------------------------------------------------------------------------


def test_a_scan_passes_over_a_release_note_to_the_keys_after_it(store: SQLiteStore) -> None:
    """A note (``unique:released:...``) sorts before every held key."""
    store.decide([Claim("j1", "tasks.recalc", ActiveClaim(A, Scope.ACTIVE, LONG, generation="g1"))])
    assert store.delete(A, job_id="j1") is True
    store.decide([active("j2", key=B)])
    assert [(held.key, held.job_id) for held in store.scan()] == [(B, "j2")]


# -- the connection -------------------------------------------------------------------


def test_a_store_opened_in_one_thread_answers_in_another(store: SQLiteStore) -> None:
    store.decide([active("j1")])
    answers: list[Decision] = []
    thread = threading.Thread(target=lambda: answers.append(store.decide([active("j2")])[0]))
    thread.start()
    thread.join()
    assert [(d.verdict, d.job_id) for d in answers] == [(Verdict.REUSED_ACTIVE, "j1")]


def test_closing_the_store_closes_its_file_and_a_later_call_opens_it_again(
    path: Path, store: SQLiteStore
) -> None:
    """The last connection to close folds the write-ahead log into the file and removes it."""
    store.decide([active("j1")])
    assert (path.parent / "unique.db-wal").exists()
    store.close()
    assert not (path.parent / "unique.db-wal").exists()
    store.close()  # twice is harmless
    held = store.get(A)
    assert held is not None
    assert held.job_id == "j1"


# -- urls -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite:///relative/unique.db", "relative/unique.db"),
        ("sqlite:////absolute/unique.db", "/absolute/unique.db"),
        ("sqlite:///odd://name.db", "odd://name.db"),
    ],
)
def test_a_url_names_a_relative_or_an_absolute_file(url: str, path: str) -> None:
    assert SQLiteStore.from_url(url).path == Path(path)


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "busy"),
    [
        ("database is locked", True),
        ("database table is locked", True),
        ("database is busy", True),
        ("disk I/O error", False),
    ],
)
def test_an_error_without_its_sqlite_code_is_told_busy_by_its_message(
    message: str, busy: bool
) -> None:
    """Python 3.10's errors carry no ``sqlite_errorcode``; a bare one stands for them here."""
    assert sqlite_store._busy(sqlite3.OperationalError(message)) is busy


@pytest.mark.parametrize(
    ("code", "busy"),
    [
        (5, True),  # SQLITE_BUSY
        (6, True),  # SQLITE_LOCKED
        (5 | 2 << 8, True),  # SQLITE_BUSY_SNAPSHOT: an extended code of SQLITE_BUSY
        (6 | 1 << 8, True),  # SQLITE_LOCKED_SHAREDCACHE
        (1, False),  # SQLITE_ERROR
        (10, False),  # SQLITE_IOERR
        (7 | 5 << 8, False),  # no primary code of these, whatever its extended bits
    ],
)
def test_an_error_is_told_busy_by_its_primary_sqlite_code(code: int, busy: bool) -> None:
    """Its message is neither "locked" nor "busy": the code alone decides (Python 3.11+)."""
    error = sqlite3.OperationalError("some failure")
    error.sqlite_errorcode = code  # type: ignore[attr-defined]  # Python 3.11+, not in the stubs
    assert sqlite_store._busy(error) is busy


@pytest.mark.skipif(not hasattr(os, "fork"), reason="a process forked, as a prefork pool's")
def test_what_a_forked_child_writes_outlives_the_parents_connection(
    store: SQLiteStore, path: Path
) -> None:
    """A Celery worker forks its pool children with its own connection open, and both
    write. The parent closing first must not take the child's writes with it."""
    assert store.decide([active("parent", A)])[0].verdict is Verdict.CREATED
    to_child, from_child = os.pipe(), os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a fork of a threaded process
        pid = os.fork()
    if pid == 0:  # the child: no pytest here, only an exit code
        code = 1
        try:
            first = store.decide([active("child-1", B)])[0].verdict
            os.write(from_child[1], b"1")
            os.read(to_child[0], 1)  # the parent has closed its connection
            second = store.decide([active("child-2", C)])[0].verdict
            store.close()
            code = 0 if first is second is Verdict.CREATED else 2
        finally:
            os._exit(code)
    assert os.read(from_child[0], 1) == b"1"
    store.close()
    os.write(to_child[1], b"1")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's decisions"
    assert keys_in_file(path) == [A, B, C]
