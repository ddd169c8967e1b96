"""Processes racing on one key: one job is created and published, never two.

Eight spawned OS processes, each with its own Celery app and store
connection, dispatch the same key at the same instant (a barrier releases
them together), round after round with a fresh key each round. The store is
Redis (db 9) or a SQLite file; the broker is Redis (db 10) on a queue no
worker consumes, so every published message stays in the queue's Redis list
and the test reads exactly what was published.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import fresh_queue_name
from tests.integration._race_worker import Outcome, Race, payload_of, run
from tests.spawned import run_in_processes

pytestmark = pytest.mark.redis

PROCESSES = 8
ACTIVE_ROUNDS = 50
WINDOW_ROUNDS = 25
#: How long the test waits for all children to report (seconds); generous on 2 cores.
RACE_TIMEOUT_S = 120
#: kombu's Redis transport keeps priority ``p > 0`` messages in ``<queue>\x06\x16<p>``.
_PRIORITY_SEPARATOR = "\x06\x16"
_PRIORITY_STEPS = (0, 3, 6, 9)


def queue_lists(queue: str) -> list[str]:
    """The Redis lists kombu keeps one queue's messages in (one per priority step)."""
    return [
        queue if step == 0 else f"{queue}{_PRIORITY_SEPARATOR}{step}" for step in _PRIORITY_STEPS
    ]


def queued_messages(client: Any, queue: str) -> list[dict[str, Any]]:
    """Every message waiting in ``queue`` on the Redis broker, decoded."""
    raw = [item for name in queue_lists(queue) for item in client.lrange(name, 0, -1)]
    return [json.loads(item) for item in raw]


@pytest.fixture
def broker_queue(celery_redis_url: str) -> Iterator[tuple[Any, str]]:
    """A Redis client on the broker's database and a queue name no worker consumes."""
    client = redis.Redis.from_url(celery_redis_url)
    queue = fresh_queue_name()
    yield client, queue
    client.delete(*queue_lists(queue), f"_kombu.binding.{queue}")
    client.close()


@pytest.fixture(params=["redis", "sqlite"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The store every racing process opens: Redis db 9, or one SQLite file."""
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return f"sqlite:///{tmp_path / 'unique.db'}"


def race(kind: str, queue: str, store_url: str, rounds: int) -> list[list[Outcome]]:
    """Run ``rounds`` rounds of ``PROCESSES`` processes; the outcomes, grouped by round."""
    spec = Race(
        kind=kind,
        queue=queue,
        store_url=store_url,
        namespace=f"race-{uuid.uuid4().hex}",
        rounds=rounds,
    )
    reports = run_in_processes(run, spec, PROCESSES, RACE_TIMEOUT_S)
    errors = [f"child {child}:\n{error}" for child, _, error in reports if error]
    assert not errors, "\n".join(errors)
    by_round: list[list[Outcome]] = [[] for _ in range(rounds)]
    for _, outcomes, _ in reports:
        assert len(outcomes) == rounds
        for outcome in outcomes:
            by_round[outcome.round].append(outcome)
    return by_round


#: What a losing dispatch should have seen: ``(result, match, job id, conflicting job id)``.
Seen = tuple[str, "str | None", "str | None", "str | None"]


def judge(
    rounds: list[list[Outcome]], expected: Callable[[Outcome, Outcome], Seen]
) -> tuple[Counter[str], dict[str, Outcome]]:
    """Check each round: one job created, every other outcome as ``expected(it, winner)`` says.

    Returns the tally of results and each round's winner by job id.
    """
    tally: Counter[str] = Counter()
    winners: dict[str, Outcome] = {}
    for outcomes in rounds:
        assert len(outcomes) == PROCESSES
        created = [o for o in outcomes if o.result == "created"]
        assert len(created) == 1, f"round {outcomes[0].round}: {len(created)} jobs created"
        first = created[0]
        assert first.job_id is not None
        winners[first.job_id] = first
        for outcome in outcomes:
            tally[outcome.result] += 1
            seen = (outcome.result, outcome.match, outcome.job_id, outcome.conflicting_job_id)
            if outcome is not first:
                assert seen == expected(outcome, first), outcome
    return tally, winners


def published_once(client: Any, queue: str, winners: dict[str, Outcome]) -> list[dict[str, Any]]:
    """The queue's messages, checked to be exactly one per round, each the round's winner."""
    assert sum(client.llen(name) for name in queue_lists(queue)) == len(winners)
    messages = queued_messages(client, queue)
    published = Counter(message["headers"]["id"] for message in messages)
    assert published == Counter(dict.fromkeys(winners, 1))
    return messages


def test_active_key_race_creates_and_publishes_one_job_per_round(
    broker_queue: tuple[Any, str], store_url: str
) -> None:
    """Eight processes dispatching one active key at once: one job CREATED and published."""
    client, queue = broker_queue
    rounds = race("active", queue, store_url, ACTIVE_ROUNDS)

    tally, winners = judge(rounds, lambda _, first: ("reused", "active", first.job_id, None))
    for message in published_once(client, queue, winners):
        # The message carries the winner's own arguments: the losers' were discarded.
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        assert args == [winners[message["headers"]["id"]].child]
    assert tally == {"created": ACTIVE_ROUNDS, "reused": ACTIVE_ROUNDS * (PROCESSES - 1)}


def test_window_key_race_with_two_requests_publishes_one_job_per_round(
    broker_queue: tuple[Any, str], store_url: str
) -> None:
    """Two requests racing on one window key: one job; its twins REUSED, the others conflict."""
    client, queue = broker_queue
    rounds = race("window", queue, store_url, WINDOW_ROUNDS)

    def expected(outcome: Outcome, first: Outcome) -> Seen:
        if payload_of(outcome.child) == payload_of(first.child):
            return ("reused", "window", first.job_id, None)
        return ("uniqueness_conflict", None, None, first.job_id)

    tally, winners = judge(rounds, expected)
    published_once(client, queue, winners)
    half = PROCESSES // 2
    assert tally == {
        "created": WINDOW_ROUNDS,
        "reused": WINDOW_ROUNDS * (half - 1),
        "uniqueness_conflict": WINDOW_ROUNDS * half,
    }
