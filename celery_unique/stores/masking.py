"""Store URLs shown without their passwords, everywhere an error, a check or a log line
names one.

Whatever the URL's shape: a mistyped scheme (``reddis://``, ``redis:/``, none
at all), several hosts each with credentials of their own (a Sentinel URL),
a password given as a query parameter. A URL that is not a URL at all is
masked as well as it can be; redacting a text also removes every password
of the URL it may quote, however reformatted.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

#: What a password is shown as.
MASK = "***"
#: Shorter passwords are masked in URLs only: masking every "1" of a traceback hides more
#: than it protects.
_MIN_SECRET = 4
#: A scheme, however many slashes follow it (``redis://``, ``redis:/``, ``redis:``).
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:/*")
#: A secret given as a query parameter (``?password=``, ``?sentinel_password=...``).
_QUERY_SECRET = re.compile(
    r"((?:^|[&;])[^=&;]*(?:password|passwd|pwd|secret|token)=)([^&;#]*)", re.IGNORECASE
)


def masked(url: str) -> str:
    """``url`` as given, with every password in it replaced by ``***``.

    Written out by hand rather than parsed and rebuilt, so that the URL reads as
    the user wrote it (``django://`` stays ``django://``) and one that no parser
    accepts (several hosts, a broken scheme) is still masked.
    """
    return _mask(url)[0]


def redacted(text: str, url: str | None) -> str:
    """``text`` (an error's message, a traceback) with ``url`` and its passwords masked."""
    if not url:
        return text
    shown, secrets = _mask(url)
    text = text.replace(url, shown)
    # A library may quote the URL reformatted, or the password alone.
    for secret in sorted(_spellings(secrets), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def _mask(url: str) -> tuple[str, set[str]]:
    """``url`` with its secrets masked, and the secrets."""
    found = _SCHEME.match(url)
    head = found.group(0) if found else ""
    rest, question, query = url[len(head) :].partition("?")
    secrets: set[str] = set()
    # The last "@" ends the credentials: a password may hold "@" that was not escaped.
    credentials, at, hosts = rest.rpartition("@")
    if at:
        if head.endswith("//") or ":" in credentials:
            shown = _mask_credentials(credentials, secrets)
        else:
            # Only after "scheme://" does "name@host" surely name a user: elsewhere
            # ("redis:pw@host", a typo) the name may be the password.
            secrets.add(credentials)
            shown = MASK
        rest = f"{shown}@{hosts}"

    def hide(match: re.Match[str]) -> str:
        if not match.group(2):
            return match.group(0)
        secrets.add(match.group(2))
        return match.group(1) + MASK

    return f"{head}{rest}{question}{_QUERY_SECRET.sub(hide, query)}", secrets


def _mask_credentials(credentials: str, secrets: set[str]) -> str:
    """``user:password`` (or, for several hosts, ``user:password@host,...,user:password``)
    with the passwords masked."""
    segments = credentials.split(",")
    if len(segments) > 1 and all("@" in each for each in segments[:-1]):
        # Several hosts, each with credentials of its own (``:pw@h1:26379,:pw2@h2:26379``).
        shown = []
        for each in segments[:-1]:
            own, _, host = each.rpartition("@")
            shown.append(f"{_mask_one(own, secrets)}@{host}")
        return ",".join([*shown, _mask_one(segments[-1], secrets)])
    return _mask_one(credentials, secrets)


def _mask_one(credentials: str, secrets: set[str]) -> str:
    user, colon, password = credentials.partition(":")
    if not (colon and password):
        return credentials
    secrets.add(password)
    return f"{user}:{MASK}"


def _spellings(secrets: set[str]) -> set[str]:
    """Each secret as written and unescaped, when long enough to mask in free text."""
    return {
        each for secret in secrets for each in (secret, unquote(secret)) if len(each) >= _MIN_SECRET
    }
