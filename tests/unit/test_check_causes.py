"""E012/W012 name why the store cannot be used: its login refused, not set up, unreachable."""

from __future__ import annotations

import pytest

from celery_unique.checks.store import unusable_because
from celery_unique.exceptions import BackendUnavailable, ImproperlyConfigured


def wrapped(cause: BaseException) -> BackendUnavailable:
    """``cause`` as a store raises it: wrapped, the client's error kept as the cause."""
    try:
        try:
            raise cause
        except BaseException as exc:
            raise BackendUnavailable(f"store unavailable: {exc}") from exc
    except BackendUnavailable as outer:
        return outer


class AuthenticationError(Exception):
    """redis-py's name for a refused login."""


@pytest.mark.parametrize(
    ("error", "what"),
    [
        (wrapped(AuthenticationError("invalid username-password pair")), "refuses the credentials"),
        (wrapped(RuntimeError("WRONGPASS invalid username-password")), "refuses the credentials"),
        (ImproperlyConfigured("celery_unique_django is not in INSTALLED_APPS"), "cannot be opened"),
        (wrapped(ModuleNotFoundError("No module named 'redis'")), "cannot be opened"),
        (wrapped(ConnectionRefusedError(111, "Connection refused")), "cannot be reached"),
        (wrapped(TimeoutError("timed out")), "cannot be reached"),
        (wrapped(RuntimeError("no such table (run `manage.py migrate`)")), "has no table yet"),
        (RuntimeError("something else"), "does not answer its first command"),
    ],
)
def test_each_cause_is_named(error: BaseException, what: str) -> None:
    assert unusable_because(error)[0].startswith(what)
