"""Randomized runs under injected faults, checked: none on the library, some on a broken store.

Each run is real processes on loopback (see :mod:`tests.history.chaos`):
two prefork worker nodes, three producers, the store behind a fault proxy,
durable store and broker servers, and faults injected at random from a fixed
seed. The long run (``scripts/chaos --minutes 30``) is the same thing, longer;
its figures are in ``docs/reliability.md``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.history.broken import OVERRIDE as BROKEN_STORE
from tests.history.chaos import Config, Outcome, render, run
from tests.processes import require_redis_server

pytestmark = [pytest.mark.slow, pytest.mark.alone]

#: Seconds of faults per CI run: three seeds on a Redis broker (one of them with store
#: and broker on one server), then one on RabbitMQ.
SECONDS = 12.0


def play(config: Config) -> Outcome:
    require_redis_server()
    outcome = run(config)
    print(f"\n{render(outcome)}")
    return outcome


@pytest.mark.parametrize("seed", [11, 12])
def test_no_violation_under_random_faults_on_redis(seed: int, tmp_path: Path) -> None:
    """Dispatches, runs and releases under child and node kills, store and broker faults: clean."""
    outcome = play(Config(seconds=SECONDS, seed=seed, directory=tmp_path))
    assert outcome.report.counts["created"] > 20, "the run did too little to prove anything"
    assert sum(outcome.faults.values()) >= 7
    assert outcome.ok, outcome.failures()


def test_no_violation_with_store_and_broker_on_one_server(tmp_path: Path) -> None:
    """The broker is the store's server behind the same proxy: its faults hit both, and a
    created job's decision carries its message (one script)."""
    outcome = play(Config(seconds=SECONDS, seed=14, broker="colocated", directory=tmp_path))
    assert outcome.report.counts["created"] > 20
    assert outcome.ok, outcome.failures()


@pytest.mark.rabbitmq
def test_no_violation_under_random_faults_on_rabbitmq(tmp_path: Path) -> None:
    """The same with RabbitMQ as the broker: a node of the run's own (own port, data and
    name), restarted with ``rabbitmqctl stop_app``/``start_app``; the machine's broker is
    never touched."""
    outcome = play(Config(seconds=SECONDS, seed=21, broker="rabbitmq", directory=tmp_path))
    assert outcome.report.counts["created"] > 20
    assert outcome.ok, outcome.failures()


def test_the_checker_catches_a_store_that_forgets_held_keys(tmp_path: Path) -> None:
    """Against a store that now and then forgets a held key, two jobs of one key run at once."""
    outcome = play(
        Config(seconds=SECONDS, seed=31, directory=tmp_path, store_override=BROKEN_STORE)
    )
    assert outcome.report.by_invariant()["I1"] > 0
