"""The demo (``python -m celery_unique.demo``): it runs, and the library does what it shows."""

from __future__ import annotations

import io

import celery
import pytest

from celery_unique import demo

#: The demo starts a worker and runs for a few seconds.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run() -> tuple[demo.Report, str]:
    """The demo run once for this module: its report and its printed output."""
    out = io.StringIO()
    report = demo.main(out)
    return report, out.getvalue()


@pytest.fixture
def report(run: tuple[demo.Report, str]) -> demo.Report:
    return run[0]


def outcomes(rows: list[demo.Row]) -> list[tuple[str, str | None, str | None]]:
    return [(row.outcome, row.job, row.match) for row in rows]


def test_queued_key_is_freed_when_the_job_starts(report: demo.Report) -> None:
    """queued: reused while J1 waits, a new job once J1 has started."""
    assert outcomes(report.scopes["queued"]) == [
        ("CREATED", "J1", None),
        ("REUSED", "J1", "active"),
        ("CREATED", "J2", None),
        ("CREATED", "J3", None),
    ]
    assert report.freed["queued"] == "when J1 started"


def test_active_key_is_freed_when_the_job_finishes(report: demo.Report) -> None:
    """active: reused while J1 waits and runs, a new job once J1 has finished."""
    assert outcomes(report.scopes["active"]) == [
        ("CREATED", "J1", None),
        ("REUSED", "J1", "active"),
        ("REUSED", "J1", "active"),
        ("CREATED", "J2", None),
    ]
    assert report.freed["active"] == "when J1 finished"


def test_exists_key_outlives_the_job(report: demo.Report) -> None:
    """exists: reused even after J1 finished, the key kept for its retention."""
    rows = report.scopes["exists"]
    assert outcomes(rows) == [
        ("CREATED", "J1", None),
        ("REUSED", "J1", "active"),
        ("REUSED", "J1", "active"),
        ("REUSED", "J1", "active"),
    ]
    assert report.freed["exists"] is None
    assert rows[-1].key_before == "held by J1 (finished; kept 60 s more)"


def test_reused_dispatches_return_the_first_job_id(report: demo.Report) -> None:
    """Every row labelled J1 in a scene carries the same job id, the first dispatch's."""
    for rows in [*report.scopes.values(), report.payload, report.window]:
        first = rows[0].job_id
        assert {row.job_id for row in rows if row.job == "J1"} == {first}


def test_payload_key_ignores_arguments_outside_its_paths(report: demo.Report) -> None:
    """Payload(only=...) reuses across requested_at and positional/keyword calls, not templates."""
    assert outcomes(report.payload) == [
        ("CREATED", "J1", None),
        ("REUSED", "J1", "active"),
        ("CREATED", "J2", None),
    ]
    first, second, third = (row.detail for row in report.payload)
    assert first == second != third
    assert first.startswith("demo.send_digest:")
    assert report.payload_keys_held == [True, True, True]


def test_window_key_reuses_conflicts_and_reports_policy_drift(report: demo.Report) -> None:
    """Same request reused after J1 finished; a different one conflicts; time limits only drift."""
    assert [(row.outcome, row.job, row.match, row.policy_drift) for row in report.window] == [
        ("CREATED", "J1", None, False),
        ("REUSED", "J1", "window", False),
        ("uniqueness_conflict", "J1", None, False),
        ("REUSED", "J1", "window", True),
        ("CREATED", "J2", None, False),
    ]
    assert report.window[2].job_id == report.window[0].job_id


def test_invalid_keys_write_and_publish_nothing(report: demo.Report) -> None:
    """Every invalid key fails with invalid_key before the store or the broker is touched."""
    assert len(report.invalid) == 6
    assert {(r.code, r.keys_written, r.messages_published) for r in report.invalid} == {
        ("invalid_key", 0, 0)
    }


def test_demo_finds_nothing_undocumented_and_prints_every_scene(
    run: tuple[demo.Report, str],
) -> None:
    """The demo's own check passes, and its output has the four scenes and the verdict."""
    report, printed = run
    assert report.surprises == []
    assert report.ok
    for heading in ("1. Active keys", "2. A key derived", "3. A window key", "4. Invalid keys"):
        assert heading in printed
    assert "Every outcome above is the documented one." in printed


def test_demo_leaves_the_current_app_alone(run: tuple[demo.Report, str]) -> None:
    """The embedded worker's app does not stay this process's current or default app."""
    assert celery.current_app.main != "demo"


def test_check_names_an_outcome_that_differs(report: demo.Report) -> None:
    """The demo's check reports a scene whose outcomes are not the documented ones."""
    altered = demo.Report(
        scopes={"queued": report.scopes["active"], "active": report.scopes["active"]},
        freed=report.freed,
        payload=report.payload,
        payload_keys_held=report.payload_keys_held,
        window=report.window,
        invalid=report.invalid,
    )
    demo.check(altered)
    assert len(altered.surprises) == 1
    assert altered.surprises[0].startswith("queued: got")
