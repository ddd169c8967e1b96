"""What the documentation says each scene returns, and the check of a report against it."""

from __future__ import annotations

from celery_unique.demo.report import Report

#: What the documentation says each step returns ("REUSED J1": the first job).
EXPECTED = {
    "queued": ["CREATED J1", "REUSED J1", "CREATED J2", "CREATED J3"],
    "active": ["CREATED J1", "REUSED J1", "REUSED J1", "CREATED J2"],
    "exists": ["CREATED J1", "REUSED J1", "REUSED J1", "REUSED J1"],
    "payload": ["CREATED J1", "REUSED J1", "CREATED J2"],
    "window": [
        "CREATED J1",
        "REUSED J1",
        "uniqueness_conflict J1",
        "REUSED J1",
        "CREATED J2",
    ],
}


def check(report: Report) -> None:
    """Compare every outcome with the documented behaviour; record what differs."""
    scenes = {**report.scopes, "payload": report.payload, "window": report.window}
    for scene, rows in scenes.items():
        got = [row.summary for row in rows]
        if got != EXPECTED[scene]:
            report.surprises.append(f"{scene}: got {got}, documented {EXPECTED[scene]}")
    drift = [row.policy_drift for row in report.window]
    if drift != [False, False, False, True, False]:
        report.surprises.append(f"window: policy_drift was {drift}; documented only on step 4")
    if not all(report.payload_keys_held):
        report.surprises.append(
            f"payload: the store held the key computed with Payload.key: {report.payload_keys_held}"
        )
    for refusal in report.invalid:
        if (refusal.code, refusal.keys_written, refusal.messages_published) != (
            "invalid_key",
            0,
            0,
        ):
            report.surprises.append(f"invalid key {refusal.given}: {refusal}")
