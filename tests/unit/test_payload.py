"""``Payload(...)``: which part of the payload is hashed, and the keys it derives."""

from __future__ import annotations

import copy
import json
import pickle
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_unique.exceptions import InvalidDeclaration, InvalidPath, InvalidPayload
from celery_unique.keys.canonical import canonical_digest
from celery_unique.keys.payload import Payload

Segments = tuple[str | int, ...]

# --- an independent reference: resolve every path to concrete addresses, then rebuild


def resolve(payload: Any, segments: Segments) -> list[tuple[str | int, str | int]] | None:
    """The (segment as written, key or position reached) steps of a path, or None if it misses."""
    steps: list[tuple[str | int, str | int]] = []
    value = payload
    for segment in segments:
        if isinstance(segment, str):
            if not isinstance(value, dict) or segment not in value:
                return None
            steps.append((segment, segment))
            value = value[segment]
        else:
            if not isinstance(value, list):
                return None
            position = segment if segment >= 0 else len(value) + segment
            if not 0 <= position < len(value):
                return None
            steps.append((segment, position))
            value = value[position]
    return steps


def reference(payload: Any, only: list[Segments] | None, excluded: list[Segments]) -> Any:
    """What the docs say ``Payload(only, exclude)`` hashes, computed the slow, obvious way."""
    gone = set()
    for segments in excluded:
        steps = resolve(payload, segments)
        if steps is not None:
            gone.add(tuple(position for _, position in steps))

    def strip(value: Any, address: tuple[Any, ...]) -> Any:
        if isinstance(value, dict):
            return {
                key: strip(member, (*address, key))
                for key, member in value.items()
                if (*address, key) not in gone
            }
        if isinstance(value, list):
            return [
                strip(member, (*address, index))
                for index, member in enumerate(value)
                if (*address, index) not in gone
            ]
        return value

    def build(value: Any, address: tuple[Any, ...], picks: list[list[Any]]) -> Any:
        if any(not steps for steps in picks):
            return strip(value, address)
        groups: dict[tuple[Any, Any], list[list[Any]]] = {}
        for steps in picks:
            groups.setdefault(steps[0], []).append(steps[1:])
        if isinstance(value, dict):
            return {
                label: build(value[key], (*address, key), rest)
                for (label, key), rest in groups.items()
            }
        pairs = [
            [label, build(value[position], (*address, position), rest)]
            for (label, position), rest in groups.items()
        ]
        return sorted(pairs, key=lambda pair: pair[0])

    if only is None:
        return strip(payload, ())
    picks = []
    for segments in only:
        steps = resolve(payload, segments)
        if steps is None:
            continue
        addresses = tuple(position for _, position in steps)
        if not any(addresses[:length] in gone for length in range(1, len(addresses) + 1)):
            picks.append(steps)
    return build(payload, (), picks)


# --- strategies: payloads over a few keys, and paths over the same keys, in varied spellings

KEYS = ["a", "b", "c d", "0"]
values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(["", "x"])),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS), children, max_size=4)
    ),
    max_leaves=16,
)
payloads = st.dictionaries(st.sampled_from(KEYS), values, max_size=4)


@st.composite
def spelled_segment(draw: st.DrawFn) -> tuple[str | int, str]:
    """One segment and one of the ways to write it."""
    if draw(st.booleans()):
        key = draw(st.sampled_from(KEYS))
        spellings = [f".{json.dumps(key)}", f".[{json.dumps(key)}]"]
        if re.fullmatch(r"[A-Za-z_]\w*", key):
            spellings.append(f".{key}")
        return key, draw(st.sampled_from(spellings))
    index = draw(st.integers(-3, 3))
    return index, draw(st.sampled_from([f"[{index}]", f".[{index}]"]))


@st.composite
def spelled_path(draw: st.DrawFn) -> tuple[Segments, str]:
    """A path as segments, and as text that starts with a dot."""
    parts = draw(st.lists(spelled_segment(), min_size=1, max_size=3))
    text = "".join(spelling for _, spelling in parts)
    return tuple(segment for segment, _ in parts), text if text[0] == "." else "." + text


path_lists = st.lists(spelled_path(), min_size=1, max_size=4)


@given(payloads, path_lists)
def test_only_matches_the_reference(payload: dict[str, Any], paths: list[Any]) -> None:
    """``only`` hashes exactly the reference projection of the payload."""
    spec = Payload(only=[text for _, text in paths])
    expected = reference(payload, [segments for segments, _ in paths], [])
    assert spec.digest(payload) == canonical_digest(expected if expected else {})


@given(payloads, path_lists, path_lists)
def test_the_dispatch_paths_digest_is_the_public_one(
    payload: dict[str, Any], only: list[Any], dropped: list[Any]
) -> None:
    """Dispatches hash decoded JSON without re-proving it is JSON; the key is the same."""
    decoded = json.loads(json.dumps(payload))
    for spec in (
        Payload(),
        Payload(only=[text for _, text in only]),
        Payload(exclude=[text for _, text in dropped]),
    ):
        assert spec.digest_decoded(decoded) == spec.digest(payload)


@given(payloads, path_lists)
def test_exclude_matches_the_reference(payload: dict[str, Any], paths: list[Any]) -> None:
    """``exclude`` hashes exactly the reference payload with the matched parts removed."""
    spec = Payload(exclude=[text for _, text in paths])
    expected = reference(payload, None, [segments for segments, _ in paths])
    assert spec.digest(payload) == canonical_digest(expected)


@given(payloads, path_lists, path_lists)
def test_only_and_exclude_match_the_reference(
    payload: dict[str, Any], only: list[Any], dropped: list[Any]
) -> None:
    """``only`` with ``exclude`` hashes the reference projection minus the excluded parts."""
    spec = Payload(only=[text for _, text in only], exclude=[text for _, text in dropped])
    expected = reference(
        payload, [segments for segments, _ in only], [segments for segments, _ in dropped]
    )
    assert spec.digest(payload) == canonical_digest(expected if expected else {})


@given(payloads, path_lists, st.randoms(use_true_random=False))
def test_path_order_is_irrelevant(payload: dict[str, Any], paths: list[Any], rng: Any) -> None:
    """The same ``only`` paths in another order derive the same digest and an equal spec."""
    texts = [text for _, text in paths]
    shuffled = list(texts)
    rng.shuffle(shuffled)
    assert Payload(only=texts).digest(payload) == Payload(only=shuffled).digest(payload)
    assert Payload(only=texts) == Payload(only=shuffled)


def test_missing_optional_field_hashes_like_an_absent_one() -> None:
    """A path to a field the payload lacks adds nothing: as if the path were never listed."""
    with_coupon_path = Payload(only=[".user_id", ".coupon", ".items[5]"])
    without = Payload(only=[".user_id"])
    payload = {"user_id": 7, "items": [1]}
    assert with_coupon_path.digest(payload) == without.digest(payload)
    assert with_coupon_path.digest(payload) == with_coupon_path.digest({**payload, "other": 1})


def test_present_null_is_not_missing() -> None:
    """A field present with null is a value, so it hashes unlike a missing field."""
    spec = Payload(only=[".user_id", ".coupon"])
    assert spec.digest({"user_id": 7, "coupon": None}) != spec.digest({"user_id": 7})


def test_exclude_ignores_the_excluded_field() -> None:
    """Payloads differing only in an excluded field share a key; other differences still count."""
    spec = Payload(exclude=[".requested_at"])
    first = {"user_id": 7, "requested_at": "2024-01-01T00:00:00"}
    assert spec.key(first, "t") == spec.key({**first, "requested_at": "2024-06-01"}, "t")
    assert spec.key(first, "t") == spec.key({"user_id": 7}, "t")
    assert spec.key(first, "t") != spec.key({**first, "user_id": 8}, "t")


def test_whole_payload_digest_is_the_canonical_digest() -> None:
    """``Payload()`` hashes the whole payload with the canonical encoding."""
    payload = {"b": [1, 2], "a": {"x": None}}
    assert Payload().digest(payload) == canonical_digest(payload)


@pytest.mark.parametrize(
    ("spec", "task_name", "pattern"),
    [
        (Payload(), "shop.send_email", r"shop\.send_email:[0-9a-f]{64}"),
        (Payload(), None, r"[0-9a-f]{64}"),
        (Payload(prefix=False), "shop.send_email", r"[0-9a-f]{64}"),
        (Payload(only=[".user_id"]), "t", r"t:[0-9a-f]{64}"),
    ],
)
def test_key_format(spec: Payload, task_name: str | None, pattern: str) -> None:
    """The key is "<task name>:<64 hex>" with a prefix and a task name, else the 64 hex digits."""
    key = spec.key({"user_id": 1}, task_name)
    assert re.fullmatch(pattern, key)
    assert key.endswith(spec.digest({"user_id": 1}))


def test_prefix_does_not_change_the_digest() -> None:
    """``prefix`` only decides whether the task name is put in front; the digest is the same."""
    payload = {"user_id": 1}
    assert Payload().digest(payload) == Payload(prefix=False).digest(payload)
    assert Payload().key(payload, "t") == "t:" + Payload(prefix=False).key(payload, "t")


def test_only_hashes_nothing_outside_the_selection() -> None:
    """Values outside the selected paths are never encoded, so they cannot fail or matter."""
    spec = Payload(only=[".user_id"])
    assert spec.digest({"user_id": 1, "blob": object()}) == spec.digest({"user_id": 1})


def test_non_json_in_the_selection_names_its_path() -> None:
    """A non-JSON value inside the selected part raises InvalidPayload naming its path."""
    with pytest.raises(InvalidPayload) as caught:
        Payload(only=[".user"]).digest({"user": {"tags": {"a"}}})
    assert caught.value.path == ".user.tags"


def test_payload_must_be_a_dict() -> None:
    """The payload is the arguments by name, so anything but a dict is a TypeError."""
    with pytest.raises(TypeError, match="got list"):
        Payload().digest([1, 2])  # type: ignore[arg-type]


def test_malformed_path_fails_at_construction() -> None:
    """A malformed path raises InvalidPath when the spec is built, naming the path."""
    with pytest.raises(InvalidPath, match=r"path 'user_id' must start with '\.'") as caught:
        Payload(only=[".ok", "user_id"])
    assert caught.value.path == "user_id"
    with pytest.raises(InvalidPath, match="unterminated string"):
        Payload(exclude=['."when'])


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"only": ".user_id"}, TypeError, r"write only=\['.user_id'\]"),
        ({"exclude": ".ts"}, TypeError, r"write exclude=\['.ts'\]"),
        ({"only": [".a", 1]}, TypeError, "paths are str, got 1"),
        ({"prefix": "yes"}, TypeError, "takes True or False"),
        ({"only": []}, InvalidDeclaration, r"only=\[\]\) selects nothing"),
    ],
)
def test_bad_arguments(arguments: dict[str, Any], error: type[Exception], message: str) -> None:
    """A bare string, a non-str path, a non-bool prefix or an empty ``only`` are refused clearly."""
    with pytest.raises(error, match=message):
        Payload(**arguments)


def test_attributes_keep_the_paths_as_written() -> None:
    """``only`` and ``exclude`` are the given strings as tuples; ``prefix`` is kept as given."""
    spec = Payload(only=[".b", '."a"'], exclude=(".b.c",), prefix=False)
    assert spec.only == (".b", '."a"')
    assert spec.exclude == (".b.c",)
    assert spec.prefix is False
    assert Payload().only is None
    assert Payload().exclude is None
    assert Payload().prefix is True


def test_spec_is_read_only() -> None:
    """A spec cannot be changed after it is built (it is hashable)."""
    spec = Payload()
    with pytest.raises(AttributeError):
        spec.prefix = False  # type: ignore[misc]


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (Payload(only=[".a", ".b"]), Payload(only=[".b", ".a"])),
        (Payload(only=[".a"]), Payload(only=['."a"', '.["a"]'])),
        (Payload(only=[".a", ".a.b", ".a[0]"]), Payload(only=[".a"])),
        (Payload(exclude=[".x[0]", ".x[0].y"]), Payload(exclude=[".x[0]"])),
        (Payload(), Payload(exclude=[])),
        (Payload(prefix=False), Payload(prefix=False)),
    ],
)
def test_specs_deriving_the_same_keys_are_equal(left: Payload, right: Payload) -> None:
    """Specs with the same paths in any order, spelling or redundancy are equal, hash alike."""
    assert left == right
    assert hash(left) == hash(right)


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (Payload(), Payload(prefix=False)),
        (Payload(only=[".a"]), Payload(exclude=[".a"])),
        (Payload(only=[".a"]), Payload()),
        (Payload(only=[".a[0]"]), Payload(only=[".a[-1]"])),
        (Payload(only=[".a[0]"]), Payload(only=['.a."0"'])),
        (Payload(only=[".a"]), Payload(only=[".a"], exclude=[".a.b"])),
    ],
)
def test_specs_deriving_other_keys_differ(left: Payload, right: Payload) -> None:
    """Specs that can derive different keys are not equal."""
    assert left != right


def test_spec_survives_pickle_and_deepcopy() -> None:
    """A spec copied by pickle or deepcopy (as signature options may be) stays equal."""
    spec = Payload(only=[".a[0]", ".b"], exclude=[".b.c"], prefix=False)
    payload = {"a": [1], "b": {"c": 1, "d": 2}}
    for copied in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec)):
        assert copied == spec
        assert copied.digest(payload) == spec.digest(payload)
        assert repr(copied) == repr(spec)


def test_spec_is_not_equal_to_other_types() -> None:
    """A spec compares unequal to things that are not specs, such as the string "payload"."""
    assert Payload() != "payload"


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (Payload(), "Payload()"),
        (Payload(only=[".user_id"]), "Payload(only=['.user_id'])"),
        (
            Payload(only=(".b", ".a"), exclude=[".a.ts"], prefix=False),
            "Payload(only=['.b', '.a'], exclude=['.a.ts'], prefix=False)",
        ),
    ],
)
def test_repr(spec: Payload, text: str) -> None:
    """The repr reads like the call that built the spec, paths as written."""
    assert repr(spec) == text


def test_a_listed_path_inside_another_is_dropped_however_long_the_paths() -> None:
    """``.a`` makes ``.a.b`` redundant, whatever their order or length; siblings stay.
    Paths thousands of segments long are checked in time linear in their length."""
    deep = "".join(f".s{n}" for n in range(5_000))
    payload = {"a": {"b": 1, "c": 2}, "d": [1, 2]}
    assert Payload(only=[".a.b", ".a", ".d[0]"]).digest(payload) == Payload(
        only=[".a", ".d[0]"]
    ).digest(payload)
    assert Payload(only=[deep, deep[: len(deep) // 2]]).digest(payload) == Payload(
        only=[deep[: len(deep) // 2]]
    ).digest(payload)
    assert Payload(only=[".a.b", ".a.c"]).digest(payload) != Payload(only=[".a.b"]).digest(payload)
