"""The demo's printout: a table per scene, the library's warnings and the verdict."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TextIO

from celery_unique.demo.report import Report, Row
from celery_unique.demo.stage import RETENTION


def table(out: TextIO, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    for line in (header, *rows):
        cells = [cell.ljust(width) for cell, width in zip(line, widths, strict=True)]
        print("    " + "  ".join(cells).rstrip(), file=out)


def dispatch_table(
    out: TextIO, rows: Sequence[Row], column: str, cell: Callable[[Row], str], *, drift: bool
) -> None:
    """The dispatches of one scene, then which job id each label stands for."""
    header = ["#", "dispatch", column, "result", "job", "match"]
    lines = [
        [str(n), row.step, cell(row), row.outcome, row.job or "-", row.match or "-"]
        for n, row in enumerate(rows, 1)
    ]
    if drift:
        header.append("policy_drift")
        for line, row in zip(lines, rows, strict=True):
            line.append("yes" if row.policy_drift else "-")
    table(out, header, lines)
    jobs = dict.fromkeys((row.job, row.job_id) for row in rows if row.job and row.job_id)
    for label, job_id in jobs:
        print(f"    {label} = {job_id}", file=out)


def _store_before(row: Row) -> str:
    return row.key_before


def _short_key(row: Row) -> str:
    name, _, digest = row.detail.rpartition(":")
    return f"{name}:{digest[:12]}..."


_SCOPE_TEXT = {
    "queued": "held from dispatch until a worker starts the job",
    "active": "held from dispatch until the job finishes",
    "exists": "held until the job finishes, then unique_retention "
    f"({int(RETENTION.total_seconds())} s) more",
}


def render(report: Report, store_url: str, out: TextIO) -> None:
    def say(*lines: str) -> None:
        for line in lines:
            print(line, file=out)

    say(
        "celery-unique demo",
        f"  store:  {store_url} (SQLite, a temporary file)",
        "  broker: memory:// (in this process); worker: one thread, solo pool",
        "",
        "1. Active keys: while the key is held, a duplicate returns the job holding it",
        "   @app.task(base=UniqueTask, unique_key=lambda job: f'tenant:{job.tenant_id}',",
        "             unique_while=SCOPE)   -- every dispatch is recalculate.delay(7)",
    )
    for scope, rows in report.scopes.items():
        say("", f"  unique_while={scope!r}: {_SCOPE_TEXT[scope]}")
        dispatch_table(out, rows, "store before it", _store_before, drift=False)
        freed = report.freed[scope]
        say(
            f"    -> J1's key was freed {freed}"
            if freed
            else "    -> J1's key outlived J1: it is kept for unique_retention after J1 finished"
        )
    say(
        "",
        "2. A key derived from the payload: unique_key=Payload(only=['.user_id', '.template'])",
        "   requested_at is outside those paths: changing it does not make a new job",
    )
    dispatch_table(out, report.payload, "key", _short_key, drift=False)
    held = "holds" if all(report.payload_keys_held) else "does NOT hold"
    say(f"    the store {held} each key as Payload(...).key(payload) computes it by hand")
    say(
        "",
        "3. A window key: unique_window_key=lambda job: job.request_id,"
        " unique_window=timedelta(hours=24)",
    )
    dispatch_table(out, report.window, "store before it", _store_before, drift=True)
    say(
        *(
            f"    {row.outcome}: conflicting_job_id = {row.job_id} ({row.job})"
            for row in report.window
            if row.detail
        )
    )
    say("", "4. Invalid keys: refused before the store or the broker is touched")
    table(
        out,
        ["dispatch", "error code", "keys written", "messages published"],
        [[r.given, r.code, str(r.keys_written), str(r.messages_published)] for r in report.invalid],
    )
    if report.warnings:
        say("", "Log lines of celery_unique at WARNING (one per conflict):")
        say(*(f"    {line}" for line in report.warnings))
    if report.surprises:
        say("", "NOT AS DOCUMENTED:", *(f"    {line}" for line in report.surprises))
    else:
        say("", "Every outcome above is the documented one.")
    say(f"Done in {report.seconds:.1f} s.")
