"""Store URLs shown without their passwords, everywhere a check or a log line names one."""

from __future__ import annotations

import re
from urllib.parse import unquote

#: What a password is shown as.
MASK = "***"
#: Shorter passwords are masked in URLs only: masking every "1" of a traceback hides more
#: than it protects.
_MIN_SECRET = 4
#: A password given as a query parameter (``?sentinel_password=...``).
_QUERY_PASSWORD = re.compile(r"((?:^|&)[^=&]*password=)([^&]*)", re.IGNORECASE)


def masked(url: str) -> str:
    """``url`` as given, with every password in it replaced by ``***``.

    Written out by hand rather than parsed and rebuilt, so that the URL reads as
    the user wrote it (``django://`` stays ``django://``) and one that no parser
    accepts (several hosts, say) is still masked.
    """
    scheme, separator, rest = url.partition("://")
    if not separator:
        return url
    rest, question, query = rest.partition("?")
    # The last "@" ends the credentials: a password may hold "@" that was not escaped.
    credentials, at, hosts = rest.rpartition("@")
    user, colon, password = credentials.partition(":")
    if at and colon and password:
        rest = f"{user}:{MASK}@{hosts}"
    query = _QUERY_PASSWORD.sub(lambda found: found.group(1) + MASK, query)
    return f"{scheme}{separator}{rest}{question}{query}"


def redacted(text: str, url: str | None) -> str:
    """``text`` (an error's message, a traceback) with ``url`` and its passwords masked."""
    if not url:
        return text
    text = text.replace(url, masked(url))
    # A library may quote the URL reformatted, or the password alone.
    for secret in _passwords(url):
        text = text.replace(secret, MASK)
    return text


def _passwords(url: str) -> set[str]:
    _, separator, rest = url.partition("://")
    if not separator:
        return set()
    rest, _, query = rest.partition("?")
    credentials, at, _ = rest.rpartition("@")
    found = {found.group(2) for found in _QUERY_PASSWORD.finditer(query)}
    if at:
        found.add(credentials.partition(":")[2])
    return {
        each for secret in found for each in (secret, unquote(secret)) if len(each) >= _MIN_SECRET
    }
