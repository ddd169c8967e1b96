"""Boolean settings and options, parsed strictly: one parser for every one of them.

Settings often arrive as strings (environment variables, ``.env`` files read
into Django settings), and ``bool("false")`` is ``True``: a fail-closed store
would fail open. A value is ``True``/``False`` or one of the usual strings in
any case; anything else is refused, naming the setting, rather than guessed.
"""

from __future__ import annotations

from celery_unique.exceptions import InvalidBoolean

#: The strings a boolean setting accepts, lower-cased, and what each means.
WORDS = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}


def parse_bool(value: object, name: str) -> bool:
    """``value`` of the setting or option ``name`` as a ``bool``; :class:`InvalidBoolean`
    (``improperly_configured``) for anything but a ``bool`` or a string of :data:`WORDS`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in WORDS:
        return WORDS[value.lower()]
    raise InvalidBoolean(
        f"{name} must be True or False (or one of the strings "
        f"{'/'.join(WORDS)}, in any case), not {value!r}",
        setting=name,
        value=value,
    )
