"""Fixtures shared by the integration tests that read the Redis broker's database."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis


@pytest.fixture
def broker(celery_redis_url: str) -> Iterator[Any]:
    """A client on the broker's Redis database."""
    with redis.Redis.from_url(celery_redis_url) as client:
        yield client
