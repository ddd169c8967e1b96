"""Key rules (what a valid key is) and the layout of keys in a store.

A storage key reads ``unique:v1:{<namespace>}:<kind>:<scope>\\x1f<key>``:
``v1`` versions the layout so a future change never orphans live keys; the
``{namespace}`` hash tag puts every key of a namespace in one Redis Cluster
slot (one decision may touch an active and a window key); ``<scope>`` is the
task name, or empty for keys shared by every task (``unique_prefix=False``);
the unit separator cannot occur in a valid key, so no two (scope, key) pairs
ever share a storage key.

With ``unique_key_spread = "key"`` a key scoped to its task reads
``unique:v1:<namespace>:{<tag>}:<kind>:<scope>\\x1f<key>`` instead, its hash
tag a digest of its scope and key (:func:`key_tag`), or of its task alone when
the task declares a window key (:func:`task_tag`: both keys of one dispatch
must share a slot). Keys shared by every task keep the namespace's tag. A
namespace cannot contain braces, so the two forms never read the same.
"""

from __future__ import annotations

import hashlib
import re

from celery_unique.exceptions import (
    ImproperlyConfigured,
    InvalidDeclaration,
    InvalidJobId,
    InvalidKey,
)

MAX_KEY_BYTES = 512
PREFIX = "unique:v1:"
SEPARATOR = "\x1f"
ACTIVE = "a"
WINDOW = "w"

# Unicode category Cc is exactly these two ranges.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def validate_key(key: object, *, what: str = "key") -> str:
    """Return ``key`` if it follows the key rules, else raise ``invalid_key``."""
    if not isinstance(key, str):
        raise InvalidKey(f"{what} must be a str, not {type(key).__name__}", key)
    if not key:
        raise InvalidKey(f"{what} must not be empty", key)
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidKey(f"{what} is not valid Unicode ({exc.reason})", key) from None
    if size > MAX_KEY_BYTES:
        raise InvalidKey(f"{what} is {size} bytes as UTF-8; at most {MAX_KEY_BYTES}", key)
    control = _CONTROL.search(key)
    if control:
        raise InvalidKey(
            f"{what} contains control character U+{ord(control.group()):04X} "
            f"at position {control.start()}",
            key,
        )
    return key


def validate_job_id(job_id: str) -> str:
    """Return ``job_id`` if every store can hold it exactly, else raise ``invalid_job_id``.

    Any Unicode text without control characters (category Cc) is stored exactly,
    whatever its length or plane. Control characters are refused because the
    stores' record layouts and some databases (PostgreSQL text cannot hold NUL)
    could not keep them; lone surrogates because they cannot be encoded at all.
    """
    if not isinstance(job_id, str) or not job_id:
        raise InvalidJobId(f"a job id must be a non-empty str, not {job_id!r}", job_id)
    control = _CONTROL.search(job_id)
    if control:
        raise InvalidJobId(
            f"job id {job_id!r} contains control character U+{ord(control.group()):04X}: "
            "uniqueness stores cannot hold it exactly",
            job_id,
        )
    try:
        job_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidJobId(
            f"job id {job_id!r} is not valid Unicode ({exc.reason})", job_id
        ) from None
    return job_id


def validate_task_name(name: object) -> None:
    """Raise ``invalid_declaration`` if task ``name`` has a control character.

    Stores keep the task's name in its keys' records and in key prefixes, beside
    other fields; a control character there could shift them.
    """
    if not isinstance(name, str):
        return
    control = _CONTROL.search(name)
    if control:
        raise InvalidDeclaration(
            f"task name {name!r} contains control character U+{ord(control.group()):04X} "
            f"at position {control.start()}: a unique task's name is kept in its keys' "
            "records, which cannot hold it exactly (rename the task)"
        )


#: Characters a namespace may not contain: the hash-tag braces would let one
#: namespace's keys collide with another's, or leave a Redis Cluster hash tag empty.
_NAMESPACE_FORBIDDEN = re.compile("[{}\x00-\x1f\x7f-\x9f]")


def validate_namespace(namespace: str) -> str:
    """Return ``namespace`` if its keys can never collide with another namespace's."""
    bad = _NAMESPACE_FORBIDDEN.search(namespace)
    if not namespace or bad:
        what = "is empty" if not namespace else f"contains {bad.group()!r}" if bad else ""
        raise ImproperlyConfigured(
            f"unique_namespace {namespace!r} {what}: a namespace may not be empty or contain "
            "'{', '}' or control characters (its keys could collide with another namespace's)"
        )
    return namespace


def namespace_prefix(namespace: str) -> str:
    """The prefix of every key of ``namespace`` that carries the namespace's hash tag."""
    return f"{PREFIX}{{{namespace}}}:"


def namespace_prefixes(namespace: str) -> tuple[str, str]:
    """The prefixes of every key of ``namespace``: with its hash tag, and spread."""
    return namespace_prefix(namespace), f"{PREFIX}{namespace}:{{"


#: The values of ``unique_key_spread``.
SPREADS = ("namespace", "key")


def key_tag(scope: str, key: str) -> str:
    """The hash tag of a key spread on its own: a digest, as a key may contain braces."""
    return hashlib.blake2b(f"{scope}{SEPARATOR}{key}".encode(), digest_size=6).hexdigest()


def task_tag(scope: str) -> str:
    """The hash tag of every key of a task that decides two kinds of key together."""
    return "t" + hashlib.blake2b(scope.encode(), digest_size=6).hexdigest()


def storage_key(namespace: str, kind: str, scope: str, key: str, *, tag: str | None = None) -> str:
    """The key as stored: versioned, namespaced, scoped to a task name (or not).

    ``tag`` is the key's own hash tag (:func:`key_tag`, :func:`task_tag`);
    without one, every key of the namespace shares the namespace's.
    """
    if tag is None:
        return f"{PREFIX}{{{namespace}}}:{kind}:{scope}{SEPARATOR}{key}"
    return f"{PREFIX}{namespace}:{{{tag}}}:{kind}:{scope}{SEPARATOR}{key}"


def hash_tag(stored: str) -> str:
    """The part of a storage key that Redis Cluster hashes to choose its slot."""
    start = stored.index("{") + 1
    return stored[start : stored.index("}", start)]


def shown(text: str) -> str:
    """``text`` for a terminal or a page: characters that print nothing or reorder
    what follows (U+202E, zero-width spaces, other format and separator
    characters) written as ``\\uXXXX``, so that two keys that look alike read apart.

    Keys themselves stay exact: this is for showing them only.
    """
    if text.isprintable():
        return text
    return "".join(
        char
        if char.isprintable()
        else f"\\u{ord(char):04x}"
        if ord(char) < 0x10000
        else f"\\U{ord(char):08x}"
        for char in text
    )


def display_key(scope: str, key: str) -> str:
    """The key as users read it: ``<task name>:<key>``, or the bare key when unscoped."""
    return f"{scope}:{key}" if scope else key


def split_storage_key(stored: str) -> tuple[str, str, str, str]:
    """``(namespace, kind, scope, key)`` of a storage key, in either form."""
    rest = stored[len(PREFIX) :]
    if rest.startswith("{"):
        namespace, _, rest = rest[1:].partition("}:")
    else:
        namespace, _, rest = rest.partition(":{")
        rest = rest.partition("}:")[2]
    kind, _, rest = rest.partition(":")
    scope, _, key = rest.partition(SEPARATOR)
    return namespace, kind, scope, key


#: The prefix of a release note (see :func:`release_note`): outside :data:`PREFIX`, so
#: no listing of held keys ever shows one.
RELEASE_NOTE = "unique:released:"
_NOTE_SEPARATOR = "\x1e"


def release_note(stored: str, job_id: str) -> str:
    """Where a store notes that an operator released ``job_id``'s hold on ``stored``.

    The note lets the job's deliveries run although another job holds the key
    since. Its name keeps the key's hash tag (the first braces in it), so one
    script reaches both; a key and a job id hold no control character, so no
    two (key, job) pairs share a note.
    """
    return f"{RELEASE_NOTE}{stored}{_NOTE_SEPARATOR}{job_id}"


def is_release_note(stored: str) -> bool:
    """Whether a storage key is a release note rather than a held key."""
    return stored.startswith(RELEASE_NOTE)
