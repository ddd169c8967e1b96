"""Processes opening one new SQLite store file at the same instant all get a working store.

The first opener switches the file to WAL, which takes an exclusive lock;
SQLite then answers "database is locked" at once (its busy timeout does not
apply) to another process doing the same. The store must wait that out.
"""

from __future__ import annotations

from pathlib import Path

from tests.integration._sqlite_opener import open_fresh_files
from tests.spawned import run_in_processes

PROCESSES = 8
ROUNDS = 150


def test_processes_opening_a_new_file_at_once_all_succeed(tmp_path: Path) -> None:
    reports = run_in_processes(open_fresh_files, (str(tmp_path), ROUNDS), PROCESSES, 300)
    errors = [f"child {child}:\n{error}" for child, error in reports if error]
    assert not errors, "\n".join(errors)
    assert sorted(p.name for p in tmp_path.glob("round-*.db")) == sorted(
        f"round-{n}.db" for n in range(ROUNDS)
    )
