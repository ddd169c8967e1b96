"""The configuration checks' catalogue and the page that documents it list the same checks."""

from __future__ import annotations

import re
from pathlib import Path

from celery_unique.checks import CATALOGUE, Level

PAGE = Path(__file__).resolve().parents[2] / "docs" / "checks.md"


def test_the_docs_table_lists_every_check_with_its_severity() -> None:
    table = PAGE.read_text().split("## The checks", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(celery_unique\.[EW]\d{3})` \| (\w+) \|", table, re.MULTILINE)
    assert dict(rows) == {check.id: check.level.value for check in CATALOGUE.values()}


def test_an_id_says_its_severity() -> None:
    for check in CATALOGUE.values():
        letter = check.id.rsplit(".", 1)[1][0]
        assert (letter == "E") == (check.level is Level.ERROR), check.id
