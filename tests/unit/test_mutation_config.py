"""scripts/mutate.toml names what exists: modules, tests, and the lines of accepted survivors."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest's own TOML reader before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "docs" / "_generated" / "mutation.md"


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    with (ROOT / "scripts" / "mutate.toml").open("rb") as handle:
        loaded: dict[str, Any] = tomllib.load(handle)
    return loaded


def test_every_module_and_test_file_exists(config: dict[str, Any]) -> None:
    for module, spec in config["modules"].items():
        assert (ROOT / module).is_file(), module
        assert spec["tests"], module
        for test in spec["tests"]:
            path, _, function = test.partition("::")
            assert (ROOT / path).is_file(), test
            assert not function or f"def {function}(" in (ROOT / path).read_text(), test
        args = spec.get("args", [])
        assert isinstance(args, list), module
        assert all(isinstance(arg, str) for arg in args), module


def test_every_accepted_survivor_names_a_line_its_module_still_has(config: dict[str, Any]) -> None:
    """An accepted survivor whose line was edited away is stale: the edit made its mutant
    new, and the next run of scripts/mutate shows it unexplained until it is judged again."""
    for entry in config["accepted"]:
        lines = {line.strip() for line in (ROOT / entry["module"]).read_text().splitlines()}
        assert entry["line"] in lines, entry
        assert entry["module"] in config["modules"], entry
        assert entry["reason"].strip(), entry


def test_every_accepted_survivor_is_in_the_report(config: dict[str, Any]) -> None:
    """docs/_generated/mutation.md was written (scripts/mutate --report) after the last
    change of an accepted survivor's reason. (A module changed since its last run has
    no numbers in the report, and no survivors: they are judged again at its next run.)"""
    report = REPORT.read_text()
    unscored = {
        line.split("`")[1]
        for line in report.splitlines()
        if line.startswith("| `")
        and ("| changed since its last run |" in line or "| not run yet |" in line)
    }
    judged = [entry for entry in config["accepted"] if entry["module"] not in unscored]
    assert judged
    for entry in judged:
        assert f"{entry['reason']}." in report, entry


def test_the_operators_left_out_are_regular_expressions(config: dict[str, Any]) -> None:
    for entry in config["left-out"]:
        re.compile(entry["operators"])
        assert entry["reason"].strip()
