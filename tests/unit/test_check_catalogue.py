"""The configuration checks' catalogue and the page that documents it list the same checks."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from celery_unique import UniqueTask
from celery_unique.checks import CATALOGUE, Finding, Level
from celery_unique.checks.catalogue import finding, isolated
from celery_unique.exceptions import InvalidDeclaration

PAGE = Path(__file__).resolve().parents[2] / "docs" / "checks.md"


def test_the_docs_table_lists_every_check_with_its_severity() -> None:
    table = PAGE.read_text().split("## The checks", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(celery_unique\.[EW]\d{3})` \| (\w+) \|", table, re.MULTILINE)
    assert dict(rows) == {check.id: check.level.value for check in CATALOGUE.values()}


def test_an_id_says_its_severity() -> None:
    for check in CATALOGUE.values():
        letter = check.id.rsplit(".", 1)[1][0]
        assert (letter == "E") == (check.level is Level.ERROR), check.id


def test_a_finding_is_an_error_by_its_checks_level() -> None:
    assert finding("celery_unique.E001", "unique_backend", "m").is_error
    assert not finding("celery_unique.W021", "unique_lease", "m").is_error


def test_a_finding_as_data_is_what_unique_check_json_prints() -> None:
    found = finding("celery_unique.W021", "unique_lease", "the message", "the hint")
    assert found.as_dict() == {
        "id": "celery_unique.W021",
        "level": "warning",
        "subject": "unique_lease",
        "message": "the message",
        "hint": "the hint",
    }


def test_a_finding_without_a_hint_of_its_own_gives_its_checks_fix_as_plain_text() -> None:
    found = finding("celery_unique.W030", "unique_signing_key", "m")
    assert found.hint == CATALOGUE["celery_unique.W030"].fix.replace("`", "")
    assert found.hint.startswith("set unique_signing_key to the same secret")


def check_raising(error: BaseException) -> list[Finding]:
    raise error


def test_a_check_that_raises_is_e013_naming_what_it_covers_its_url_masked() -> None:
    [found] = isolated(
        "celery_unique.W025",
        "unique_namespace",
        check_raising,
        RuntimeError("refused by redis://:hunter2@db:6379"),
        url="redis://:hunter2@db:6379",
    )
    assert (found.id, found.subject) == ("celery_unique.E013", "unique_namespace")
    assert found.message == (
        "the check for celery_unique.W025 could not finish, so whether it applies is unknown: "
        "RuntimeError: refused by redis://:***@db:6379"
    )
    assert found.hint == CATALOGUE["celery_unique.E013"].fix.replace("`", "")


def test_a_check_that_finishes_gives_its_findings() -> None:
    mine = [finding("celery_unique.W021", "unique_lease", "m")]
    assert isolated("celery_unique.W021", "unique_lease", lambda given: given, mine) == mine


def test_a_task_refused_as_a_check_defines_it_is_e014_naming_it() -> None:
    def define() -> list[Finding]:
        class Malformed(UniqueTask):
            name = "shop.malformed"
            unique_while = "sometimes"  # type: ignore[assignment]

        return []

    [found] = isolated("celery_unique.E020", "tasks", define)
    assert (found.id, found.subject, found.is_error) == (
        "celery_unique.E014",
        "shop.malformed",
        True,
    )
    assert found.message.startswith(
        "task shop.malformed is declared with invalid uniqueness options (invalid_declaration): "
        "unique_while must be one of"
    )


def test_a_refused_declaration_of_no_known_task_is_e014_about_the_tasks() -> None:
    [found] = isolated("celery_unique.E020", "tasks", check_raising, InvalidDeclaration("bad"))
    assert (found.id, found.subject, found.message) == (
        "celery_unique.E014",
        "tasks",
        "task (name unknown) is declared with invalid uniqueness options "
        "(invalid_declaration): bad",
    )


def test_a_refused_class_without_a_string_name_is_of_no_known_task() -> None:
    def define() -> list[Finding]:
        class Nameless(UniqueTask):
            name = 42  # type: ignore[assignment]
            unique_while = "sometimes"  # type: ignore[assignment]

        return []

    [found] = isolated("celery_unique.E020", "tasks", define)
    assert (found.id, found.subject) == ("celery_unique.E014", "tasks")


def test_findings_and_checks_are_values_that_cannot_be_changed() -> None:
    """Equal findings (the same check run twice) are one in a set; neither a finding nor a
    check of the catalogue, whose fix every finding of it tells, can be altered."""
    first = finding("celery_unique.W021", "unique_lease", "m")
    assert {first, finding("celery_unique.W021", "unique_lease", "m")} == {first}
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.message = "changed"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        CATALOGUE["celery_unique.W021"].fix = "changed"  # type: ignore[misc]
