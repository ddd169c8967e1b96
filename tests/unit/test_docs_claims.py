"""What the docs say of the code's tables and fields is what the code has."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from celery_unique.operations import KeyInfo
from celery_unique.stores import STORES

DOCS = Path(__file__).resolve().parents[2] / "docs"


def section(page: str, heading: str) -> str:
    """The text of ``page`` from ``heading`` to the next heading of any level."""
    text = (DOCS / page).read_text()
    return re.split(r"\n#+ ", text.split(f"\n{heading}\n", 1)[1], maxsplit=1)[0]


def code_names(text: str) -> set[str]:
    return set(re.findall(r"`(\w+)`", text))


def test_the_url_table_has_every_store_scheme() -> None:
    table = section("configuration.md", "### Store URLs")
    schemes = set(re.findall(r"`([a-z+]+)://", table))
    assert schemes == set(STORES)


def test_list_json_documents_every_field_a_key_has() -> None:
    listed = section("operations.md", "### `list`").split("`--json` prints", 1)[1]
    fields = {field.name for field in dataclasses.fields(KeyInfo)}
    assert fields <= code_names(listed.split("\n\n", 1)[0])


def test_keyinfo_documents_every_field_and_the_age_it_records() -> None:
    api = section("operations.md", "## Python API").split("`KeyInfo` has", 1)[1]
    fields = {field.name for field in dataclasses.fields(KeyInfo)}
    assert fields <= code_names(api)
    assert "do not record when a key was written" not in api


def test_the_duplicate_policy_row_says_which_keys_it_needs() -> None:
    options = section("configuration.md", "## Task options")
    [row] = [line for line in options.splitlines() if line.startswith("| `unique_on_duplicate`")]
    assert 'unique_while="active"' in row
    assert "window key" in row
    assert "unique_debounce" in row
