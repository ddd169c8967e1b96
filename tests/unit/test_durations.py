"""Durations (windows, debounces, leases, retentions): checked and turned into milliseconds."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest

from celery_unique.config.durations import MAX_WINDOW_MS, parse_duration_ms, parse_window
from celery_unique.exceptions import InvalidDeclaration, InvalidWindow

LONGEST = timedelta(days=3650)


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        (timedelta(days=1, seconds=2, milliseconds=3), 86_402_003),
        (timedelta(days=1, seconds=128), 86_528_000),
        (timedelta(seconds=1, microseconds=5000), 1005),
        (2, 2000),
        (0.25, 250),
        (0.0010000009, 1),  # within a microsecond of a whole millisecond
        (LONGEST, 3650 * 86_400_000),
        (3650 * 86_400, 3650 * 86_400_000),
    ],
)
def test_a_window_in_whole_milliseconds(value: object, ms: int) -> None:
    """Days, seconds and microseconds of a timedelta all count; seconds may be a float.
    The result is an int, as the stores take it."""
    parsed = parse_window(value)
    assert parsed == ms
    assert type(parsed) is int


def test_the_longest_window_is_3650_days() -> None:
    assert MAX_WINDOW_MS == 3650 * 24 * 3600 * 1000


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (True, "must be a timedelta or a number of seconds, not True"),
        ("60", "must be a timedelta or a number of seconds, not '60'"),
        (None, "must be a timedelta or a number of seconds, not None"),
        (timedelta(microseconds=1500), "is not a whole number of milliseconds"),
        (timedelta(seconds=1, microseconds=1), "is not a whole number of milliseconds"),
        (float("nan"), "nan s is not a number of milliseconds"),
        (float("inf"), "inf s is not a number of milliseconds"),
        (float("-inf"), "-inf s is not a number of milliseconds"),
        (0.0015, "0.0015 s is not a whole number of milliseconds"),
        (0.001002, "is not a whole number of milliseconds"),
        # exactly one microsecond off a whole (zero) millisecond: whole, and not positive
        (0.000001, "must be positive, not 1e-06"),
        (0, "must be positive, not 0"),
        (-1, "must be positive, not -1"),
        (timedelta(0), "must be positive"),
        (-timedelta(milliseconds=1), "must be positive"),
        (LONGEST + timedelta(milliseconds=1), "is longer than 3,650 days"),
        (3650 * 86_400 + 0.001, "is longer than 3,650 days"),
    ],
    ids=repr,
)
def test_a_window_that_is_refused_says_why(value: object, reason: str) -> None:
    """invalid_window, naming the option and what is wrong with the value."""
    with pytest.raises(InvalidWindow, match=re.escape(reason)) as caught:
        parse_window(value, "unique_debounce")
    assert str(caught.value).startswith("unique_debounce ")


def test_a_window_names_unique_window_by_default() -> None:
    with pytest.raises(InvalidWindow, match=r"^unique_window must be positive"):
        parse_window(0)


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        (None, None),
        (0, 0),
        (0.0, 0),
        (2, 2000),
        (0.25, 250),
        (0.0004, 0),
        (timedelta(seconds=1, milliseconds=500), 1500),
        (timedelta(days=1), 86_400_000),
        (timedelta(0), 0),
    ],
)
def test_a_duration_in_milliseconds(value: object, ms: int | None) -> None:
    """Zero is a duration (no lease, no retention); ``None`` stays unset."""
    parsed = parse_duration_ms(value, "unique_lease")
    assert parsed == ms
    assert type(parsed) is type(ms)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (True, "must be a timedelta or seconds, not True"),
        ("5", "must be a timedelta or seconds, not '5'"),
        ([], "must be a timedelta or seconds, not []"),
        (-1, "must not be negative, not -1"),
        (-0.001, "must not be negative, not -0.001"),
        (-timedelta(seconds=1), "must not be negative"),
    ],
    ids=repr,
)
def test_a_duration_that_is_refused_says_why(value: object, reason: str) -> None:
    """invalid_declaration, naming the option and what is wrong with the value."""
    with pytest.raises(InvalidDeclaration, match=re.escape(reason)) as caught:
        parse_duration_ms(value, "unique_retention")
    assert str(caught.value).startswith("unique_retention ")
