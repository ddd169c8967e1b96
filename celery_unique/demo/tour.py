"""The whole tour: every scene in order on a fresh SQLite file, checked and printed."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from celery_unique.demo.expected import check
from celery_unique.demo.printing import render
from celery_unique.demo.report import Report
from celery_unique.demo.scenes import active_key_scopes, invalid_keys, payload_key, window_key
from celery_unique.demo.stage import SCOPES
from celery_unique.demo.worker import demo_running


def run(store_url: str) -> Report:
    """Run every scene against ``store_url``; return what happened."""
    started = time.monotonic()
    report = Report()
    with demo_running(store_url, report.warnings) as demo:
        for scope in SCOPES:
            report.scopes[scope], report.freed[scope] = active_key_scopes.play(demo, scope)
        payload_key.play(demo, report)
        window_key.play(demo, report)
        invalid_keys.play(demo, report)
    report.seconds = time.monotonic() - started
    check(report)
    return report


def main(out: TextIO | None = None) -> Report:
    """Run the tour on a fresh SQLite file, print it, and return the report."""
    out = out or sys.stdout
    workdir = Path(tempfile.mkdtemp(prefix="celery-unique-demo-"))
    store_url = f"sqlite:///{workdir / 'unique.db'}"
    try:
        report = run(store_url)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    render(report, store_url, out)
    return report
