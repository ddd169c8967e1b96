"""``Payload(...)``: a key derived from the task's arguments, or from some paths of them.

The dispatch path builds the payload (arguments bound to parameter names,
round-tripped through the serializer's JSON) and calls :meth:`Payload.digest`;
:meth:`Payload.key` is the same computation with the task-name prefix added,
for computing a key by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_unique.exceptions import InvalidDeclaration
from celery_unique.keys.canonical import canonical_digest
from celery_unique.keys.paths import Path, Segment, Selection, parse_path


class Payload:
    """Hash the whole payload, only some paths of it, or all but some paths.

    ``only`` and ``exclude`` are lists of paths (see :mod:`celery_unique.keys.paths`),
    parsed here so that a malformed path fails when the task is defined. With
    both, the payload is projected onto ``only`` and then the ``exclude`` paths
    are removed from that projection. ``prefix=False`` leaves the task name out
    of the key, so tasks with the same payload share it.

    Two specs are equal when they derive the same keys: the same ``prefix`` and
    the same paths however ordered, spelled or repeated (``.a`` also stands for
    any longer path under it, like ``.a.b``).
    """

    __slots__ = ("_exclude", "_identity", "_only", "_prefix", "_selection")

    def __init__(
        self,
        only: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        *,
        prefix: bool = True,
    ) -> None:
        if not isinstance(prefix, bool):
            raise TypeError(f"Payload(prefix=...) takes True or False, got {prefix!r}")
        self._only = _texts("only", only)
        self._exclude = _texts("exclude", exclude)
        self._prefix = prefix
        if self._only == ():
            raise InvalidDeclaration(
                "Payload(only=[]) selects nothing, so every dispatch would share one key;"
                " list the paths to hash, or use a literal unique_key"
            )
        only_paths = None if self._only is None else [parse_path(text) for text in self._only]
        exclude_paths = [parse_path(text) for text in self._exclude or ()]
        self._selection = Selection(only_paths, exclude_paths)
        self._identity = (
            None if only_paths is None else _essential(only_paths),
            _essential(exclude_paths),
            prefix,
        )

    @property
    def only(self) -> tuple[str, ...] | None:
        """The ``only`` paths as written, or ``None`` for the whole payload."""
        return self._only

    @property
    def exclude(self) -> tuple[str, ...] | None:
        """The ``exclude`` paths as written, or ``None`` when none were given."""
        return self._exclude

    @property
    def prefix(self) -> bool:
        """Whether :meth:`key` puts the task name in front of the digest."""
        return self._prefix

    def digest(self, payload: dict[str, Any]) -> str:
        """SHA-256 (64 lowercase hex digits) of the selected part of ``payload``.

        ``payload`` is JSON data (what ``json.loads`` returns); anything else in
        the selected part raises :class:`~celery_unique.exceptions.InvalidPayload`.
        """
        if not isinstance(payload, dict):
            raise TypeError(
                "the payload is a dict of the task's arguments by parameter name,"
                f" got {type(payload).__name__}"
            )
        return canonical_digest(self._selection.apply(payload))

    def digest_decoded(self, payload: dict[str, Any]) -> str:
        """:meth:`digest` of a payload straight out of ``json.loads`` (the dispatch path's).

        Such a payload is plain JSON data by construction, so the proof that it
        is can be skipped; the digest is the same.
        """
        return canonical_digest(self._selection.apply(payload), checked=False)

    def key(self, payload: dict[str, Any], task_name: str | None = None) -> str:
        """The key for ``payload``: ``"<task_name>:<digest>"``, or the digest alone.

        The digest alone when ``prefix`` is false or no ``task_name`` is given.
        """
        digest = self.digest(payload)
        if self._prefix and task_name is not None:
            return f"{task_name}:{digest}"
        return digest

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Payload):
            return NotImplemented
        return self._identity == other._identity

    def __hash__(self) -> int:
        return hash(self._identity)

    def __repr__(self) -> str:
        arguments = []
        if self._only is not None:
            arguments.append(f"only={list(self._only)!r}")
        if self._exclude is not None:
            arguments.append(f"exclude={list(self._exclude)!r}")
        if not self._prefix:
            arguments.append("prefix=False")
        return f"Payload({', '.join(arguments)})"


def _texts(option: str, paths: Sequence[str] | None) -> tuple[str, ...] | None:
    # A bare str is a sequence of one-character "paths": refuse it rather than guess.
    if paths is None:
        return None
    if isinstance(paths, str):
        raise TypeError(f"Payload({option}=...) takes a list of paths: write {option}=[{paths!r}]")
    texts = tuple(paths)
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"Payload({option}=...) paths are str, got {text!r}")
    return texts


def _essential(paths: Sequence[Path]) -> frozenset[tuple[Segment, ...]]:
    """The paths that no other listed path contains (``.a`` makes ``.a.b`` redundant)."""
    # A trie walk, linear in the paths' total length (comparing each path's
    # prefixes as tuples would be quadratic in a path's length).
    listed = {path.segments for path in paths}
    trie: dict[Any, Any] = {}
    for segments in listed:
        node = trie
        for segment in segments:
            node = node.setdefault(segment, {})
        node[_END] = True
    essential = []
    for segments in listed:
        node = trie
        for segment in segments[:-1]:
            node = node[segment]
            if _END in node:
                break
        else:
            essential.append(segments)
    return frozenset(essential)


#: Marks, in :func:`_essential`'s trie, a node where a listed path ends.
_END = object()
