"""The path grammar, its error messages, and projecting/excluding payload parts by path."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_unique.exceptions import InvalidDeclaration, InvalidPath
from celery_unique.keys.paths import Path, Selection, exclude, parse_path, project, render_path


@pytest.mark.parametrize(
    ("text", "segments"),
    [
        (".a", ("a",)),
        (".a.b", ("a", "b")),
        (".a[0]", ("a", 0)),
        (".a[-1]", ("a", -1)),
        (".a[12][-30]", ("a", 12, -30)),
        ('."a b"', ("a b",)),
        ('.["a b"]', ("a b",)),
        (".[0]", (0,)),
        (".a.[1]", ("a", 1)),
        ('.a["b"]', ("a", "b")),
        ('.a[0].b."c d"[-1]', ("a", 0, "b", "c d", -1)),
        ("._private_2.B_9", ("_private_2", "B_9")),
        ('.""', ("",)),
        ('."0"', ("0",)),
        ('.["[1]"]', ("[1]",)),
    ],
)
def test_parse_forms(text: str, segments: tuple[object, ...]) -> None:
    """Every form of the grammar, alone and chained, parses to its segments."""
    path = parse_path(text)
    assert path.segments == segments
    assert tuple(path) == segments
    assert len(path) == len(segments)
    assert path.text == text


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (r'."a\"b"', 'a"b'),
        (r'."back\\slash"', "back\\slash"),
        (r'."line\nbreak\ttab"', "line\nbreak\ttab"),
        (r'.["\u00e9t\u00e9"]', "été"),
        (r'."\ud83d\ude00"', "\U0001f600"),
        (r'."\/"', "/"),
        ('."été ☃"', "été ☃"),
        ('."a]b"', "a]b"),
    ],
)
def test_string_escapes_follow_json(text: str, key: str) -> None:
    """Quoted keys are JSON string literals: every JSON escape decodes as JSON does."""
    assert parse_path(text).segments == (key,)


def test_spellings_of_one_key_are_equal_paths() -> None:
    """``.a``, ``."a"`` and ``.["a"]`` are the same path, hash alike, and keep their own text."""
    spellings = [parse_path(text) for text in (".a[0]", '."a"[0]', '.["a"].[0]')]
    assert len(set(spellings)) == 1
    assert [path.text for path in spellings] == [".a[0]", '."a"[0]', '.["a"].[0]']


def test_index_and_quoted_digits_differ() -> None:
    """``.a[0]`` indexes a list while ``.a."0"`` names an object member: different paths."""
    assert parse_path(".a[0]") != parse_path('.a."0"')


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a.b", "path 'a.b' must start with '.'"),
        ("", "path '' is empty"),
        (" .a", "path ' .a' must start with '.'"),
        (".", "path '.' is the whole payload"),
        ('."ab', "unterminated string starting at offset 1 in path '.\"ab'"),
        ('.a["b]', "unterminated string starting at offset 3 in path '.a[\"b]'"),
        ('."ab\\"', "unterminated string starting at offset 1"),
        ('."ab\\', "unterminated string starting at offset 1"),
        (".a[0", "expected ']' at offset 4 in path '.a[0': to close the '[' at offset 2"),
        ('.a["b"', "expected ']' at offset 6"),
        ('.a["b"x]', "expected ']' at offset 6"),
        (".a[]", "expected an index or a string at offset 3 in path '.a[]'"),
        (".a[x]", "bad index 'x' at offset 3 in path '.a[x]'"),
        (".a[1.5]", "bad index '1.5' at offset 3"),
        (".a[01]", "bad index '01' at offset 3"),
        (".a[+1]", "bad index '+1' at offset 3"),
        (".a[ 0]", "bad index ' 0' at offset 3"),
        (".a b", "unexpected ' ' at offset 2 in path '.a b'"),
        (".a-b", "unexpected '-' at offset 2"),
        (".a[0]x", "unexpected 'x' at offset 5"),
        ('."a"b', "unexpected 'b' at offset 4"),
        (".a..b", "expected a key or '[' at offset 3 in path '.a..b': found '.'"),
        (".a.", "expected a key or '[' at offset 3 in path '.a.': found the end of the path"),
        ("..a", "expected a key or '[' at offset 1"),
        (".1a", "found '1'; quote keys that are not identifiers"),
        (".é", "found 'é'; quote keys that are not identifiers"),
        ('."a\\qb"', "invalid \\escape in string at offset 3"),
        ('.a["a\\qb"]', "invalid \\escape in string at offset 5"),
        ('."a\tb"', "invalid control character in string at offset 3"),
    ],
)
def test_malformed_paths_say_what_and_where(text: str, message: str) -> None:
    """A malformed path raises InvalidPath naming the path, the problem and the offset."""
    with pytest.raises(InvalidPath) as caught:
        parse_path(text)
    assert message in str(caught.value)
    assert caught.value.path == text
    assert caught.value.code == "invalid_path"
    assert isinstance(caught.value, InvalidDeclaration)
    assert isinstance(caught.value, ValueError)


def test_a_long_path_is_read_to_its_end() -> None:
    """Offsets past 256 (ints CPython keeps no single object for) end a path as short ones do."""
    key = "k" * 300
    assert parse_path(f".{key}").segments == (key,)
    with pytest.raises(InvalidPath, match=r"at offset 302 .*: found the end of the path"):
        parse_path(f".{key}.")
    with pytest.raises(InvalidPath, match="expected ']' at offset 304"):
        parse_path(f'.{key}[""')


def test_a_quoted_key_keeps_its_characters_in_the_text() -> None:
    """Only what JSON must escape is escaped: a key outside ASCII reads as it was written."""
    assert render_path(["prénom", "日本"]) == '."prénom"."日本"'
    assert Path(("é x",)).text == '."é x"'


def test_non_str_path_is_a_type_error() -> None:
    """A path that is not a str at all is a TypeError, not a grammar error."""
    with pytest.raises(TypeError, match="a path is a str"):
        parse_path(["a"])  # type: ignore[arg-type]


def test_path_rejects_no_segments_and_bool_segments() -> None:
    """A Path built by hand needs segments, each a str key or an int index (never a bool)."""
    with pytest.raises(ValueError, match="at least one segment"):
        Path(())
    with pytest.raises(TypeError, match="str or int"):
        Path(("a", True))


def test_path_built_by_hand_gets_its_text() -> None:
    """A Path built from segments renders its own text, quoting keys that are not identifiers."""
    path = Path(("user", 0, "first name", -1))
    assert path.text == '.user[0]."first name"[-1]'
    assert str(path) == path.text
    assert repr(path) == "Path('.user[0].\"first name\"[-1]')"


keys = st.text(max_size=6)
segment_lists = st.lists(st.one_of(keys, st.integers(-(10**20), 10**20)), min_size=1, max_size=6)


@given(segment_lists)
def test_render_then_parse_round_trips(segments: list[str | int]) -> None:
    """Any segments rendered as text parse back to the same segments."""
    assert parse_path(render_path(segments)).segments == tuple(segments)


@given(st.text(max_size=12))
def test_parser_never_fails_another_way(text: str) -> None:
    """Arbitrary text either parses or raises InvalidPath; nothing else escapes the parser."""
    try:
        path = parse_path(text)
    except InvalidPath as error:
        message = str(error)
    else:
        message = repr(text)
        assert parse_path(render_path(path.segments)) == path
    assert repr(text) in message


# --- projection -------------------------------------------------------------

ORDER: dict[str, Any] = {
    "user": {"id": 42, "name": "Ada", "email": None},
    "items": [{"sku": "A", "qty": 1}, {"sku": "B", "qty": 2}, {"sku": "C", "qty": 3}],
    "meta": {"requested at": "2024-01-01", "tags": []},
    "flag": False,
}


@pytest.mark.parametrize(
    ("paths", "expected"),
    [
        ([".user.id"], {"user": {"id": 42}}),
        ([".user.email"], {"user": {"email": None}}),
        ([".user.id", ".flag"], {"user": {"id": 42}, "flag": False}),
        ([".items[0]"], {"items": [[0, {"sku": "A", "qty": 1}]]}),
        ([".items[-1].sku"], {"items": [[-1, {"sku": "C"}]]}),
        ([".items[2].sku", ".items[0].qty"], {"items": [[0, {"qty": 1}], [2, {"sku": "C"}]]}),
        ([".items[0].sku", ".items[0].qty"], {"items": [[0, {"sku": "A", "qty": 1}]]}),
        ([".items[0]", ".items[-3]"], {"items": [[-3, ORDER["items"][0]], [0, ORDER["items"][0]]]}),
        (['.meta."requested at"'], {"meta": {"requested at": "2024-01-01"}}),
        ([".meta.tags"], {"meta": {"tags": []}}),
        ([".user", ".user.id"], {"user": ORDER["user"]}),
        ([".user.id", ".user"], {"user": ORDER["user"]}),
    ],
)
def test_project_keeps_matched_structure(paths: list[str], expected: dict[str, Any]) -> None:
    """Projection keeps matched object members by name and list elements as [index, value] pairs."""
    assert project(ORDER, paths) == expected


@pytest.mark.parametrize(
    "paths",
    [
        [".missing"],
        [".user.missing"],
        [".items[3]"],
        [".items[-4]"],
        [".user[0]"],
        [".items.sku"],
        [".flag.x"],
        [".flag[0]"],
        [".meta.tags[0]"],
        [".user.name.first"],
    ],
)
def test_project_skips_paths_that_match_nothing(paths: list[str]) -> None:
    """A missing key, an out-of-range index, or a step into the wrong kind of value is skipped."""
    assert project(ORDER, paths) == {}
    assert project(ORDER, [*paths, ".flag"]) == {"flag": False}


def test_project_is_independent_of_path_order() -> None:
    """Listing the same paths in another order projects exactly the same value."""
    paths = [".items[2].sku", ".user.id", ".items[-3].qty", ".meta.tags"]
    assert project(ORDER, paths) == project(ORDER, list(reversed(paths)))
    assert json.dumps(project(ORDER, paths)["items"]) == json.dumps(
        project(ORDER, list(reversed(paths)))["items"]
    )


def test_project_tells_indexes_apart() -> None:
    """Equal elements picked by different indexes project differently."""
    payload = {"a": [5, 5]}
    assert project(payload, [".a[0]"]) != project(payload, [".a[1]"])


def test_negative_index_means_last_whatever_the_length() -> None:
    """``.a[-1]`` projects the last element alike in lists of different lengths."""
    assert project({"a": [1, 7]}, [".a[-1]"]) == project({"a": [7]}, [".a[-1]"])


def test_project_of_a_list_root() -> None:
    """Indexes apply at the top level too, when the value projected is itself a list."""
    assert project([10, 20, 30], [".[1]", ".[-1]"]) == [[-1, 30], [1, 20]]


def test_project_accepts_parsed_paths() -> None:
    """Parsed Path objects and path strings can be mixed in one call."""
    assert project(ORDER, [parse_path(".flag"), ".user.id"]) == {"flag": False, "user": {"id": 42}}


def test_project_refuses_a_bare_string() -> None:
    """One path string instead of a list is a TypeError, not a projection onto characters."""
    with pytest.raises(TypeError, match=r"write \['.user'\]"):
        project(ORDER, ".user")


def test_project_reports_malformed_paths() -> None:
    """A malformed path given to project raises InvalidPath."""
    with pytest.raises(InvalidPath):
        project(ORDER, ["user"])


# --- exclusion --------------------------------------------------------------


@pytest.mark.parametrize(
    ("paths", "expected"),
    [
        ([".flag"], {k: v for k, v in ORDER.items() if k != "flag"}),
        ([".user.email", ".user.name"], {**ORDER, "user": {"id": 42}}),
        ([".items[0]"], {**ORDER, "items": ORDER["items"][1:]}),
        ([".items[0]", ".items[-1]"], {**ORDER, "items": [ORDER["items"][1]]}),
        ([".items[-1]", ".items[2]"], {**ORDER, "items": ORDER["items"][:2]}),
        (
            [".items[1].qty"],
            {**ORDER, "items": [ORDER["items"][0], {"sku": "B"}, ORDER["items"][2]]},
        ),
        (['.meta."requested at"'], {**ORDER, "meta": {"tags": []}}),
        ([".user", ".user.id"], {k: v for k, v in ORDER.items() if k != "user"}),
        ([".missing", ".items[9]", ".flag.x", ".user[0]"], ORDER),
    ],
)
def test_exclude_removes_matched_parts(paths: list[str], expected: dict[str, Any]) -> None:
    """Exclusion removes matched members and elements (indexes resolved first), skips the rest."""
    assert exclude(ORDER, paths) == expected


def test_exclude_merges_indexes_that_reach_one_element() -> None:
    """``[0]`` and ``[-1]`` of a one-element list both apply to that element."""
    payload = {"a": [{"x": 1, "y": 2, "z": 3}]}
    assert exclude(payload, [".a[0].x", ".a[-1].y"]) == {"a": [{"z": 3}]}
    only = Selection([parse_path(".a[0]")], [parse_path(".a[0].x"), parse_path(".a[-1].y")])
    assert only.apply(payload) == {"a": [[0, {"z": 3}]]}


def test_exclude_of_a_whole_element_wins_over_a_part_of_it_by_another_index() -> None:
    payload = {"a": [{"x": 1, "y": 2}]}
    assert exclude(payload, [".a[0]", ".a[-1].x"]) == {"a": []}
    assert exclude(payload, [".a[-1].x", ".a[0]"]) == {"a": []}


def test_exclude_merges_the_indexes_under_indexes_that_reach_one_element() -> None:
    """The same for what lies under them: ``[0][0]`` and ``[-1][1]`` of a one-element list
    remove two elements of that element."""
    payload = {"a": [[1, 2, 3]]}
    assert exclude(payload, [".a[0][0]", ".a[-1][1]"]) == {"a": [[3]]}
    assert exclude(payload, [".a[-1][1]", ".a[0][0]"]) == {"a": [[3]]}


def test_project_and_exclude_never_mutate_the_payload() -> None:
    """The payload given is left exactly as it was."""
    payload = copy.deepcopy(ORDER)
    project(payload, [".items[0].sku", ".user"])
    exclude(payload, [".items[0].sku", ".items[1]", ".user.id"])
    Selection([parse_path(".items")], [parse_path(".items[0].qty")]).apply(payload)
    assert payload == ORDER


@pytest.mark.parametrize(
    ("only", "drop", "expected"),
    [
        ([".user"], [".user.email"], {"user": {"id": 42, "name": "Ada"}}),
        ([".items"], [".items[0]"], {"items": ORDER["items"][1:]}),
        ([".items[1]"], [".items[0]"], {"items": [[1, ORDER["items"][1]]]}),
        ([".items[-1]"], [".items[2].qty"], {"items": [[-1, {"sku": "C"}]]}),
        ([".items[0].sku"], [".items[-3]"], {}),
        ([".user.id"], [".user"], {}),
        ([".user.id", ".flag"], [".user"], {"flag": False}),
    ],
)
def test_selection_projects_then_removes(
    only: list[str], drop: list[str], expected: dict[str, Any]
) -> None:
    """With both, the excluded parts (addressed in the payload) are removed from the projection."""
    selection = Selection([parse_path(p) for p in only], [parse_path(p) for p in drop])
    assert selection.apply(ORDER) == expected


def test_selection_without_paths_is_the_payload_itself() -> None:
    """No ``only`` and no ``exclude`` returns the very payload, with no copy made."""
    assert Selection().is_identity
    assert Selection().apply(ORDER) is ORDER
    assert not Selection(exclude=[parse_path(".a")]).is_identity
