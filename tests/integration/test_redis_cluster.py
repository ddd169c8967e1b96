"""The Redis store on a real three-node Redis Cluster: the whole store contract, and keys
spread across the cluster's shards (``unique_key_spread = "key"``).

A cluster refuses any script that touches keys of two slots, so these tests
failing would show a layout or grouping mistake at once.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import redis.client
from celery import Celery

from celery_unique import (
    Disposition,
    UniqueTask,
    UnsupportedCombination,
    dispatch_many,
)
from celery_unique import config as unique_config
from celery_unique.exceptions import BackendUnavailable
from celery_unique.keys import keyspace
from celery_unique.stores import cleanup
from celery_unique.stores.base import Store, Verdict
from celery_unique.stores.redis import RedisStore
from celery_unique.testing import held_keys
from tests.conftest import in_ci
from tests.contract import test_store_contract as contract
from tests.processes import RedisCluster


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A three-master cluster of redis-server processes started for this module."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        message = "redis-server/redis-cli are not installed"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
        yield cluster.url()
    finally:
        cluster.stop()


@pytest.fixture
def store(cluster_url: str) -> Iterator[Store]:
    """The Redis store on the cluster, emptied before each test."""
    built = RedisStore.from_url(cluster_url)
    built.client.flushall()
    yield built
    built.close()


CONTRACT = [name for name in dir(contract) if name.startswith("test_")]


@pytest.mark.parametrize("name", CONTRACT)
def test_contract_on_redis_cluster(name: str, store: Store) -> None:
    """Each contract test holds on a Redis Cluster."""
    getattr(contract, name)(store)


# Keys spread across the shards ------------------------------------------------


def nodes_of(store: RedisStore, keys: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key in keys:
        name = store.client.get_node_from_key(key).name  # type: ignore[union-attr]
        counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many commands each pipeline sent to a node: one entry per round trip."""
    sent: list[int] = []
    execute = redis.client.Pipeline.execute

    def counted(self: redis.client.Pipeline, *args: object, **kwargs: object) -> object:
        sent.append(len(self.command_stack))
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counted)
    return sent


def test_spread_keys_fall_evenly_on_the_three_shards(store: RedisStore) -> None:
    """100,000 keys of one task: the busiest shard holds at most 1.2 times the quietest."""
    counts = nodes_of(store, [contract.spread(f"customer:{n}") for n in range(100_000)])
    assert len(counts) == 3
    assert max(counts.values()) / min(counts.values()) <= 1.2, counts


def test_a_batch_across_slots_takes_one_round_trip_per_shard(
    store: RedisStore, round_trips: list[int]
) -> None:
    """300 claims over three shards: one pipeline per shard, one script per slot."""
    keys = [contract.spread(f"k{n}") for n in range(200)]
    claims = [contract.synced(f"j{n}", key) for n, key in enumerate(keys)]
    claims += [contract.synced(f"dup{n}", keys[n]) for n in range(100)]
    decisions = store.decide(claims)
    assert len(decisions) == 300
    assert len(nodes_of(store, keys)) == 3
    assert len(round_trips) == 3
    assert sum(round_trips) == len({keyspace.hash_tag(key) for key in keys})


@pytest.fixture
def spread_app(cluster_url: str, store: RedisStore) -> Iterator[Celery]:
    """An app whose store is the cluster, with its keys spread."""
    app = Celery("spread", broker="memory://", set_as_current=False)
    app.conf.update(
        unique_backend=cluster_url,
        unique_key_spread="key",
        unique_namespace="spread",
        task_ignore_result=True,
    )
    yield app
    unique_config.reset(app)
    app.close()


def test_dispatches_spread_their_keys_over_every_shard(spread_app: Celery) -> None:
    """A task's keys land on all three shards; a task that declares a window key keeps
    both of its keys in its own slot; duplicates are reused, as without spreading."""

    @spread_app.task(base=UniqueTask, shared=False, name="tasks.sync", unique_key=lambda n: str(n))
    def sync(n: int) -> None:
        return None

    @spread_app.task(
        base=UniqueTask,
        shared=False,
        name="tasks.order",
        unique_key=lambda n: str(n),
        unique_window_key=lambda n: f"req-{n}",
        unique_window=60,
    )
    def order(n: int) -> None:
        return None

    receipts = dispatch_many([sync.s(n) for n in range(150)] + [sync.s(n) for n in range(50)])
    assert [r.disposition for r in receipts] == [Disposition.CREATED] * 150 + [
        Disposition.REUSED
    ] * 50
    assert sync.apply_async((7,)).id == receipts[7].id
    first, again = order.apply_async((1,)), order.apply_async((1,))
    assert again.id == first.id
    store = unique_config.runtime(spread_app).store
    assert isinstance(store, RedisStore)
    held = [h.key for h in held_keys(spread_app)]
    assert len(held) == 152
    assert len(nodes_of(store, held)) == 3
    assert {keyspace.hash_tag(k) for k in held if "tasks.order" in k} == {
        keyspace.task_tag("tasks.order")
    }


def test_a_window_key_given_to_a_task_spread_by_key_is_refused_before_any_write(
    spread_app: Celery,
) -> None:
    """Its two keys would sit in two slots: the dispatch is refused and nothing is held."""

    @spread_app.task(base=UniqueTask, shared=False, name="tasks.sync", unique_key=lambda n: str(n))
    def sync(n: int) -> None:
        return None

    with pytest.raises(UnsupportedCombination, match="two hash slots") as refused:
        sync.apply_async((1,), unique_window_key="req-1", unique_window=60)
    assert refused.value.code == "unsupported_combination"
    assert held_keys(spread_app) == []


def test_an_all_or_nothing_batch_refused_in_its_one_slot_leaves_earlier_holds_alone(
    store: Store,
) -> None:
    """The one script wrote nothing: the claims after its conflict, answered as created,
    are not rolled back (a rollback would end a hold the same job took before)."""
    store.decide([contract.windowed("w1", fp="fp1")])
    assert store.decide([contract.active("j1")])[0].verdict is Verdict.CREATED
    refused = store.decide([contract.windowed("w2", fp="fp2"), contract.active("j1")])
    assert refused[0].verdict is Verdict.CONFLICT
    held = store.get(contract.A)
    assert held is not None
    assert held.job_id == "j1"


def test_a_decision_the_cluster_did_not_answer_may_have_been_applied_and_is_undone(
    cluster_url: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis Cluster routes each command itself, so no connection names a request whose
    reply did not come: the error says the decision may have been applied, and an undo of
    its claims is owed (repeated for a while, as nothing tells when a late request lands:
    not here, so that nothing is owed to this cluster once the test is over)."""
    monkeypatch.setattr(cleanup, "UNDO_REPEATS_S", ())
    timed = RedisStore.from_url(f"{cluster_url}?socket_timeout=0.2")
    nodes = [redis.Redis(host=n.host, port=n.port) for n in timed.client.get_nodes()]
    try:
        warm = timed.decide([contract.active("warm", key=contract.B)])
        assert warm[0].verdict is Verdict.CREATED
        owed = cleanup.pending()
        for node in nodes:  # writes wait, longer than redis-py's retries: unpaused below
            node.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")
        with pytest.raises(BackendUnavailable) as lost:
            timed.decide([contract.active("lost")])
        assert lost.value.maybe_applied is True
        assert cleanup.pending() > owed, "no undo is owed for the lost decision"
        for node in nodes:
            node.execute_command("CLIENT", "UNPAUSE")
        assert cleanup.flush(10), "the undo never reached the cluster"
        assert store.get(contract.A) is None
    finally:
        cleanup.discard(timed)
        for node in nodes:
            node.execute_command("CLIENT", "UNPAUSE")
            node.close()
        timed.close()


def test_an_all_or_nothing_batch_refused_in_one_of_two_slots_rolls_the_other_back(
    store: Store,
) -> None:
    """Two slots, two scripts: the one refused wrote nothing, the other created its claim.
    All or nothing, so what the other slot created is rolled back."""
    other = contract.W.replace("{ns}", "{elsewhere}")
    assert store.decide([contract.windowed("w1", fp="fp1", key=other)])[0].verdict is (
        Verdict.CREATED
    )
    refused = store.decide([contract.active("j1"), contract.windowed("w2", fp="fp2", key=other)])
    assert refused[1].verdict is Verdict.CONFLICT
    assert store.get(contract.A) is None, "the claim the other slot created stayed held"
