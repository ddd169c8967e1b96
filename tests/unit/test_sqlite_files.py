"""The SQLite store's file: private when created, its mode kept when it exists, no
directories made up."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_unique.exceptions import ImproperlyConfigured
from celery_unique.stores.sqlite import SQLiteStore


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    """The umask most systems start processes with, which leaves files world-readable."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def opened(path: Path) -> None:
    store = SQLiteStore(path)
    try:
        store.ping()
    finally:
        store.close()


def test_a_new_store_file_is_readable_by_its_owner_alone(tmp_path: Path) -> None:
    """It keeps task arguments: 0600, and so are SQLite's -wal and -shm files beside it."""
    path = tmp_path / "unique.db"
    store = SQLiteStore(path)
    try:
        store.ping()
        assert mode(path) == 0o600
        for extra in ("unique.db-wal", "unique.db-shm"):
            if (tmp_path / extra).exists():
                assert mode(tmp_path / extra) == 0o600, extra
    finally:
        store.close()


def test_an_existing_store_file_keeps_its_mode(tmp_path: Path) -> None:
    """An operator's choice (a group sharing the store) is left as it is."""
    path = tmp_path / "unique.db"
    path.touch(mode=0o640)
    path.chmod(0o640)
    opened(path)
    assert mode(path) == 0o640


def test_a_missing_directory_is_improperly_configured(tmp_path: Path) -> None:
    """A mistyped path is an error naming the directory, and no directory is created."""
    path = tmp_path / "typo" / "deeper" / "unique.db"
    with pytest.raises(ImproperlyConfigured, match="does not exist") as raised:
        opened(path)
    assert raised.value.code == "improperly_configured"
    assert str(path.parent) in str(raised.value)
    assert not (tmp_path / "typo").exists()
