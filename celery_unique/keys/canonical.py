"""Canonical bytes of JSON data, and their SHA-256: the same data always hashes alike.

Encoding ``cu1`` (docs/keys-and-hashing.md specifies it for other languages):
the tag ``b"cu1\\n"`` followed by the value as compact JSON with object members
sorted by key (Unicode code point order), ASCII only (every other character,
``"``, ``\\`` and the control characters escaped), integers in plain decimal and
floats as the shortest text that reads back as the same double. JSON's own
syntax is the framing and the type marker: strings are quoted, numbers bare,
``true``/``false``/``null`` distinct words, containers bracketed.

The input is JSON data exactly as ``json.loads`` returns it: ``dict`` with
``str`` keys, ``list``, ``str``, ``int``, ``float``, ``bool``, ``None``. Anything
else (NaN and infinities, non-``str`` keys, tuples, sets, subclasses, other
objects) raises :class:`InvalidPayload` naming where it is, because encoding it
anyway would let two different values share a digest (``{1: x}`` and
``{"1": x}`` both encode as ``{"1":x}``).
"""

from __future__ import annotations

import hashlib
import json
import math
from itertools import chain
from typing import Any

from celery_unique.exceptions import InvalidPayload
from celery_unique.keys.paths import Segment, render_path

#: Hashed ahead of every encoding, so a future algorithm cannot collide with this one.
VERSION_TAG = b"cu1\n"

# The C encoder is what makes hashing a large payload cost about one json.dumps.
_ENCODER = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
)
_LEAF_TYPES = frozenset({str, int, float, bool, type(None)})
_JSON_TYPES = _LEAF_TYPES | {dict, list}
_STR_ONLY = frozenset({str})
_EXPECTED = "expected dict, list, str, int, float, bool or None"
_is_dict = dict.__instancecheck__
_is_list = list.__instancecheck__


def canonical_bytes(value: object) -> bytes:
    """The exact bytes hashed for ``value``: the version tag, then its canonical JSON."""
    return VERSION_TAG + _encode(value)


def canonical_digest(value: object, *, checked: bool = True) -> str:
    """SHA-256 of :func:`canonical_bytes`, as 64 lowercase hex digits.

    ``checked=False`` skips proving that ``value`` is plain JSON data, for
    callers that built it only from ``json.loads`` output and their own
    ``str``/``int`` fields: the proof costs as much as the encoding of a small
    document. The digest is the same either way.
    """
    hasher = hashlib.sha256(VERSION_TAG)
    hasher.update(_encode(value, checked=checked))
    return hasher.hexdigest()


def _encode(value: object, *, checked: bool = True) -> bytes:
    try:
        text = _ENCODER.encode(value)
    except (TypeError, ValueError, RecursionError) as error:
        raise _invalid(value) from error
    # The encoder itself accepts int keys, tuples and subclasses; only after it
    # succeeded (so there is no cycle) do we check that it saw plain JSON data.
    if checked and not _is_plain_json(value):
        raise _invalid(value)
    return text.encode("ascii")


def _is_plain_json(value: object) -> bool:
    """Every container a plain dict or list, every key a str, every leaf a JSON scalar.

    Walks one depth level at a time with C-level iteration (``map``, ``filter``,
    ``chain``): visiting nodes one by one in Python would cost more than the
    encoding itself. ``kinds`` is checked before filtering, so no subclass is
    left for the isinstance-based filters to let through.
    """
    level: list[Any] = [value]
    kinds = {type(value)}
    while kinds <= _JSON_TYPES:
        dicts = list(filter(_is_dict, level)) if dict in kinds else []
        lists = list(filter(_is_list, level)) if list in kinds else []
        if not dicts and not lists:
            return True
        if not _STR_ONLY.issuperset(map(type, chain.from_iterable(dicts))):
            return False
        level = [*chain.from_iterable(map(dict.values, dicts)), *chain.from_iterable(lists)]
        kinds = set(map(type, level))
    return False


def _invalid(value: object) -> InvalidPayload:
    """The error for a value that is not plain JSON data, naming where the problem is."""
    try:
        problem = _find_problem(value, (), set())
    except RecursionError:
        return InvalidPayload("cannot hash the payload: it is nested too deeply")
    if problem is None:
        return InvalidPayload("cannot hash the payload: it is not JSON data")
    subject, complaint, segments = problem
    path = render_path(segments)
    return InvalidPayload(f"cannot hash the payload: {subject} at {path} {complaint}", path=path)


def _find_problem(
    value: object, segments: tuple[Segment, ...], ancestors: set[int]
) -> tuple[str, str, tuple[Segment, ...]] | None:
    """The first thing (depth first, in insertion order) that is not plain JSON data."""
    if type(value) is float:
        return None if math.isfinite(value) else (repr(value), "is not a JSON number", segments)
    if type(value) is int:
        try:
            int.__repr__(value)
        except ValueError:
            return ("an integer", "has more digits than this process converts", segments)
        return None
    if type(value) in _LEAF_TYPES:
        return None
    if type(value) is not dict and type(value) is not list:
        return (type(value).__qualname__, f"is not JSON data ({_EXPECTED})", segments)
    if id(value) in ancestors:
        return ("a container", "contains itself", segments)
    ancestors.add(id(value))
    members: Any
    if isinstance(value, dict):
        for key in value:
            if type(key) is not str:
                return (
                    f"object key {key!r}",
                    f"has type {type(key).__qualname__}, not str",
                    segments,
                )
        members = value.items()
    else:
        assert isinstance(value, list)
        members = enumerate(value)
    for key, member in members:
        problem = _find_problem(member, (*segments, key), ancestors)
        if problem is not None:
            return problem
    ancestors.discard(id(value))
    return None
