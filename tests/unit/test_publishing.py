"""The publish gate: a job leaves only on a decision that lets it out."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_unique import config as unique_config
from celery_unique.dispatch.gate import Gate
from celery_unique.stores.base import Claim


class Refused(Exception):
    """A store error the gate does not know (not a coded one)."""


def refuse() -> None:
    raise Refused


def test_a_gate_whose_decision_failed_never_lets_its_job_out(app: Celery) -> None:
    """A retried publish (kombu retries a failed put) finds the failure again, never a way
    out: the gate is not "resolved" with no decision."""
    gate = Gate("job", unique_config.runtime(app), None, claim=Claim("job", "task"))
    with pytest.raises(Refused):
        gate.let_out(refuse)  # type: ignore[arg-type]
    for _ in range(2):
        with pytest.raises(Refused):
            gate.let_out()
    assert not gate.passed
    assert not gate.created()
