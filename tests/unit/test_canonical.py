"""The canonical encoding: key order never matters, structure and types always do."""

from __future__ import annotations

import collections
import datetime
import decimal
import enum
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_unique.exceptions import InvalidPayload
from celery_unique.keys.canonical import VERSION_TAG, canonical_bytes, canonical_digest

ROOT = Path(__file__).resolve().parents[2]

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(),
)
json_values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=20,
)
# Few distinct leaves and keys, so that two independent draws are often equal
# or nearly so: the cases where a sloppy encoding would collide.
near_leaves = st.sampled_from(
    [None, True, False, 0, 1, 12, 1.0, 0.0, -0.0, 1.5, "", "1", "12", "a"]
)
near_values = st.recursive(
    near_leaves,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(["", "a", "b", "1"]), children, max_size=3)
    ),
    max_leaves=6,
)


def same(left: Any, right: Any) -> bool:
    """Equality that tells 1, 1.0 and True apart, and 0.0 from -0.0."""
    if type(left) is not type(right):
        return False
    if isinstance(left, dict):
        return left.keys() == right.keys() and all(same(left[k], right[k]) for k in left)
    if isinstance(left, list):
        return len(left) == len(right) and all(map(same, left, right))
    if isinstance(left, float):
        return bool(left.hex() == right.hex())
    return bool(left == right)


def reordered(value: Any, rng: random.Random) -> Any:
    """A copy of ``value`` with the members of every object inserted in a shuffled order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {key: reordered(member, rng) for key, member in items}
    if isinstance(value, list):
        return [reordered(member, rng) for member in value]
    return value


@given(json_values, st.randoms(use_true_random=False))
def test_key_order_never_matters(value: Any, rng: random.Random) -> None:
    """Inserting object members in any order, at any depth, gives the same bytes and digest."""
    shuffled = reordered(value, rng)
    assert canonical_bytes(shuffled) == canonical_bytes(value)
    assert canonical_digest(shuffled) == canonical_digest(value)


def test_key_order_example() -> None:
    """Two objects built in opposite orders encode alike (the property above, on a fixed case)."""
    forward = {"a": 1, "b": {"x": [1, {"p": 1, "q": 2}], "y": 2}}
    backward = {"b": {"y": 2, "x": [1, {"q": 2, "p": 1}]}, "a": 1}
    assert list(forward) != list(backward)
    assert canonical_bytes(forward) == canonical_bytes(backward)


@given(near_values, near_values)
def test_equal_bytes_exactly_when_equal_values(left: Any, right: Any) -> None:
    """Two values share canonical bytes if and only if they are equal, types included."""
    assert (canonical_bytes(left) == canonical_bytes(right)) == same(left, right)


@given(json_values, json_values)
def test_distinct_values_have_distinct_bytes(left: Any, right: Any) -> None:
    """Over arbitrary JSON values, the bytes are equal if and only if the values are."""
    assert (canonical_bytes(left) == canonical_bytes(right)) == same(left, right)


@given(json_values)
def test_encoding_reads_back_as_the_value(value: Any) -> None:
    """The bytes after the tag are JSON that decodes to the very value: nothing is lost."""
    encoded = canonical_bytes(value)
    assert encoded.startswith(VERSION_TAG)
    assert same(json.loads(encoded[len(VERSION_TAG) :]), value)


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ([1, 2], [12]),
        ("1", 1),
        ([], {}),
        ({}, None),
        ([], None),
        ("", None),
        ("null", None),
        ("true", True),
        (1, 1.0),
        (1, True),
        (0, False),
        (0.0, -0.0),
        ([[]], []),
        ([""], []),
        ({"a": None}, {}),
        ({"a": []}, {"a": {}}),
        ({"a": ""}, {"": "a"}),
        ({"a": "b"}, ["a", "b"]),
        ("a,b", ["a", "b"]),
        (["a,b"], ["a", "b"]),
        ([1, [2]], [[1], 2]),
        ({"a": {"b": 1}}, {"b": {"a": 1}}),
        ({"a": [1, 2]}, {"a": [2, 1]}),
        ({"a": 1, "b": 2}, {"a": 2, "b": 1}),
        ([[1], [2]], [[2], [1]]),
        ({"a": {"b": 1, "c": 2}}, {"a": {"b": 2, "c": 1}}),
    ],
)
def test_structure_and_types_always_matter(left: Any, right: Any) -> None:
    """Values differing only in structure, nesting or type never share bytes or digests."""
    assert canonical_bytes(left) != canonical_bytes(right)
    assert canonical_digest(left) != canonical_digest(right)


def test_exact_encoding() -> None:
    """The bytes are the tag and compact, key-sorted, ASCII-escaped JSON with shortest floats."""
    value = {
        "b": [1, 2.5, 1e16, 1e-05, -0.0, 10**30, True, None],
        "a": 'é\n"\\/\x7f\U0001f600',
        "\uff5e": {},
        "\U0001f600": [],
        "": 0,
    }
    assert canonical_bytes(value) == (
        b'cu1\n{"":0,"a":"\\u00e9\\n\\"\\\\/\\u007f\\ud83d\\ude00",'
        b'"b":[1,2.5,1e+16,1e-05,-0.0,1000000000000000000000000000000,true,null],'
        b'"\\uff5e":{},"\\ud83d\\ude00":[]}'
    )


def test_keys_sort_by_code_point_not_utf16() -> None:
    """U+FF5E sorts before U+1F600 (code point order), though UTF-16 would put it after."""
    encoded = canonical_bytes({"\U0001f600": 1, "\uff5e": 2})
    assert encoded == b'cu1\n{"\\uff5e":2,"\\ud83d\\ude00":1}'


@given(json_values)
def test_digest_is_sha256_of_the_bytes(value: Any) -> None:
    """The digest is the lowercase hex SHA-256 of exactly the canonical bytes."""
    digest = canonical_digest(value)
    assert digest == hashlib.sha256(canonical_bytes(value)).hexdigest()
    assert len(digest) == 64
    assert set(digest) <= set("0123456789abcdef")


@given(json_values)
def test_unchecked_digest_of_json_data_is_the_same_digest(value: Any) -> None:
    """Skipping the plain-JSON proof never changes what a valid value hashes to."""
    assert canonical_digest(value, checked=False) == canonical_digest(value)


def test_unchecked_digest_still_refuses_what_cannot_be_encoded() -> None:
    with pytest.raises(InvalidPayload):
        canonical_digest({"when": object()}, checked=False)


def test_version_tag_is_hashed() -> None:
    """The version tag is part of what is hashed, so plain SHA-256 of the JSON differs."""
    assert canonical_digest({"a": 1}) != hashlib.sha256(b'{"a":1}').hexdigest()


DIGEST_SCRIPT = """
import json
from celery_unique.keys.canonical import canonical_digest
words = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"}
payload = {word: {other: len(other) for other in words if other != word} for word in words}
print(json.dumps({"order": list(payload), "digest": canonical_digest(payload)}))
"""


def test_digest_is_stable_across_hash_seeds() -> None:
    """Processes with other PYTHONHASHSEEDs build dicts in other orders yet agree on the digest."""
    runs = []
    for seed in ("1", "2", "3"):
        environment = {**os.environ, "PYTHONHASHSEED": seed}
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT), environment.get("PYTHONPATH")])
        )
        completed = subprocess.run(
            [sys.executable, "-c", DIGEST_SCRIPT],
            env=environment,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        runs.append(json.loads(completed.stdout))
    words = sorted(runs[0]["order"])
    here = {word: {other: len(other) for other in words if other != word} for word in words}
    assert len({tuple(run["order"]) for run in runs}) > 1, "the seeds did not change dict order"
    assert {run["digest"] for run in runs} == {canonical_digest(here)}


class Colour(enum.IntEnum):
    RED = 1


class Name(str):
    pass


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


def cyclic() -> Any:
    value: dict[str, Any] = {"a": {"b": []}}
    value["a"]["b"].append(value)
    return value


@pytest.mark.parametrize(
    ("value", "path", "fragment"),
    [
        ({"x": float("nan")}, ".x", "nan at .x is not a JSON number"),
        ({"x": [1, float("inf")]}, ".x[1]", "inf at .x[1] is not a JSON number"),
        (float("-inf"), ".", "-inf at . is not a JSON number"),
        ({1: "a"}, ".", "object key 1 at . has type int, not str"),
        ({"a": {None: 1}}, ".a", "object key None at .a has type NoneType"),
        ({"a": {"z": 1, 2.5: 1}}, ".a", "object key 2.5 at .a has type float"),
        ({"a": {(1, 2): 1}}, ".a", "object key (1, 2) at .a has type tuple"),
        ({"tags": {"x"}}, ".tags", "set at .tags is not JSON data"),
        ({"items": [0, 1, 2, object()]}, ".items[3]", "object at .items[3] is not JSON data"),
        ({"when": datetime.date(2024, 1, 1)}, ".when", "date at .when is not JSON data"),
        ({"price": decimal.Decimal("1.5")}, ".price", "Decimal at .price"),
        ({"pair": (1, 2)}, ".pair", "tuple at .pair is not JSON data"),
        ({"raw": b"x"}, ".raw", "bytes at .raw"),
        ({"colour": Colour.RED}, ".colour", "Colour at .colour"),
        ({"name": Name("x")}, ".name", "Name at .name"),
        ({"o": collections.OrderedDict()}, ".o", "OrderedDict at .o"),
        ({"a b": {"c": [float("nan")]}}, '."a b".c[0]', 'nan at ."a b".c[0]'),
        ([{"ok": 1}, {"x": {"y": set()}}], ".[1].x.y", "set at .[1].x.y"),
        # What the encoder takes but plain JSON data is not, inside lists only.
        ([(1, 2)], ".[0]", "tuple at .[0] is not JSON data"),
        ([[{"a": {1: "x"}}]], ".[0][0].a", "object key 1 at .[0][0].a has type int"),
        ([1, [Name("x")]], ".[1][0]", "Name at .[1][0]"),
        (cyclic(), ".a.b[0]", "a container at .a.b[0] contains itself"),
    ],
)
def test_non_json_data_is_rejected_where_it_is(value: Any, path: str, fragment: str) -> None:
    """Anything outside plain JSON data raises InvalidPayload naming the path of the offender."""
    with pytest.raises(InvalidPayload) as caught:
        canonical_bytes(value)
    assert caught.value.path == path
    assert fragment in str(caught.value)
    assert caught.value.code == "invalid_payload"
    with pytest.raises(InvalidPayload):
        canonical_digest(value)


def test_integers_too_long_to_convert_are_rejected() -> None:
    """An integer beyond the process's int-to-str digit limit is rejected with its path."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if limit == 0:
        pytest.skip("this interpreter converts integers of any length")
    with pytest.raises(InvalidPayload) as caught:
        canonical_bytes({"n": [10 ** (limit + 1)]})
    assert caught.value.path == ".n[0]"


def test_too_deep_nesting_is_rejected() -> None:
    """Nesting deeper than the interpreter can encode raises InvalidPayload, not RecursionError."""
    with pytest.raises(InvalidPayload, match="nested too deeply"):
        canonical_bytes(nested(100_000))


def test_moderate_nesting_is_fine() -> None:
    """Nesting as deep as ordinary JSON decoders accept encodes normally."""
    assert canonical_bytes(nested(500)) == b"cu1\n" + b"[" * 501 + b"]" * 501


def test_checked_is_given_by_name() -> None:
    """``checked=False`` skips a proof: a positional ``False`` cannot turn it off by mistake."""
    with pytest.raises(TypeError):
        canonical_digest({}, False)  # type: ignore[misc]
