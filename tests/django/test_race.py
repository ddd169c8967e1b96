"""Eight OS processes dispatch one key at the same instant: exactly one job per round.

Every round uses a key nobody holds yet, the hard case for a database: there
is no row to lock until someone inserts it. The children are spawned (fresh
interpreters), configure the example project on the parent's test database
and dispatch through ``apply_async``; a barrier releases them together.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pytest
from django.db import connections

from celery_unique.keys import keyspace
from celery_unique.stores import open_store
from tests.django._race_child import Race, Report, run
from tests.django.conftest import database_params, require_database
from tests.spawned import run_in_processes

PROCESSES = 8
ROUNDS = 25
RACE_TIMEOUT_S = 240


def race(kind: str, alias: str) -> tuple[Race, list[Report]]:
    """Run the race; the children's reports."""
    databases = {"default": dict(connections["default"].settings_dict)}
    databases[alias] = dict(connections[alias].settings_dict)
    spec = Race(kind, alias, databases, f"race-{uuid.uuid4().hex[:12]}", ROUNDS)
    reports: list[Report] = run_in_processes(run, spec, PROCESSES, RACE_TIMEOUT_S)
    errors = [f"child {report.child}:\n{report.error}" for report in reports if report.error]
    assert not errors, "\n".join(errors)
    return spec, reports


def by_round(reports: list[Report]) -> dict[int, list[tuple[int, str, str | None]]]:
    rounds: dict[int, list[tuple[int, str, str | None]]] = {}
    for report in reports:
        assert len(report.outcomes) == ROUNDS
        for number, outcome, job_id in report.outcomes:
            rounds.setdefault(number, []).append((report.child, outcome, job_id))
    return rounds


def held_keys(spec: Race) -> dict[str, str]:
    """Storage key -> job id of every key the race left in the store."""
    store = open_store(f"django://{spec.alias}")
    try:
        prefix = keyspace.namespace_prefix(spec.namespace)
        return {held.key: held.job_id for held in store.scan(prefix=prefix)}
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.parametrize("alias", database_params(transaction=True))
def test_active_key_race_creates_one_job_per_round(alias: str) -> None:
    """Per round: one CREATED, published once; seven REUSED with its job id; one key row."""
    require_database(alias)
    spec, reports = race("active", alias)

    winners: list[str] = []
    tally: Counter[str] = Counter()
    for number, outcomes in sorted(by_round(reports).items()):
        created = [job for _, outcome, job in outcomes if outcome == "created"]
        assert len(created) == 1, f"round {number}: {outcomes}"
        winners.append(str(created[0]))
        tally.update(outcome for _, outcome, _ in outcomes)
        assert {job for _, _, job in outcomes} == {created[0]}, f"round {number}: {outcomes}"
    assert tally == {"created": ROUNDS, "reused": ROUNDS * (PROCESSES - 1)}
    published = Counter(job for report in reports for job in report.published)
    assert published == Counter(winners)
    assert sorted(held_keys(spec).values()) == sorted(winners)


@pytest.mark.slow
@pytest.mark.parametrize("alias", database_params(transaction=True))
def test_window_key_race_of_two_requests_creates_one_job_per_round(alias: str) -> None:
    """Per round: one CREATED; its twins REUSED, the other request's senders conflict."""
    require_database(alias)
    spec, reports = race("window", alias)

    winners: list[str] = []
    for number, outcomes in sorted(by_round(reports).items()):
        created = [(child, job) for child, outcome, job in outcomes if outcome == "created"]
        assert len(created) == 1, f"round {number}: {outcomes}"
        winner, job_id = created[0]
        winners.append(str(job_id))
        for child, outcome, job in outcomes:
            if child == winner:
                continue
            expected: Any = (
                ("reused", job_id) if child % 2 == winner % 2 else ("uniqueness_conflict", None)
            )
            assert (outcome, job) == expected, f"round {number}: {outcomes}"
    published = Counter(job for report in reports for job in report.published)
    assert published == Counter(winners)
    assert sorted(held_keys(spec).values()) == sorted(winners)
