"""Dispatch overhead of celery-unique against plain apply_async, celery-once and celery-singleton.

Run: ``python bench/run.py [--quick] [--redis redis://127.0.0.1:6379] [--json PATH]``.

One run, one Redis server: broker in db 12, stores in db 13 (and 14 for the
million-key latency comparison); the benchmark flushes those databases itself.
Rows are timed in interleaved rounds: within a round the rows take turns in
blocks of 100 dispatches (order rotated), so a busy moment of the machine hits
every row alike; each row reports the median over rounds, and its ratio is the
median of per-round ratios against plain ``apply_async`` in the same round.
Round trips are counted, not assumed: redis-py's sends per database in this
process, cross-checked with the server's ``MONITOR`` feed. See
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import harness
from celery import Task
from harness import BROKER_DB, FULL_STORE_DB, QUEUE, TENANT, Bench, fresh

import celery_unique
from celery_unique import Disposition
from celery_unique.config import runtime
from celery_unique.dispatch import colocated

DEFAULT_JSON = "/tmp/celery-unique-bench/latest.json"


@dataclass(frozen=True)
class Profile:
    rounds: int
    dispatches: int
    #: Dispatches a row makes before the next row takes its turn.
    block: int
    warmup: int
    batch: int
    batch_rounds: int
    held_keys: int
    memory_keys: int
    latency_samples: int
    hash_rounds: int


FULL = Profile(
    rounds=7,
    dispatches=2000,
    block=100,
    warmup=200,
    batch=1000,
    batch_rounds=5,
    held_keys=1_000_000,
    memory_keys=100_000,
    latency_samples=2000,
    hash_rounds=15,
)
QUICK = Profile(
    rounds=3,
    dispatches=300,
    block=100,
    warmup=100,
    batch=1000,
    batch_rounds=2,
    held_keys=100_000,
    # As many as the full run: growth per key includes the hash tables' buckets,
    # whose share of each key depends on how many keys there are.
    memory_keys=100_000,
    latency_samples=400,
    hash_rounds=5,
)


@dataclass
class Row:
    key: str
    label: str
    dispatch: Callable[[], Any]
    check: Callable[[Any], bool]
    #: Keys the row leaves held before its timed dispatches (the reused row's holder).
    setup: Callable[[], object] | None = None
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    store_rt: float = 0.0
    broker_rt: float = 0.0
    published: float = 0.0


def created(result: Any) -> bool:
    return getattr(result, "disposition", None) is Disposition.CREATED


def rows_for(bench: Bench) -> list[Row]:
    t = bench.tasks

    def literal() -> Any:
        n = fresh()
        return t.literal.apply_async((TENANT, n), unique_key=f"k{n}")

    return [
        Row("plain", "plain apply_async", lambda: t.plain.apply_async((TENANT, fresh())),
            lambda r: r.id is not None),
        Row("selector", "unique created: selector key", lambda: t.selector.apply_async(
            (TENANT, fresh())), created),
        Row("separate", "unique created: store asked first (colocated off)",
            each(t.separate), created),
        Row("literal", "unique created: apply_async(unique_key=...)", literal, created),
        Row("reused", "unique reused (key held, no publish)",
            lambda: t.held.apply_async((TENANT, fresh())),
            lambda r: getattr(r, "disposition", None) is Disposition.REUSED,
            setup=lambda: t.held.apply_async((TENANT, -1))),
        Row("window", "unique created: window key", lambda: t.window.apply_async(
            (TENANT, fresh())), created),
        Row("payload", "unique created: Payload() key", lambda: t.payload.apply_async(
            (TENANT, fresh())), created),
        Row("latest", "unique created: on_duplicate=latest", each(t.latest), created),
        Row("debounce", "unique created: on_duplicate=debounce", each(t.debounce), created),
        Row("countdown", "plain apply_async(countdown=60)", lambda: t.plain.apply_async(
            (TENANT, fresh()), countdown=60), lambda r: r.id is not None),
        Row("latest_reused", "unique reused: latest (arguments stored)", each(t.held_latest),
            lambda r: getattr(r, "arguments_replaced", False),
            setup=lambda: t.held_latest.apply_async((TENANT, -1))),
        Row("debounce_reused", "unique reused: debounce (start moved)", each(t.held_debounce),
            lambda r: getattr(r, "postponed_to", None) is not None and r.duplicate,
            setup=lambda: t.held_debounce.apply_async((TENANT, -1))),
        Row("once", "celery-once QueueOnce", lambda: t.once.apply_async((TENANT, fresh())),
            lambda r: r.id is not None),
        Row("singleton", "celery-singleton Singleton",
            lambda: t.singleton.apply_async((TENANT, fresh())), lambda r: r.id is not None),
    ]  # fmt: skip


def prepare(bench: Bench, *setups: Callable[[], object] | None) -> None:
    """Empty queue and store, then create what the rows need held (the reused row's key)."""
    harness.reset_broker(bench)
    bench.store.flushdb()
    for setup in setups:
        if setup is not None:
            setup()
    gc.collect()


def each(task: Any) -> Callable[[], Any]:
    """One dispatch of ``task`` with a fresh ``n``."""
    return lambda: task.apply_async((TENANT, fresh()))


def repeat(dispatch: Callable[[], Any], count: int) -> Any:
    result = None
    for _ in range(count):
        result = dispatch()
    return result


def measure_rows(bench: Bench, profile: Profile, say: Callable[[str], None]) -> list[Row]:
    rows = rows_for(bench)
    for row in rows:
        prepare(bench, row.setup)
        repeat(row.dispatch, profile.warmup)
        prepare(bench, row.setup)
        before = bench.broker.llen(QUEUE)
        with harness.RoundTrips() as trips:
            last = repeat(row.dispatch, profile.warmup)
        if not row.check(last):
            raise SystemExit(f"{row.label}: unexpected result {last!r}")
        row.store_rt = trips.counts[bench.store_db] / profile.warmup
        row.broker_rt = trips.counts[BROKER_DB] / profile.warmup
        row.published = (bench.broker.llen(QUEUE) - before) / profile.warmup
    block = min(profile.block, profile.dispatches)
    for number in range(profile.rounds):
        prepare(bench, *(row.setup for row in rows))
        spent = dict.fromkeys(range(len(rows)), 0.0)
        cpu = dict.fromkeys(range(len(rows)), 0.0)
        # Rows take turns in short blocks, so a busy moment of the machine is shared.
        for turn in range(profile.dispatches // block):
            shift = (number + turn) % len(rows)
            for index in [*range(shift, len(rows)), *range(shift)]:
                dispatch = rows[index].dispatch
                wall, used = harness.timed_cpu(partial(repeat, dispatch, block))
                spent[index] += wall
                cpu[index] += used
        for index, row in enumerate(rows):
            row.seconds.append(spent[index])
            row.cpu_seconds.append(cpu[index])
            row.ratios.append(spent[0] / spent[index])
        say(f"  round {number + 1}/{profile.rounds} done")
    return rows


def measure_monitor(bench: Bench, base_url: str, rows: list[Row], sample: int) -> dict[str, Any]:
    """Server-side count of client commands per dispatch, per database (MONITOR)."""
    out: dict[str, Any] = {}
    for row in rows:
        prepare(bench, row.setup)
        counts = harness.monitor_commands(
            base_url, partial(repeat, row.dispatch, sample), (BROKER_DB, bench.store_db)
        )
        out[row.key] = {
            "store_commands": counts[bench.store_db] / sample,
            "broker_commands": counts[BROKER_DB] / sample,
        }
    return out


def measure_batch(bench: Bench, profile: Profile) -> dict[str, Any]:
    dispatch_many = getattr(celery_unique, "dispatch_many", None)
    if dispatch_many is None:
        return {"available": False}
    task = bench.tasks.selector
    size = profile.batch

    def batch() -> Any:
        return dispatch_many([task.s(TENANT, fresh()) for _ in range(size)])

    def singles() -> Any:
        return repeat(lambda: task.apply_async((TENANT, fresh())), size)

    plain = bench.tasks.plain

    def plain_singles() -> Any:
        return repeat(lambda: plain.apply_async((TENANT, fresh())), size)

    def plain_batch() -> Any:
        # The ceiling: Celery's own apply_async for every item, inside the kombu
        # publish batch dispatch_many uses, and nothing else.
        with bench.app.producer_or_acquire() as producer, producer.batch(2**31 - 1):
            return repeat(
                lambda: Task.apply_async(plain, (TENANT, fresh()), producer=producer), size
            )

    def celery_alone() -> bool:
        # A unique batch's floor: Celery's own apply_async of every item, its message
        # noted where kombu would push it, as dispatch_many does, and none of the
        # library's work for the item (keys, decision, receipt).
        with bench.app.producer_or_acquire() as producer:
            # Only a hooked channel notes messages: store and broker on one server.
            if colocated.broker_db(producer.channel, runtime(bench.app)) is None:
                return False
            with colocated.capturing() as noted:
                repeat(lambda: Task.apply_async(task, (TENANT, fresh()), producer=producer), size)
        return len(noted) == size

    try:
        prepare(bench)
        batch()
        notes = celery_alone()
        prepare(bench)
        with harness.RoundTrips() as trips:
            results = batch()
        if not all(created(result) for result in results):
            return {"available": True, "error": "dispatch_many did not create every job"}
        single_s, batch_s, ratios, plain_ratios, bounds = [], [], [], [], []
        for _ in range(profile.batch_rounds):
            prepare(bench)
            single_s.append(harness.timed(singles))
            prepare(bench)
            batch_s.append(harness.timed(batch))
            ratios.append(single_s[-1] / batch_s[-1])
            if notes:
                prepare(bench)
                bounds.append(single_s[-1] / harness.timed(celery_alone))
            prepare(bench)
            plain_single_s = harness.timed(plain_singles)
            prepare(bench)
            plain_ratios.append(plain_single_s / harness.timed(plain_batch))
    except Exception as exc:  # report, do not hide the other rows
        return {"available": True, "error": f"{type(exc).__name__}: {exc}"}
    return {
        "available": True,
        "items": size,
        "single_per_s": size / harness.median(single_s),
        "batch_per_s": size / harness.median(batch_s),
        "ratio": harness.median(ratios),
        "plain_ratio": harness.median(plain_ratios),
        "bound": harness.median(bounds) if bounds else None,
        "store_round_trips": trips.counts[bench.store_db],
        "broker_round_trips": trips.counts[BROKER_DB],
    }


def bound(batch: dict[str, Any]) -> str:
    """The batch's floor as a ratio, where the store and the broker share a server."""
    return "n/a" if batch["bound"] is None else f"{batch['bound']:.2f}x"


def template(bench: Bench, dispatch: Callable[[], Any]) -> tuple[bytes, bytes, int]:
    """A key written by a real dispatch: its storage key, value and TTL."""
    bench.store.flushdb()
    dispatch()
    (key,) = bench.store.keys("*")
    value, ttl = bench.store.get(key), bench.store.pttl(key)
    if not (isinstance(key, bytes) and isinstance(value, bytes)):
        raise SystemExit(f"unexpected store contents: {key!r} = {value!r}")
    return key, value, ttl


def measure_memory(bench: Bench, base_url: str, profile: Profile) -> dict[str, Any]:
    """Bytes per held key: MEMORY USAGE of real keys, and used_memory growth over many."""
    store, t = bench.store, bench.tasks
    out: dict[str, Any] = {}
    kinds = (
        ("active", t.selector, "order"),
        ("window", t.window, "request"),
        (f"active, {len(t.long_name.name)}-char task name", t.long_name, "order"),
    )
    for kind, task, tag in kinds:
        sample_key, value, ttl = template(bench, partial(task.apply_async, (TENANT, 0)))
        prepare(bench)
        repeat(each(task), 200)
        usages = [store.memory_usage(key, samples=0) or 0 for key in store.keys("*")]
        deltas = []
        for _ in range(3):
            store.flushdb()
            before = store.info("memory")["used_memory"]
            count = harness.bulk_set(
                base_url,
                bench.store_db,
                harness.like(sample_key, value, ttl, profile.memory_keys, tag),
            )
            deltas.append((store.info("memory")["used_memory"] - before) / count)
        loaded = [store.memory_usage(key, samples=0) or 0 for key in store.scan(count=500)[1][:200]]
        store.flushdb()
        out[kind] = {
            "key_bytes": len(sample_key),
            "value_bytes": len(value),
            "memory_usage_median": harness.median(usages),
            "memory_usage_max": max(usages),
            "memory_usage_loaded_median": harness.median(loaded) if loaded else None,
            "used_memory_per_key": harness.median(deltas),
            "keys_loaded": profile.memory_keys,
        }
    return out


def measure_latency(
    bench: Bench, full: Bench, base_url: str, profile: Profile, say: Callable[[str], None]
) -> dict[str, Any]:
    """Single-dispatch latency, empty store vs one holding ``held_keys`` keys, interleaved."""
    key, value, ttl = template(full, lambda: full.tasks.selector.apply_async((TENANT, -1)))
    full.store.flushdb()
    started = time.perf_counter()
    loaded = harness.bulk_set(
        base_url, FULL_STORE_DB, harness.like(key, value, ttl, profile.held_keys, "bulk")
    )
    load_s = time.perf_counter() - started
    say(f"  loaded {loaded:,} keys in {load_s:.1f} s")
    held = full.store.dbsize()
    prepare(bench)
    harness.reset_broker(full)
    samples: dict[str, list[float]] = {"empty": [], "full": []}
    targets = {"empty": bench.tasks.selector, "full": full.tasks.selector}
    for task in targets.values():  # warm both connections
        repeat(each(task), 50)
    perf = time.perf_counter_ns
    for _ in range(max(1, profile.latency_samples // 100)):
        for name, task in targets.items():
            out = samples[name]
            for _ in range(100):
                n = fresh()
                started_ns = perf()
                task.apply_async((TENANT, n))
                out.append((perf() - started_ns) / 1000)
        harness.reset_broker(bench)
    full.store.flushdb()
    bench.store.flushdb()
    return {
        "held_keys": held,
        "load_seconds": load_s,
        **{
            name: {
                "median_us": harness.median(values),
                "p99_us": harness.percentile(values, 0.99),
                "samples": len(values),
            }
            for name, values in samples.items()
        },
    }


def measure_hashing(rounds: int) -> dict[str, Any]:
    import hashlib
    import json as std_json

    import hashing

    from celery_unique import Payload

    payload = hashing.build_payload()
    whole = Payload()
    baseline, key, ratio = hashing.compare(
        lambda: hashlib.sha256(std_json.dumps(payload).encode()).hexdigest(),
        lambda: whole.key(payload, "orders.import"),
        rounds,
    )
    return {
        "payload_bytes": len(std_json.dumps(payload).encode()),
        "baseline_ms": baseline * 1e3,
        "payload_key_ms": key * 1e3,
        "ratio": ratio,
    }


#: The concurrency rows: mode, producers.
CONCURRENCY = (("threads", 8), ("gevent", 200))


def run_script(name: str, *args: str) -> dict[str, Any]:
    """What ``bench/<name>`` prints as JSON, run in a process of its own; or its error."""
    script = Path(__file__).resolve().parent / name
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["failed"]}
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def measure_concurrency(base_url: str, quick: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """Each mode run by ``bench/concurrency.py`` in a process of its own (gevent patches it)."""
    out: dict[str, Any] = {}
    for mode, workers in CONCURRENCY:
        say(f"concurrency: {workers} {mode}")
        out[mode] = run_script(
            "concurrency.py", "--mode", mode, "--workers", str(workers), "--redis", base_url,
            *(["--quick"] if quick else []),
        )  # fmt: skip
    return out


def verdicts(report: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """Each §16 target with what was measured and whether it is met (None: not measured)."""
    rows = report["rows"]
    created_rows = ("selector", "literal", "window", "payload")
    selector = rows["selector"]["ratio"]
    worst = min(rows[key]["ratio"] for key in created_rows)
    once, single = rows["once"]["per_s"], rows["singleton"]["per_s"]
    followed = ("latest", "debounce", "latest_reused", "debounce_reused")
    trips = {rows[key]["store_rt"] for key in (*created_rows, "separate", "reused", *followed)}
    separate = rows["separate"]["ratio"]
    colocated = all(rows[key]["broker_rt"] == 0 for key in created_rows)
    batch = report["dispatch_many"]
    memory, latency, hashing = report["memory"], report["latency"], report["hashing"]
    out: list[tuple[str, str, bool | None]] = [
        ("1 store round trip per unique dispatch",
         "/".join(f"{value:g}" for value in sorted(trips)), trips == {1.0}),
        ("store and broker one server: created in 1 round trip in all",
         "yes" if colocated else "no", colocated),
        ("created >= 0.90x plain (store and broker one server)",
         f"selector {selector:.2f}x (lowest created row {worst:.2f}x)", worst >= 0.9),
        ("created >= 0.80x plain (store asked first)", f"{separate:.2f}x", separate >= 0.8),
        ("created ahead of celery-once and celery-singleton",
         f"{rows['selector']['per_s']:,.0f} vs {once:,.0f} and {single:,.0f} /s",
         all(rows[key]["per_s"] > max(once, single) for key in created_rows)),
        ("reused >= 2.5x plain", f"{rows['reused']['ratio']:.2f}x",
         rows["reused"]["ratio"] >= 2.5),
    ]  # fmt: skip
    if batch.get("available") and "error" not in batch:
        out += [
            ("dispatch_many(1000): store and broker one server: 1 round trip in all",
             f"{batch['store_round_trips']} store + {batch['broker_round_trips']} broker",
             batch["store_round_trips"] + batch["broker_round_trips"] == 1),
            ("dispatch_many(1000): >= 3x 1000 single dispatches",
             f"{batch['ratio']:.2f}x (Celery's part alone: {bound(batch)})",
             batch["ratio"] >= 3),
        ]  # fmt: skip
    else:
        note = batch.get("error", "not available")
        out += [(f"dispatch_many(1000): {what}", note, None) for what in ("round trips", "3x")]
    for mode, workers in CONCURRENCY:
        measured = report["concurrency"].get(mode, {})
        what = f"{workers} {mode}: created >= 0.85x plain, ahead of celery-once and -singleton"
        if "rows" not in measured:
            out.append((what, str(measured.get("error", "not measured")), None))
            continue
        cells = measured["rows"]
        mine = cells["selector"]
        peers = [cells[key] for key in ("once", "singleton")]
        out.append(
            (what, f"{mine['ratio']:.2f}x; {mine['per_s']:,.0f} vs "
             + " and ".join(f"{peer['per_s']:,.0f}" for peer in peers) + " /s",
             mine["ratio"] >= 0.85 and mine["failed"] == 0
             and all(mine["per_s"] > peer["per_s"] for peer in peers))
        )  # fmt: skip
    cluster = report["cluster"]
    if "error" in cluster:
        out += [(f"Redis Cluster: {what}", str(cluster["error"]), None)
                for what in ("keys spread", "round trips")]  # fmt: skip
    else:
        shards = cluster["distribution"].values()
        spread = max(shards) / min(shards)
        trips = cluster["round_trips"]
        out += [
            ("Redis Cluster: 100,000 keys over 3 shards, max/min <= 1.2", f"{spread:.3f}",
             len(shards) == 3 and spread <= 1.2),
            ("Redis Cluster: 1 round trip per dispatch, <= 1 per shard per dispatch_many(1000)",
             f"{trips['single dispatch']} and {trips['dispatch_many of 1,000']}",
             trips["single dispatch"] == 1 and trips["dispatch_many of 1,000"] <= 3),
        ]  # fmt: skip
    flat = latency["full"]["median_us"] / latency["empty"]["median_us"]
    out.append(
        ("hashing 1 MiB: Payload().key <= 2x json.dumps+sha256", f"{hashing['ratio']:.2f}x",
         hashing["ratio"] <= 2)
    )  # fmt: skip
    for kind, held in memory.items():
        limit = 320 if kind.startswith("window") else 256
        worst = max(held["memory_usage_median"], held["used_memory_per_key"])
        out.append(
            (f"memory per {kind} key <= {limit} B",
             f"{held['memory_usage_median']:.0f} B (MEMORY USAGE), "
             f"{held['used_memory_per_key']:.0f} B (used_memory growth)", worst <= limit)
        )  # fmt: skip
    out.append(
        (f"latency flat 0 -> {latency['held_keys']:,} keys (median within 10%)",
         f"{flat:.2f}x", flat <= 1.10)
    )  # fmt: skip
    return out


def print_report(report: dict[str, Any]) -> None:
    m = report["machine"]
    print()
    print(
        f"machine: {m['cores']} cores ({m['cpu']}), {m['os']}, Python {m['python']}, "
        f"Redis {m['redis_server']} on loopback; celery {m['celery']}, kombu {m['kombu']}, "
        f"redis-py {m['redis_py']} ({m['redis_parser']} parser); load average at start "
        f"{m['load_average']}, at end {report['load_average_end']}"
    )
    p = report["profile"]
    print(
        f"{p['rounds']} rounds x {p['dispatches']:,} dispatches per row (after "
        f"{p['warmup']} warm-up); medians; ratio = median of per-round ratios to plain"
    )
    print()
    header = (
        f"{'row':<46} {'disp/s':>8} {'us/disp':>8} {'CPU us':>7} {'x plain':>8} {'store RT':>9} "
        f"{'broker RT':>10} {'published':>10} {'store cmds':>11}"
    )
    print(header)
    print("-" * len(header))
    for row in report["rows"].values():
        monitor = report["monitor"].get(row["key"], {})
        print(
            f"{row['label']:<46} {row['per_s']:>8,.0f} {row['us']:>8.0f} {row['cpu_us']:>7.0f} "
            f"{row['ratio']:>8.2f} "
            f"{row['store_rt']:>9.2f} {row['broker_rt']:>10.2f} {row['published']:>10.2f} "
            f"{monitor.get('store_commands', float('nan')):>11.2f}"
        )
    batch = report["dispatch_many"]
    print()
    if not batch.get("available"):
        print("dispatch_many: not available (celery_unique.dispatch_many does not exist)")
    elif "error" in batch:
        print(f"dispatch_many: failed: {batch['error']}")
    else:
        print(
            f"dispatch_many of {batch['items']:,}: {batch['batch_per_s']:,.0f} items/s vs "
            f"{batch['single_per_s']:,.0f}/s as single dispatches ({batch['ratio']:.2f}x); "
            f"{batch['store_round_trips']} store / {batch['broker_round_trips']} broker "
            "round trips per batch; plain apply_async in the same kombu batch: "
            f"{batch['plain_ratio']:.2f}x plain single dispatches; Celery's apply_async "
            f"alone, messages noted as the batch notes them: {bound(batch)} the unique "
            "single dispatches (the most a batch can reach with no library work per item)"
        )
    lat = report["latency"]
    print(
        f"latency of one created dispatch (selector), {lat['empty']['samples']} samples each: "
        f"empty store median {lat['empty']['median_us']:.0f} us, p99 "
        f"{lat['empty']['p99_us']:.0f} us; {lat['held_keys']:,} keys held median "
        f"{lat['full']['median_us']:.0f} us, p99 {lat['full']['p99_us']:.0f} us "
        f"(bulk load took {lat['load_seconds']:.1f} s)"
    )
    for kind, mem in report["memory"].items():
        print(
            f"memory per {kind} key: MEMORY USAGE median {mem['memory_usage_median']:.0f} B "
            f"(max {mem['memory_usage_max']}; bulk-loaded copies "
            f"{mem['memory_usage_loaded_median']:.0f} B); used_memory growth "
            f"{mem['used_memory_per_key']:.0f} B/key over {mem['keys_loaded']:,} keys "
            f"(key {mem['key_bytes']} B, value {mem['value_bytes']} B)"
        )
    for mode, measured in report["concurrency"].items():
        if "rows" not in measured:
            print(f"concurrency ({mode}): failed: {measured.get('error')}")
            continue
        print(
            f"concurrency, {measured['workers']} {mode} producers, {measured['dispatches']:,} "
            f"dispatches per row x {measured['rounds']} rounds: "
            + "; ".join(
                f"{cell['label']} {cell['per_s']:,.0f}/s ({cell['ratio']:.2f}x"
                + (f", {cell['failed']} failed" if cell["failed"] else "")
                + ")"
                for cell in measured["rows"].values()
            )
        )
    cluster = report["cluster"]
    if "error" in cluster:
        print(f"Redis Cluster: failed: {cluster['error']}")
    else:
        print(
            f"Redis Cluster, {cluster['producers']} producer processes, "
            f"{cluster['dispatches']:,} created dispatches per row x {cluster['rounds']} rounds: "
            + "; ".join(f"{name} {rate:,.0f}/s" for name, rate in cluster["throughput"].items())
            + "; 100,000 keys per shard: "
            + ", ".join(f"{count:,}" for count in cluster["distribution"].values())
        )
    h = report["hashing"]
    print(
        f"hashing {h['payload_bytes']:,} B payload: Payload().key {h['payload_key_ms']:.1f} ms vs "
        f"json.dumps+sha256 {h['baseline_ms']:.1f} ms ({h['ratio']:.2f}x)"
    )
    print()
    print("targets")
    for target, measured, met in report["targets"]:
        mark = {True: "met", False: "NOT MET", None: "not measured"}[met]
        print(f"  {mark:<13} {target}: {measured}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of about 80 s")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379", help="server (no db)")
    parser.add_argument("--json", default=DEFAULT_JSON, help=f"results file ({DEFAULT_JSON})")
    options = parser.parse_args()
    profile = QUICK if options.quick else FULL
    started = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - started:5.1f} s] {text}", file=sys.stderr, flush=True)

    bench = harness.build(options.redis)
    full = harness.build(options.redis, store_db=FULL_STORE_DB, name="benchfull")
    try:
        bench.store.ping()
    except Exception as exc:
        raise SystemExit(f"cannot reach Redis at {options.redis}: {exc}") from exc
    machine = harness.machine(bench.store)
    for client in (bench.broker, bench.store, full.store):
        client.flushdb()
    say("dispatch rows")
    rows = measure_rows(bench, profile, say)
    say("MONITOR sample")
    monitor = measure_monitor(bench, options.redis, rows, 50)
    say("dispatch_many")
    batch = measure_batch(bench, profile)
    say("memory")
    memory = measure_memory(bench, options.redis, profile)
    say("latency")
    latency = measure_latency(bench, full, options.redis, profile, say)
    say("hashing")
    hashed = measure_hashing(profile.hash_rounds)
    concurrency = measure_concurrency(options.redis, options.quick, say)
    say("Redis Cluster")
    cluster = run_script("cluster.py", "--redis", options.redis, *(["--quick"] * options.quick))
    for client in (bench.broker, bench.store, full.store):
        client.flushdb()
    report: dict[str, Any] = {
        "machine": machine,
        "profile": vars(profile),
        "rows": {
            row.key: {
                "key": row.key,
                "label": row.label,
                "per_s": profile.dispatches / harness.median(row.seconds),
                "us": harness.median(row.seconds) / profile.dispatches * 1e6,
                "cpu_us": harness.median(row.cpu_seconds) / profile.dispatches * 1e6,
                "ratio": harness.median(row.ratios),
                "store_rt": row.store_rt,
                "broker_rt": row.broker_rt,
                "published": row.published,
                "round_seconds": row.seconds,
                "round_cpu_seconds": row.cpu_seconds,
            }
            for row in rows
        },
        "monitor": monitor,
        "dispatch_many": batch,
        "memory": memory,
        "latency": latency,
        "hashing": hashed,
        "concurrency": concurrency,
        "cluster": cluster,
        "load_average_end": [round(x, 2) for x in __import__("os").getloadavg()],
        "seconds": time.perf_counter() - started,
    }
    report["targets"] = verdicts(report)
    print_report(report)
    path = Path(options.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    say(f"done; results in {path}")


if __name__ == "__main__":
    main()
