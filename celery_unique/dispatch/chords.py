"""A chord whose body could be deduplicated is refused before any part of it is sent.

Celery sends a chord's body from the worker that stores the header's last
result, under the id the chord froze for it, which is the id the caller waits
on. A unique body whose key another job holds then would be reused: nothing is
published under that id, and the chord's result stays ``PENDING`` for good.
Whether the key will be held at that moment cannot be known when the chord is
dispatched, so a body that can be deduplicated (a ``UniqueTask`` that declares a
key, or a signature given uniqueness options) is refused then, with
``unsupported_combination``: at the first message the chord sends, a header
member (it carries the body) or Celery's ``chord_unlock`` (the body is its
argument), before the broker has any of it. A chain that goes on to such a
chord is refused as its first step is sent.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery_unique.exceptions import UnsupportedCombination
from celery_unique.options.declaration import DISPATCH_OPTIONS

if TYPE_CHECKING:
    from celery import Celery

#: Celery's task that polls the header when the result backend cannot count it.
CHORD_UNLOCK = "celery.chord_unlock"


def refuse_unique_body(app: Celery, name: str, args: Any, options: Mapping[str, Any]) -> None:
    """Raise ``unsupported_combination`` if the message ``name`` would start a chord
    whose body could be deduplicated, now or as a later step of its chain."""
    for body in _bodies(name, args, options):
        for signature in _tasks_in(body):
            task: str = signature["task"]
            if _deduplicates(app, task, signature.get("options") or {}):
                raise UnsupportedCombination(
                    f"{task} is unique and the body of a chord: if a job held its key when "
                    "the header finished, the body would be reused instead of sent under "
                    "the chord's id, and the chord would never finish. Make the body a "
                    "plain task that dispatches the unique one, or deduplicate the chord "
                    "as a whole"
                )


def _bodies(name: str, args: Any, options: Mapping[str, Any]) -> Iterator[Any]:
    """The chord bodies a message carries: its own chord's (a header member), the one
    ``chord_unlock`` waits to send, and those of the chords its chain goes on to."""
    if options.get("chord"):
        yield options["chord"]
    if name == CHORD_UNLOCK and isinstance(args, Sequence) and len(args) > 1:
        yield args[1]
    for step in options.get("chain") or ():
        if isinstance(step, Mapping) and step.get("subtask_type") == "chord":
            yield (step.get("kwargs") or {}).get("body")


def _tasks_in(signature: Any) -> Iterator[Mapping[str, Any]]:
    """Every task signature in a canvas (chain steps, group members, nested chords)."""
    if not isinstance(signature, Mapping):
        return
    kind, kwargs = signature.get("subtask_type"), signature.get("kwargs") or {}
    if kind in ("chain", "group"):
        for task in kwargs.get("tasks") or ():
            yield from _tasks_in(task)
    elif kind == "chord":
        yield from _tasks_in(kwargs.get("header"))
        yield from _tasks_in(kwargs.get("body"))
    elif isinstance(signature.get("task"), str):
        yield signature


def _deduplicates(app: Celery, name: str, options: Mapping[str, Any]) -> bool:
    if any(option in options for option in DISPATCH_OPTIONS):
        return True
    declaration = getattr(app.tasks.get(name), "__unique__", None)
    return bool(declaration is not None and declaration.declares_keys)
