"""Waiting for something that happens in another process or thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def eventually(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
