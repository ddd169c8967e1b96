"""Durations given as a ``timedelta`` or seconds, checked and turned into milliseconds."""

from __future__ import annotations

from datetime import timedelta

from celery_unique.exceptions import InvalidDeclaration, InvalidWindow

MAX_WINDOW_MS = 3650 * 24 * 3600 * 1000
#: How far (in ms) a window given as float seconds may be from a whole millisecond: 1 µs.
WHOLE_MS_TOLERANCE = 1e-3


def parse_window(value: object, option: str = "unique_window") -> int:
    """A window (or a debounce) in whole milliseconds: positive, at most 3,650 days."""
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise InvalidWindow(f"{option} must be a timedelta or a number of seconds, not {value!r}")
    if isinstance(value, timedelta):
        micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
        if micros % 1000:
            raise InvalidWindow(f"{option} {value} is not a whole number of milliseconds")
        ms = micros // 1000
    else:
        exact = value * 1000
        if exact != exact or exact in (float("inf"), float("-inf")):
            raise InvalidWindow(f"{option} {value!r} s is not a number of milliseconds")
        ms = round(exact)
        # Seconds as a float rarely hit a whole millisecond exactly (1.001 * 1000 is
        # 1000.9999999999999): within a microsecond of one counts as whole.
        if abs(exact - ms) > WHOLE_MS_TOLERANCE:
            raise InvalidWindow(f"{option} {value!r} s is not a whole number of milliseconds")
    if ms <= 0:
        raise InvalidWindow(f"{option} must be positive, not {value!r}")
    if ms > MAX_WINDOW_MS:
        raise InvalidWindow(f"{option} {value!r} is longer than 3,650 days")
    return ms


def parse_duration_ms(value: object, option: str) -> int | None:
    """A non-negative duration (timedelta or seconds) in ms; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise InvalidDeclaration(f"{option} must be a timedelta or seconds, not {value!r}")
    if seconds < 0:
        raise InvalidDeclaration(f"{option} must not be negative, not {value!r}")
    return round(seconds * 1000)
