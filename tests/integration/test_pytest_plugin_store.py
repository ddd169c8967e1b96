"""The plugin's ``unique_store = configured``: the project's own Redis store, a namespace
per test, and nothing left in it afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.unit.test_pytest_plugin import passed, run_pytest


def test_configured_store_gives_each_test_a_namespace_and_empties_it(
    tmp_path: Path, redis_url: str, redis_client: Any
) -> None:
    """Each test's keys live in Redis under a namespace of its own and are deleted after it."""
    run = run_pytest(
        tmp_path,
        """
        from celery_unique.testing import held_keys
        from proj import charge


        def test_first(unique_eager):
            charge.delay(250, request_id="R-1")
            (held,) = held_keys()
            assert held == "proj.charge:R-1"
            assert held.storage_key.startswith("unique:v1:{proj-test-")


        def test_second_starts_empty(unique_eager):
            assert held_keys() == []
            assert not charge.delay(300, request_id="R-1").duplicate
        """,
        "-o",
        "unique_store=configured",
        store=redis_url,
    )
    assert passed(run, 2), run.stdout + run.stderr
    assert redis_client.keys() == []
