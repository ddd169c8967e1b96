"""Payload paths: a small jq-flavoured grammar, and selecting parts of a payload by path.

Grammar (EBNF; no whitespace anywhere outside string literals)::

    path       = "." , ( key | subscript ) , { step } ;
    step       = "." , ( key | subscript ) | subscript ;
    key        = identifier | string ;
    subscript  = "[" , ( index | string ) , "]" ;
    identifier = ( letter | "_" ) , { letter | digit | "_" } ;   (* ASCII only *)
    index      = [ "-" ] , ( "0" | nonzero digit , { digit } ) ;
    string     = a JSON string literal (RFC 8259), escapes included ;

So ``.a``, ``.a.b``, ``.a[0]``, ``.a[-1]``, ``."a b"``, ``.["a b"]`` and chains
such as ``.a[0].b."c d"[-1]`` are paths. A key names a member of an object, an
index an element of a list (negative indexes count from the end: ``-1`` is the
last element). The lone ``.`` is not a path: to use the whole payload, give no
paths at all.

Selecting never fails on the payload's shape: a path that matches nothing (a
missing key, an index out of range, an index into something that is not a
list, a key into something that is not an object) is skipped.

*Projection* (``project``) keeps only what the paths match, in its structure:

* an object keeps only the matched members, each projected further;
* a list reached through indexes becomes a list of ``[index, value]`` pairs,
  one per index written in the paths that matched an element, sorted by that
  index as written (``-1`` before ``0``); ``value`` is that element projected
  further. So the order in which paths are listed never matters, ``.a[0]`` and
  ``.a[1]`` never project alike, and ``.a[-1]`` means "the last element"
  whatever the list's length;
* a container in which nothing matched is left out; when nothing matches at
  all the projection is ``{}``;
* a path that is a prefix of another wins: ``.a`` with ``.a.b`` keeps all of ``a``.

*Exclusion* (``exclude``) returns the payload without what the paths match:
members are removed from objects, elements from lists (indexes are resolved
against the original list, then all matched elements are removed at once).
Projecting and excluding together (``Selection(only, exclude)``) resolves both
against the original payload: the projection, with the excluded parts removed.
"""

from __future__ import annotations

import enum
import json
import re
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_unique.exceptions import InvalidPath

#: A key of an object (``str``) or an index into a list (``int``).
Segment = str | int

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INDEX = re.compile(r"-?(?:0|[1-9][0-9]*)")
_IDENTIFIER_START = frozenset(string.ascii_letters + "_")


@dataclass(frozen=True)
class Path:
    """A parsed path: its segments, and the text it was written as (for messages).

    Two paths are equal when their segments are, however they were spelled
    (``.a`` == ``."a"`` == ``.["a"]``).
    """

    segments: tuple[Segment, ...]
    text: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a path has at least one segment")
        for segment in self.segments:
            # bool is an int subclass, but True is not an index anyone meant.
            if type(segment) not in (str, int):
                raise TypeError(f"path segments are str or int, got {segment!r}")
        if not self.text:
            object.__setattr__(self, "text", render_path(self.segments))

    def __iter__(self) -> Iterator[Segment]:
        return iter(self.segments)

    def __len__(self) -> int:
        return len(self.segments)

    def __getitem__(self, position: int) -> Segment:
        return self.segments[position]

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Path({self.text!r})"


def parse_path(text: str) -> Path:
    """Parse ``text`` by the grammar above; raise :class:`InvalidPath` saying what and where."""
    if not isinstance(text, str):
        raise TypeError(f"a path is a str, got {type(text).__name__}: {text!r}")
    return Path(_Parser(text).parse(), text)


def render_path(segments: Sequence[Segment]) -> str:
    """Write ``segments`` as path text that parses back to them; ``.`` for no segments."""
    if not segments:
        return "."
    parts: list[str] = []
    for segment in segments:
        if isinstance(segment, int):
            parts.append(f"[{segment}]" if parts else f".[{segment}]")
        elif _IDENTIFIER.fullmatch(segment):
            parts.append(f".{segment}")
        else:
            parts.append("." + json.dumps(segment, ensure_ascii=False))
    return "".join(parts)


class _Parser:
    """Recursive descent over one path's text; ``pos`` is the offset being read."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def parse(self) -> tuple[Segment, ...]:
        if not self.text:
            raise InvalidPath("path '' is empty; a path starts with '.', like '.user_id'", "")
        if self.text == ".":
            raise InvalidPath(
                "path '.' is the whole payload, which is what Payload() hashes"
                " without paths; a path names a part, like '.user_id'",
                self.text,
            )
        if self.text[0] != ".":
            raise InvalidPath(f"path {self.text!r} must start with '.'", self.text)
        segments: list[Segment] = []
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == ".":
                self.pos += 1
                segments.append(self.after_dot())
            elif char == "[":
                segments.append(self.subscript())
            else:
                raise self.error(f"unexpected {char!r}", self.pos, "expected '.' or '['")
        return tuple(segments)

    def after_dot(self) -> Segment:
        char = self.peek()
        if char in _IDENTIFIER_START:
            return self.identifier()
        if char == '"':
            return self.string()
        if char == "[":
            return self.subscript()
        found = "the end of the path" if char == "" else repr(char)
        hint = '; quote keys that are not identifiers, like ."2fa"' if char.isalnum() else ""
        raise self.error("expected a key or '['", self.pos, f"found {found}{hint}")

    def identifier(self) -> str:
        match = _IDENTIFIER.match(self.text, self.pos)
        assert match is not None  # after_dot saw a valid first character
        self.pos = match.end()
        return match.group()

    def string(self) -> str:
        start = self.pos
        end = start + 1
        # Find the closing quote ourselves, so the error can say "unterminated";
        # decoding the escapes is then exactly JSON's job.
        while end < len(self.text) and self.text[end] != '"':
            end += 2 if self.text[end] == "\\" else 1
        if end >= len(self.text):
            raise self.error("unterminated string starting", start)
        try:
            value = json.loads(self.text[start : end + 1])
        except json.JSONDecodeError as error:
            problem = error.msg.lower().removesuffix(" at")
            raise self.error(f"{problem} in string", start + error.pos) from error
        assert isinstance(value, str)
        self.pos = end + 1
        return value

    def subscript(self) -> Segment:
        opening = self.pos
        self.pos += 1
        segment: Segment = self.string() if self.peek() == '"' else self.index()
        if self.peek() != "]":
            raise self.error("expected ']'", self.pos, f"to close the '[' at offset {opening}")
        self.pos += 1
        return segment

    def index(self) -> int:
        closing = self.text.find("]", self.pos)
        token = self.text[self.pos : closing if closing != -1 else len(self.text)]
        if not token:
            raise self.error("expected an index or a string", self.pos)
        if not _INDEX.fullmatch(token):
            raise self.error(
                f"bad index {token!r}",
                self.pos,
                "an index is an integer without leading zeros, like 0 or -1",
            )
        self.pos += len(token)
        return int(token)

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def error(self, problem: str, offset: int, hint: str = "") -> InvalidPath:
        message = f"{problem} at offset {offset} in path {self.text!r}"
        return InvalidPath(f"{message}: {hint}" if hint else message, self.text)


# --- selecting ---------------------------------------------------------------


class _Missing(enum.Enum):
    """Marks "nothing matched here", which is not the same as a null value."""

    MISSING = enum.auto()


_MISSING = _Missing.MISSING


class _Trie:
    """Paths merged by their common prefixes; ``terminal`` means "this whole value"."""

    __slots__ = ("indexes", "keys", "terminal")

    def __init__(self, terminal: bool = False) -> None:
        self.terminal = terminal
        self.keys: dict[str, _Trie] = {}
        self.indexes: dict[int, _Trie] = {}


def _build(paths: Sequence[Path]) -> _Trie:
    root = _Trie()
    for path in paths:
        node = root
        for segment in path:
            if node.terminal:
                break  # a shorter path already takes this whole value
            if isinstance(segment, int):
                node = node.indexes.setdefault(segment, _Trie())
            else:
                node = node.keys.setdefault(segment, _Trie())
        else:
            node.terminal = True  # any children it has are never looked at again
    return root


def _merge(first: _Trie, second: _Trie) -> _Trie:
    if first.terminal or second.terminal:
        return _Trie(terminal=True)
    merged = _Trie()
    for source in (first, second):
        for key, child in source.keys.items():
            known = merged.keys.get(key)
            merged.keys[key] = child if known is None else _merge(known, child)
        for index, child in source.indexes.items():
            known = merged.indexes.get(index)
            merged.indexes[index] = child if known is None else _merge(known, child)
    return merged


def _resolve(index: int, length: int) -> int | None:
    position = index + length if index < 0 else index
    return position if 0 <= position < length else None


def _by_position(indexes: dict[int, _Trie], length: int) -> dict[int, _Trie]:
    """Group index subtries by the element they reach (``0`` and ``-1`` may be the same one)."""
    grouped: dict[int, _Trie] = {}
    for index, child in indexes.items():
        position = _resolve(index, length)
        if position is not None:
            known = grouped.get(position)
            grouped[position] = child if known is None else _merge(known, child)
    return grouped


def _remove(value: Any, drop: _Trie) -> Any:
    # Copies only the containers on the way to a removed part; the rest is shared.
    if isinstance(value, dict) and drop.keys:
        kept = dict(value)
        for key, child in drop.keys.items():
            if key in kept:
                if child.terminal:
                    del kept[key]
                else:
                    kept[key] = _remove(kept[key], child)
        return kept
    if isinstance(value, list) and drop.indexes:
        grouped = _by_position(drop.indexes, len(value))
        if not grouped:
            return value
        kept_items = list(value)
        # From the end, so removing an element does not shift the ones still to visit.
        for position in sorted(grouped, reverse=True):
            child = grouped[position]
            if child.terminal:
                del kept_items[position]
            else:
                kept_items[position] = _remove(kept_items[position], child)
        return kept_items
    return value


def _select(value: Any, keep: _Trie, drop: _Trie | None) -> Any:
    if drop is not None and drop.terminal:
        return _MISSING
    if keep.terminal:
        return value if drop is None else _remove(value, drop)
    if isinstance(value, dict) and keep.keys:
        picked = {}
        for key, child in keep.keys.items():
            if key in value:
                inner = _select(value[key], child, None if drop is None else drop.keys.get(key))
                if inner is not _MISSING:
                    picked[key] = inner
        return picked or _MISSING
    if isinstance(value, list) and keep.indexes:
        length = len(value)
        dropped = {} if drop is None else _by_position(drop.indexes, length)
        pairs = []
        for index in sorted(keep.indexes):
            position = _resolve(index, length)
            if position is not None:
                inner = _select(value[position], keep.indexes[index], dropped.get(position))
                if inner is not _MISSING:
                    pairs.append([index, inner])
        return pairs or _MISSING
    return _MISSING


class Selection:
    """Project onto ``only`` (``None``: everything), then remove ``exclude``.

    Built once (say, when a task is defined) and applied to many payloads.
    Never mutates the payload; unchanged parts of it are shared with the result.
    """

    __slots__ = ("_drop", "_keep")

    def __init__(
        self, only: Sequence[Path] | None = None, exclude: Sequence[Path] | None = None
    ) -> None:
        self._keep = _Trie(terminal=True) if only is None else _build(only)
        self._drop = _build(exclude) if exclude else None

    @property
    def is_identity(self) -> bool:
        """True when applying the selection returns the payload itself."""
        return self._keep.terminal and self._drop is None

    def apply(self, payload: Any) -> Any:
        """The selected part of ``payload`` (``{}`` when nothing matched)."""
        if self.is_identity:
            return payload
        selected = _select(payload, self._keep, self._drop)
        return {} if selected is _MISSING else selected


def project(payload: Any, paths: Sequence[Path | str]) -> Any:
    """``payload`` projected onto ``paths``, keeping structure (see the module docs)."""
    return Selection(only=_parsed(paths)).apply(payload)


def exclude(payload: Any, paths: Sequence[Path | str]) -> Any:
    """``payload`` without the parts ``paths`` match; paths matching nothing are skipped."""
    return Selection(exclude=_parsed(paths)).apply(payload)


def _parsed(paths: Sequence[Path | str]) -> list[Path]:
    if isinstance(paths, str):
        raise TypeError(f"paths is a list of paths, not one str: write [{paths!r}]")
    return [path if isinstance(path, Path) else parse_path(path) for path in paths]
