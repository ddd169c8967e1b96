"""Uniqueness options, parsed and checked once: when a task class is created.

A malformed declaration (unknown scope, bad window, a key that breaks the key
rules, a batching task) raises here, at import, not at the first dispatch.
The same parsers check options given per dispatch, before anything is written.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from celery_unique.config.booleans import parse_bool
from celery_unique.config.durations import parse_duration_ms, parse_window
from celery_unique.exceptions import (
    InvalidDeclaration,
    InvalidKey,
    InvalidWindow,
    KeySelectorFailed,
    UniquenessRequired,
    UnsupportedCombination,
)
from celery_unique.keys.arguments import ArgumentView, Binder
from celery_unique.keys.keyspace import validate_key
from celery_unique.keys.payload import Payload
from celery_unique.options.duplicates import DuplicatePolicy, parse_policy
from celery_unique.stores.base import Scope

#: The per-dispatch options, as accepted by ``apply_async`` and ``signature.set``.
DISPATCH_OPTIONS = (
    "unique_key",
    "unique_while",
    "unique_window_key",
    "unique_window",
    "unique_prefix",
    "unique_on_duplicate",
    "unique_debounce",
    "unique_debounce_max",
)

Selector = Callable[[ArgumentView], object]


@dataclass(frozen=True, slots=True)
class KeySpec:
    """Where a key comes from: exactly one of a literal, a selector or a payload spec."""

    literal: str | None = None
    selector: Selector | None = None
    payload: Payload | None = None

    @classmethod
    def parse(cls, value: object, option: str) -> KeySpec | None:
        if value is None:
            return None
        if isinstance(value, KeySpec):
            return value
        if isinstance(value, Payload):
            return cls(payload=value)
        if isinstance(value, str):
            if value == "payload":
                return cls(payload=Payload())
            return cls(literal=validate_key(value, what=option))
        if callable(value):
            return cls(selector=value)
        raise InvalidKey(
            f"{option} must be a str, a selector (callable) or Payload(...), "
            f"not {type(value).__name__}",
            value,
        )

    @property
    def unscoped(self) -> bool:
        """``Payload(prefix=False)`` shares the key across task types on its own."""
        return self.payload is not None and not self.payload.prefix

    def resolve(
        self, option: str, view: ArgumentView, payload: Callable[[], dict[str, Any]]
    ) -> str:
        """The key for one dispatch (without task scope), checked against the key rules."""
        if self.literal is not None:
            return self.literal
        if self.payload is not None:
            return self.payload.digest_decoded(payload())
        assert self.selector is not None
        try:
            key = self.selector(view)
        except Exception as exc:
            name = getattr(self.selector, "__qualname__", repr(self.selector))
            raise KeySelectorFailed(f"{option} selector {name} raised {exc!r}") from exc
        if key is None:
            raise UniquenessRequired(f"{option} selector returned None; the key is required")
        return validate_key(key, what=f"{option} (from selector)")

    def describe(self) -> str:
        if self.literal is not None:
            return repr(self.literal)
        if self.payload is not None:
            return repr(self.payload)
        return getattr(self.selector, "__qualname__", "selector")


def parse_scope(value: object) -> Scope:
    try:
        return Scope(value)
    except ValueError:
        names = ", ".join(repr(scope.value) for scope in Scope)
        raise InvalidDeclaration(f"unique_while must be one of {names}, not {value!r}") from None


def parse_prefix(value: object) -> bool:
    return parse_bool(value, "unique_prefix")


@dataclass(frozen=True, slots=True)
class Declaration:
    """A task class's uniqueness options, checked."""

    key: KeySpec | None = None
    scope: Scope = Scope.QUEUED
    #: ``None``: follow the app's ``result_expires``.
    retention_ms: int | None = None
    window_key: KeySpec | None = None
    window_ms: int | None = None
    prefix: bool = True
    overridable: bool = False
    binder: Binder | None = None
    duplicates: DuplicatePolicy = field(default_factory=DuplicatePolicy)

    @property
    def declares_keys(self) -> bool:
        return self.key is not None or self.window_key is not None

    @classmethod
    def from_class(cls, task_class: type) -> Declaration:
        options = {name: inspect.getattr_static(task_class, name) for name in _CLASS_OPTIONS}
        # A lambda given as a task option became a class attribute and would bind
        # as a method; keep it a plain function called with the view only.
        for name in ("unique_key", "unique_window_key"):
            if inspect.isfunction(options[name]):
                setattr(task_class, name, staticmethod(options[name]))
            elif isinstance(options[name], staticmethod):
                options[name] = options[name].__func__
        declaration = cls.parse(options)
        if declaration.declares_keys:
            _reject_batching(task_class)
        return replace(declaration, binder=_binder(task_class))

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> Declaration:
        key = KeySpec.parse(options.get("unique_key"), "unique_key")
        window_key = KeySpec.parse(options.get("unique_window_key"), "unique_window_key")
        raw_window = options.get("unique_window")
        window_ms = None if raw_window is None else parse_window(raw_window)
        if window_key is not None and window_ms is None:
            raise InvalidWindow("unique_window_key needs unique_window: a window has no default")
        scope = parse_scope(options.get("unique_while", Scope.QUEUED.value))
        duplicates = parse_policy(options)
        duplicates.check_keys(
            has_active_key=key is not None, has_window_key=window_key is not None, scope=scope
        )
        return cls(
            key=key,
            scope=scope,
            retention_ms=parse_duration_ms(options.get("unique_retention"), "unique_retention"),
            window_key=window_key,
            window_ms=window_ms,
            prefix=parse_prefix(options.get("unique_prefix", True)),
            overridable=parse_bool(options.get("unique_overridable", False), "unique_overridable"),
            duplicates=duplicates,
        )


def declared(task: object) -> Declaration | None:
    """The declaration of a unique task (a ``UniqueMixin`` subclass), or ``None`` for any
    other task: what the checks read, so that they need not import the task classes."""
    declaration = getattr(type(task), "__unique__", None)
    return declaration if isinstance(declaration, Declaration) else None


def _binder(task_class: type) -> Binder | None:
    run = inspect.getattr_static(task_class, "run", None)
    if isinstance(run, staticmethod):
        return Binder(run.__func__, drop_first=False)
    if inspect.isfunction(run):
        return Binder(run, drop_first=True)  # a method, or a bind=True task: drop `self`
    return None


_CLASS_OPTIONS = (
    "unique_key",
    "unique_while",
    "unique_retention",
    "unique_window_key",
    "unique_window",
    "unique_prefix",
    "unique_overridable",
    "unique_on_duplicate",
    "unique_debounce",
    "unique_debounce_max",
    "unique_latest_max_bytes",
)


def _reject_batching(task_class: type) -> None:
    # Only a class that really derives from Batches can be one, so there is
    # nothing to check (and nothing to import) when celery_batches is not loaded.
    batches_module = sys.modules.get("celery_batches")
    batches = getattr(batches_module, "Batches", None)
    if isinstance(batches, type) and issubclass(task_class, batches):
        raise UnsupportedCombination(
            f"{task_class.__name__} is both unique and a celery_batches.Batches task: "
            "batches run under an id that matches none of their members, so their keys "
            "could never be released. Deduplicate the producer side instead."
        )
