"""Key rules (SPEC 6a) and the storage-key layout."""

from __future__ import annotations

import re

import pytest

from celery_unique import InvalidKey
from celery_unique.keyspace import (
    display_key,
    split_storage_key,
    storage_key,
    validate_key,
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
