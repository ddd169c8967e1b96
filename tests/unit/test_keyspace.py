"""Key rules (SPEC 6a) and the storage-key layout."""

from __future__ import annotations

import re
from typing import Any

import pytest

from celery_unique import InvalidKey
from celery_unique.exceptions import ImproperlyConfigured, InvalidDeclaration, InvalidJobId
from celery_unique.keys import keyspace
from celery_unique.keys.keyspace import (
    display_key,
    hash_tag,
    key_tag,
    namespace_prefix,
    namespace_prefixes,
    split_storage_key,
    storage_key,
    task_tag,
    validate_job_id,
    validate_key,
    validate_namespace,
    validate_task_name,
)


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("", "empty"),
        ("x" * 513, "513 bytes"),
        ("é" * 257, "514 bytes"),
        ("tab\there", "U+0009"),
        ("nul\x00", "U+0000"),
        ("del\x7f", "U+007F"),
        ("c1\x85", "U+0085"),
        ("lone\ud800", "not valid Unicode"),
        (42, "must be a str"),
        (b"bytes", "must be a str"),
        (None, "must be a str"),
    ],
)
def test_invalid_keys_are_rejected_with_a_reason(key: object, reason: str) -> None:
    """Every rule violation raises invalid_key, carries the key and says what is wrong."""
    with pytest.raises(InvalidKey, match=re.escape(reason)) as caught:
        validate_key(key)
    assert caught.value.code == "invalid_key"
    assert caught.value.key == key


@pytest.mark.parametrize(
    "key", ["x", "x" * 512, "é" * 256, " padded ", "Tenant:7", "emoji 🎉", "line\u2028sep"]
)
def test_valid_keys_are_kept_exactly(key: str) -> None:
    """Valid keys come back unchanged: no trimming, folding or normalisation."""
    assert validate_key(key) == key


def test_keys_compare_exactly() -> None:
    """Case and Unicode normal forms are distinct keys."""
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    assert storage_key("ns", "a", "t", composed) != storage_key("ns", "a", "t", decomposed)
    assert storage_key("ns", "a", "t", "K") != storage_key("ns", "a", "t", "k")


def test_storage_key_is_versioned_tagged_and_splits_back() -> None:
    """The layout carries v1 and a hash tag per namespace, and can be read back."""
    stored = storage_key("billing", "a", "tasks.send:v2", "user:1")
    assert stored.startswith("unique:v1:{billing}:a:")
    assert split_storage_key(stored) == ("billing", "a", "tasks.send:v2", "user:1")


def test_scope_and_key_never_run_together() -> None:
    """A colon in a task name cannot make two (task, key) pairs share a storage key."""
    assert storage_key("ns", "a", "a:b", "c") != storage_key("ns", "a", "a", "b:c")


def test_display_key() -> None:
    """Users read keys as '<task>:<key>', or the bare key when unscoped."""
    assert display_key("tasks.send", "k") == "tasks.send:k"
    assert display_key("", "k") == "k"


@pytest.mark.parametrize("key", ["user:1", "a}b{c", "{x}", "é 🎉"])
def test_a_spread_key_has_a_tag_of_its_own_and_splits_back(key: str) -> None:
    """A spread key's hash tag is a digest of its scope and key (braces in a key cannot
    cut it short), outside the namespace's prefix, and the key reads back."""
    stored = storage_key("billing", "a", "tasks.send", key, tag=key_tag("tasks.send", key))
    assert hash_tag(stored) == key_tag("tasks.send", key)
    assert re.fullmatch("[0-9a-f]{12}", hash_tag(stored))
    assert stored.startswith(namespace_prefixes("billing")[1])
    assert not stored.startswith(namespace_prefixes("billing")[0])
    assert split_storage_key(stored) == ("billing", "a", "tasks.send", key)


def test_spread_tags_differ_by_key_and_task_but_not_by_kind() -> None:
    """Two keys of one task get two tags; a task's tag is one for all its keys."""
    assert key_tag("t", "k1") != key_tag("t", "k2")
    assert key_tag("t", "k") != key_tag("u", "k")
    assert key_tag("t", "k") != task_tag("t")
    active = storage_key("ns", "a", "t", "k1", tag=task_tag("t"))
    window = storage_key("ns", "w", "t", "other", tag=task_tag("t"))
    assert hash_tag(active) == hash_tag(window) == task_tag("t")


def test_no_namespace_reads_another_namespaces_spread_keys() -> None:
    """Namespace ``a`` never claims a key of namespace ``a:b``, nor the other way round."""
    of_ab = storage_key("a:b", "a", "t", "k", tag=key_tag("t", "k"))
    of_a = storage_key("a", "a", "t", "k", tag=key_tag("t", "k"))
    assert not of_ab.startswith(namespace_prefixes("a"))
    assert not of_a.startswith(namespace_prefixes("a:b"))
    assert split_storage_key(of_ab)[0] == "a:b"


def test_shown_escapes_what_prints_nothing_or_reorders_and_keeps_the_rest() -> None:
    """Bidi overrides, zero-width and other format or separator characters are written as
    ``\\uXXXX`` (``\\UXXXXXXXX`` past the first plane); printable text, spaces included,
    comes back as it is."""
    assert keyspace.shown("tenant 7:é✓") == "tenant 7:é✓"
    assert keyspace.shown("a\u202eb\u200bc\u2028d") == "a\\u202eb\\u200bc\\u2028d"
    assert keyspace.shown("x\U000e0001") == "x\\U000e0001"


def test_a_task_name_with_a_control_character_is_refused_when_defined() -> None:
    """A control character in a unique task's name would shift the fields of its keys'
    records: the task is refused at definition, with the position named."""
    from celery import Celery

    from celery_unique import UniqueTask
    from celery_unique.exceptions import InvalidDeclaration

    app = Celery("names", set_as_current=False)

    def bad() -> None: ...

    # A task of an app not finalized is created when first used: .name uses it.
    with pytest.raises(InvalidDeclaration, match=r"U\+000A at position 3"):
        app.task(base=UniqueTask, name="bad\nname", unique_key="k", shared=False)(bad).name  # noqa: B018

    @app.task(base=UniqueTask, name="odd\u202ename", shared=False)
    def odd() -> None: ...

    assert odd.name == "odd\u202ename"  # not a control character: kept exactly


def test_a_key_error_names_what_was_checked_and_where_the_control_character_is() -> None:
    """The message starts with what the key is (``what``) and gives a control
    character's code point and position."""
    with pytest.raises(InvalidKey, match=r"^window key must not be empty$"):
        validate_key("", what="window key")
    with pytest.raises(InvalidKey, match=r"^key contains control character U\+001F at position 3$"):
        validate_key("abc\x1fd")


@pytest.mark.parametrize("job_id", ["j", "x" * 10_000, "emoji 🎉", "line\u2028sep", "{braces}"])
def test_a_valid_job_id_is_kept_exactly(job_id: str) -> None:
    """Any length, any plane: a job id without control characters comes back as it is."""
    assert validate_job_id(job_id) == job_id


@pytest.mark.parametrize(
    ("job_id", "reason"),
    [
        ("", "a job id must be a non-empty str, not ''"),
        (None, "a job id must be a non-empty str, not None"),
        (42, "a job id must be a non-empty str, not 42"),
        ("a\nb", "contains control character U+000A: uniqueness stores cannot hold it"),
        ("nul\x00", "contains control character U+0000"),
        ("c1\x9f", "contains control character U+009F"),
        ("lone\udfff", "is not valid Unicode"),
    ],
    ids=repr,
)
def test_a_job_id_a_store_cannot_hold_exactly_is_refused(job_id: Any, reason: str) -> None:
    """invalid_job_id, carrying the id and saying why."""
    with pytest.raises(InvalidJobId, match=re.escape(reason)) as caught:
        validate_job_id(job_id)
    assert caught.value.code == "invalid_job_id"
    assert caught.value.job_id == job_id


def test_a_task_name_is_checked_only_when_it_is_a_name() -> None:
    """A task not named yet (``None``) passes; a control character is refused at its position."""
    assert validate_task_name(None) is None
    assert validate_task_name("tasks.send\u202e") is None
    with pytest.raises(InvalidDeclaration, match=r"U\+0009 at position 5"):
        validate_task_name("tasks\tsend")


@pytest.mark.parametrize(
    ("namespace", "what"),
    [
        ("", "is empty"),
        ("a{b", "contains '{'"),
        ("a}", "contains '}'"),
        ("a\x7f", "contains '\\x7f'"),
    ],
)
def test_a_namespace_that_could_collide_says_why(namespace: str, what: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=re.escape(f"{namespace!r} {what}: ")):
        validate_namespace(namespace)


def test_a_valid_namespace_is_kept_and_prefixes_its_keys() -> None:
    """Both prefixes of a namespace: with its hash tag, and where spread keys start."""
    assert validate_namespace("billing:eu") == "billing:eu"
    assert namespace_prefix("billing") == "unique:v1:{billing}:"
    assert namespace_prefixes("billing") == ("unique:v1:{billing}:", "unique:v1:billing:{")
    assert hash_tag(storage_key("billing", "w", "t", "k")) == "billing"


def test_a_release_note_is_outside_every_namespace_and_names_its_job() -> None:
    """A note keeps the key's hash tag, sits outside the held keys' prefix, and one
    note per (key, job)."""
    stored = storage_key("billing", "a", "t", "k")
    note = keyspace.release_note(stored, "job-1")
    assert note == f"unique:released:{stored}\x1ejob-1"
    assert hash_tag(note) == "billing"
    assert keyspace.is_release_note(note)
    assert not keyspace.is_release_note(stored)
    assert not note.startswith(keyspace.PREFIX)


def test_shown_escapes_the_last_character_of_the_first_plane_in_four_digits() -> None:
    """U+FFFF (not printable) is ``\\uffff``: four hex digits up to the plane's end."""
    assert keyspace.shown("a\uffff") == "a\\uffff"


def test_a_storage_keys_tag_and_what_a_key_is_are_given_by_name() -> None:
    """``tag`` and ``what`` are keyword-only: an extra positional argument (a key or
    a tag given one place too far) is refused rather than taken for them."""
    with pytest.raises(TypeError):
        storage_key("ns", "a", "t", "k", "tag")  # type: ignore[misc]
    with pytest.raises(TypeError):
        validate_key("k", "window key")  # type: ignore[misc]


def test_a_task_tag_is_t_and_12_hex_digits() -> None:
    """48 bits of the task name's digest, after a ``t`` (no key tag, 12 hex digits, has one)."""
    assert re.fullmatch("t[0-9a-f]{12}", task_tag("tasks.send"))
    assert re.fullmatch("[0-9a-f]{12}", key_tag("tasks.send", "k"))
