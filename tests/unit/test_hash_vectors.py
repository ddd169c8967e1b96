"""docs/hash-vectors.json: every published vector is what this library derives."""

from __future__ import annotations

import hashlib
import json
import runpy
from pathlib import Path
from typing import Any

import pytest

from celery_unique.keys.canonical import canonical_bytes
from celery_unique.keys.paths import Selection, parse_path
from celery_unique.keys.payload import Payload

DOCS = Path(__file__).resolve().parents[2] / "docs"
VECTORS_FILE = DOCS / "hash-vectors.json"
DOCUMENT = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))
VECTORS: list[dict[str, Any]] = DOCUMENT["vectors"]


def by_name(name: str) -> dict[str, Any]:
    return next(vector for vector in VECTORS if vector["name"] == name)


@pytest.mark.parametrize("vector", VECTORS, ids=[vector["name"] for vector in VECTORS])
def test_vector(vector: dict[str, Any]) -> None:
    """The spec built from a vector derives its canonical bytes, digest and key exactly."""
    spec = Payload(only=vector["only"], exclude=vector["exclude"], prefix=vector["prefix"])
    selection = Selection(
        None if vector["only"] is None else [parse_path(text) for text in vector["only"]],
        None if vector["exclude"] is None else [parse_path(text) for text in vector["exclude"]],
    )
    assert (
        canonical_bytes(selection.apply(vector["payload"])).decode("ascii") == vector["canonical"]
    )
    assert spec.digest(vector["payload"]) == vector["digest"]
    assert spec.key(vector["payload"], vector["task_name"]) == vector["key"]


@pytest.mark.parametrize("vector", VECTORS, ids=[vector["name"] for vector in VECTORS])
def test_vector_is_self_consistent(vector: dict[str, Any]) -> None:
    """A vector's digest is SHA-256 of its canonical text; its key follows the prefix rule."""
    assert vector["canonical"].startswith("cu1\n")
    assert vector["canonical"].isascii()
    assert hashlib.sha256(vector["canonical"].encode("ascii")).hexdigest() == vector["digest"]
    if vector["prefix"] and vector["task_name"] is not None:
        assert vector["key"] == f"{vector['task_name']}:{vector['digest']}"
    else:
        assert vector["key"] == vector["digest"]


def test_file_layout() -> None:
    """The file names its algorithm and holds about 25 uniquely named vectors with every field."""
    assert DOCUMENT["algorithm"] == "cu1"
    assert len(VECTORS) >= 25
    assert len({vector["name"] for vector in VECTORS}) == len(VECTORS)
    fields = {
        "name",
        "payload",
        "only",
        "exclude",
        "task_name",
        "prefix",
        "canonical",
        "digest",
        "key",
    }
    assert all(set(vector) == fields for vector in VECTORS)


def test_vectors_tell_types_apart() -> None:
    """true, 1, 1.0 and "1" as the same field give four different digests."""
    names = ["true", "integer 1", "float 1.0", "string '1'"]
    assert len({by_name(name)["digest"] for name in names}) == len(names)


def test_generator_writes_the_committed_file() -> None:
    """docs/_tools/make_hash_vectors.py still produces the committed file byte for byte."""
    generator = runpy.run_path(str(DOCS / "_tools" / "make_hash_vectors.py"))
    assert generator["render"]() == VECTORS_FILE.read_text(encoding="utf-8")
