"""Task arguments bound to parameter names: the selector's view and the payload.

``send(42)`` and ``send(user_id=42)`` are one payload. The binder is built
once per task class, so a dispatch pays for one ``Signature.bind`` and no
introspection.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from kombu.exceptions import EncodeError
from kombu.utils.json import dumps as kombu_dumps

from celery_unique.exceptions import InvalidPayload


class Binder:
    """Binds ``(args, kwargs)`` to a function's parameters, defaults applied."""

    def __init__(self, function: Callable[..., Any], *, drop_first: bool) -> None:
        signature = inspect.signature(function)
        parameters = list(signature.parameters.values())
        if drop_first and parameters:
            parameters = parameters[1:]  # `self` of a bound task is not part of the payload
        self.signature = signature.replace(parameters=parameters)
        self._var_positional = next(
            (p.name for p in parameters if p.kind is p.VAR_POSITIONAL), None
        )
        self._var_keyword = next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)
        # Plain "name" / "name=default" parameters (the usual task) bind without
        # inspect, which is several times slower; anything else takes that path.
        self._simple = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters)
        self._names = tuple(p.name for p in parameters)
        self._name_set = frozenset(self._names)
        self._defaults = {p.name: p.default for p in parameters if p.default is not p.empty}

    def bind(self, args: tuple[Any, ...] | list[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Arguments by name; raises ``TypeError`` when they do not fit the signature."""
        if self._simple and len(args) <= len(self._names):
            arguments = dict(zip(self._names, args, strict=False))
            if arguments.keys().isdisjoint(kwargs) and self._name_set.issuperset(kwargs):
                arguments.update(kwargs)
                for name, default in self._defaults.items():
                    arguments.setdefault(name, default)
                if len(arguments) == len(self._names):
                    return arguments
        # Unusual signatures, and every mismatch: inspect binds, or raises TypeError.
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        if self._var_positional is not None:
            arguments[self._var_positional] = list(arguments[self._var_positional])
        if self._var_keyword is not None:
            # **kwargs entries join the named parameters at the top level.
            extra = arguments.pop(self._var_keyword)
            arguments.update(extra)
        return arguments


class ArgumentView(dict[str, Any]):
    """A read-only view of bound arguments: ``job["tenant_id"]`` or ``job.tenant_id``.

    Attribute access names the argument first: a task with a parameter called
    ``items``, ``keys`` or ``get`` reads it as ``job.items``; the mapping methods
    stay available under names that are not arguments. It is a ``dict``
    (refusing every change), so ``dict(job)`` and ``**job`` read the arguments
    whatever they are called.
    """

    __slots__ = ()

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_") and dict.__contains__(self, name):
            return dict.__getitem__(self, name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the task has no argument {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("task arguments are read-only here")

    def _read_only(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("task arguments are read-only here")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __repr__(self) -> str:
        return f"ArgumentView({dict.__repr__(self)})"


def json_payload(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments as the worker will receive them, in plain JSON types.

    Encoded with kombu's JSON (datetimes, UUIDs, Decimals become its
    ``{"__type__", "__value__"}`` markers; tuples become lists) and decoded
    with the plain JSON decoder, so the markers stay as data and the hash
    only ever sees JSON.
    """
    try:
        text = kombu_dumps(arguments)
    except RecursionError:
        # Nested deeper than Python's recursion limit: no path could be shown either.
        raise InvalidPayload(
            "task arguments are nested too deeply to be encoded as JSON for hashing"
        ) from None
    except (EncodeError, TypeError, ValueError) as exc:
        path = _unencodable_path(arguments)
        where = f" at {path}" if path else ""
        raise InvalidPayload(
            f"task arguments cannot be encoded as JSON for hashing{where}: {exc}", path=path
        ) from exc
    decoded: dict[str, Any] = json.loads(text)
    return decoded


def _unencodable_path(value: Any, path: str = "") -> str | None:
    """The jq-style path of the first value kombu's JSON cannot encode, if any."""
    try:
        kombu_dumps(value)
    except (EncodeError, TypeError, ValueError):
        pass
    else:
        return None
    if isinstance(value, Mapping):
        for name, item in value.items():
            if not isinstance(name, str | int | float | bool) and name is not None:
                return path or "."
            found = _unencodable_path(item, path + _member(str(name)))
            if found:
                return found
    elif isinstance(value, list | tuple):
        for position, item in enumerate(value):
            found = _unencodable_path(item, f"{path}[{position}]")
            if found:
                return found
    return path or "."


def _member(name: str) -> str:
    return f".{name}" if name.isidentifier() and name.isascii() else f".{json.dumps(name)}"
