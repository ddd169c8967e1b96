"""The Redis store on a three-shard Redis Cluster: where keys land, round trips, throughput.

Run by ``bench/run.py`` (or alone: ``python bench/cluster.py [--quick] [--redis URL]``);
prints one JSON object. It starts its own servers on loopback: a three-master
cluster and, for comparison, one standalone ``redis-server``.

* **distribution**: 100,000 keys of one task, laid out as dispatches lay them
  out with ``unique_key_spread = "key"``, counted per shard by the cluster's
  own slot map.
* **round trips**: requests this process sends for one created dispatch and
  for a ``dispatch_many`` of 1,000 (one pipeline to a node is one).
* **throughput**: three producer processes, started together, each making
  created dispatches (every key new) to the broker ``--redis`` names; the store
  is the standalone server ("one node"), the cluster with every key in the
  namespace's slot ("namespace", one shard does all the work) or the cluster
  with keys spread ("key"). Rows take turns within each round; medians.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
import redis.client
from celery import Celery
from redis.cluster import RedisCluster as ClusterClient

from celery_unique import UniqueTask, dispatch_many
from celery_unique import config as unique_config
from celery_unique.keys import keyspace
from tests.processes import RedisCluster, RedisServer, free_port

PRODUCERS = 3
BROKER_DB = 12


def _app(store_url: str, broker_url: str, spread: str) -> tuple[Celery, Any]:
    app = Celery("cluster-bench", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue="celery-unique-bench-cluster",
        task_ignore_result=True,
        unique_backend=store_url,
        unique_namespace="bench",
        unique_key_spread=spread,
    )

    @app.task(base=UniqueTask, shared=False, name="bench.sync", unique_key=lambda n: f"order:{n}")
    def sync(n: str) -> None:
        return None

    return app, sync


def distribution(cluster_url: str, keys: int) -> dict[str, int]:
    client = ClusterClient.from_url(cluster_url.replace("redis+cluster", "redis"))
    shards: Counter[str] = Counter()
    for n in range(keys):
        key = f"order:{n}"
        stored = keyspace.storage_key(
            "bench", keyspace.ACTIVE, "bench.sync", key, tag=keyspace.key_tag("bench.sync", key)
        )
        # redis-py leaves this method unannotated.
        shards[client.get_node_from_key(stored).name] += 1  # type: ignore[no-untyped-call]
    client.close()
    return dict(sorted(shards.items()))


def round_trips(cluster_url: str, broker_url: str) -> dict[str, int]:
    """Requests to the store for one created dispatch and for a batch of 1,000."""
    app, sync = _app(cluster_url, broker_url, "key")
    store = unique_config.runtime(app).store
    client = store.client  # type: ignore[attr-defined]
    sent: list[str] = []
    single, pipelined = client.execute_command, redis.client.Pipeline.execute

    def one(*args: Any, **kwargs: Any) -> Any:
        sent.append(str(args[0]))
        return single(*args, **kwargs)

    nodes = {node.port for node in client.get_nodes()}

    def many(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.connection_pool.connection_kwargs.get("port") in nodes:  # not the broker's
            sent.append("pipeline")
        return pipelined(self, *args, **kwargs)

    sync.apply_async(("warm-up",))  # connects, loads the script
    client.execute_command = one
    redis.client.Pipeline.execute = many  # type: ignore[method-assign]
    try:
        sync.apply_async(("single",))
        single_trips = len(sent)
        sent.clear()
        dispatch_many([sync.s(f"batch-{n}") for n in range(1000)])
        batch_trips = len(sent)
    finally:
        redis.client.Pipeline.execute = pipelined  # type: ignore[method-assign]
        client.execute_command = single
    unique_config.reset(app)
    return {"single dispatch": single_trips, "dispatch_many of 1,000": batch_trips}


def _produce(
    store_url: str, broker_url: str, spread: str, tag: str, count: int, start: Any, out: Any
) -> None:
    app, sync = _app(store_url, broker_url, spread)
    sync.apply_async((f"{tag}-warm-up",))
    start.wait()
    began = time.perf_counter()
    for n in range(count):
        sync.apply_async((f"{tag}-{n}",))
    out.put(time.perf_counter() - began)
    unique_config.reset(app)


def throughput(store_url: str, broker_url: str, spread: str, tag: str, count: int) -> float:
    """Dispatches per second of ``PRODUCERS`` processes started together."""
    start = multiprocessing.Barrier(PRODUCERS + 1)
    out: Any = multiprocessing.Queue()
    producers = [
        multiprocessing.Process(
            target=_produce,
            args=(store_url, broker_url, spread, f"{tag}-{p}", count, start, out),
        )
        for p in range(PRODUCERS)
    ]
    for producer in producers:
        producer.start()
    start.wait()
    began = time.perf_counter()
    for producer in producers:
        producer.join(timeout=600)
        if producer.exitcode != 0:
            raise RuntimeError(f"a producer failed (exit code {producer.exitcode})")
    elapsed = time.perf_counter() - began
    return PRODUCERS * count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    options = parser.parse_args()
    rounds, count = (2, 500) if options.quick else (5, 2000)
    broker_url = f"{options.redis.rstrip('/')}/{BROKER_DB}"
    multiprocessing.set_start_method("fork")
    with tempfile.TemporaryDirectory(prefix="celery-unique-cluster-") as folder:
        cluster = RedisCluster(Path(folder))
        single = RedisServer(free_port(), Path(folder))
        try:
            cluster.start()
            single.start()
            rows = {
                "one node": (single.url(0), "namespace"),
                "cluster, namespace": (cluster.url(), "namespace"),
                "cluster, key": (cluster.url(), "key"),
            }
            rates: dict[str, list[float]] = {name: [] for name in rows}
            for number in range(rounds):
                names = list(rows)
                names = names[number % len(names) :] + names[: number % len(names)]
                for name in names:
                    url, spread = rows[name]
                    tag = f"r{number}-{name.replace(' ', '').replace(',', '-')}"
                    rates[name].append(throughput(url, broker_url, spread, tag, count))
            shards = distribution(cluster.url(), 100_000)
            trips = round_trips(cluster.url(), broker_url)
        finally:
            cluster.stop()
            single.stop()
    flushed = redis.Redis.from_url(broker_url)
    flushed.flushdb()
    flushed.close()
    print(
        json.dumps(
            {
                "producers": PRODUCERS,
                "dispatches": PRODUCERS * count,
                "rounds": rounds,
                "throughput": {name: statistics.median(v) for name, v in rates.items()},
                "distribution": shards,
                "round_trips": trips,
            }
        )
    )


if __name__ == "__main__":
    main()
