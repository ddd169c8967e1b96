"""The shared store contract, held against the Django store on SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_unique.stores import open_store
from celery_unique.stores.base import Store
from tests.contract.test_duplicates_contract import *  # noqa: F403
from tests.contract.test_store_contract import *  # noqa: F403  (the contract's tests)
from tests.django.conftest import database_params, require_database


@pytest.fixture(params=database_params(transaction=True))
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A ``django://<alias>`` store on an empty table of that test database."""
    require_database(request.param)
    built = open_store(f"django://{request.param}")
    yield built
    built.close()
