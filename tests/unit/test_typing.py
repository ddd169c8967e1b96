"""The user code that ``mypy --strict`` checks (``tests/typing``) also runs as written."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_unique import Disposition, config
from tests.typing import user_code


@pytest.fixture(autouse=True)
def fresh_store() -> Iterator[None]:
    yield
    config.reset(user_code.app)


def test_typed_user_code_runs() -> None:
    disposition, duplicate, match, drift = user_code.dispatch_and_read_the_receipt()
    assert (disposition, duplicate, match, drift) == (Disposition.CREATED, True, "active", False)
    assert user_code.handle_a_conflict() is not None
    assert user_code.many() == ["created", "created", "created"]
    assert user_code.many() == ["reused", "reused", "reused"]
    assert user_code.dispatch_a_mixin_task() is Disposition.CREATED
