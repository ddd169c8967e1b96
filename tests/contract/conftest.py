"""One contract, every store: each test here runs against memory, SQLite and Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_unique.stores.base import Store
from celery_unique.stores.memory import MemoryStore
from celery_unique.stores.sqlite import SQLiteStore

STORES = ["memory", "sqlite", pytest.param("redis", marks=pytest.mark.redis)]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A fresh, empty store of each kind."""
    built: Store
    if request.param == "memory":
        built = MemoryStore()
    elif request.param == "sqlite":
        built = SQLiteStore(tmp_path / "unique.db")
    else:
        from celery_unique.stores.redis import RedisStore

        request.getfixturevalue("redis_client")  # flushes the test database
        built = RedisStore.from_url(request.getfixturevalue("redis_url"))
    yield built
    built.close()
