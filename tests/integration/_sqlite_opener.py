"""The body of each process of ``test_sqlite_processes.py`` (imported by spawned children)."""

from __future__ import annotations

import threading
import traceback
from pathlib import Path
from typing import Any

BARRIER_TIMEOUT_S = 60.0


def open_fresh_files(
    spec: tuple[str, int], child: int, barrier: threading.Barrier, results: Any
) -> None:
    """Round after round, open the round's new database file at the same instant as the others."""
    from celery_unique.stores.sqlite import SQLiteStore

    directory, rounds = spec
    error = None
    try:
        for number in range(rounds):
            barrier.wait(BARRIER_TIMEOUT_S)
            store = SQLiteStore(Path(directory) / f"round-{number}.db")
            store.ping()
            store.close()
    except BaseException:
        error = traceback.format_exc()
        barrier.abort()  # the others must not wait for this one
    results.put((child, error))
