"""Where a created unique dispatch spends the time a plain apply_async does not.

Run: ``python bench/profile_dispatch.py [--n 100] [--rounds 30] [--pyinstrument]``.

Three views of the same question, on the benchmark's Redis databases (see
bench/harness.py), each with wall and CPU time (wall minus CPU is waiting):

1. The created path rebuilt one layer at a time (plain publish; + task id and
   header; + planning; + EVALSHA on a raw socket; + redis-py's connection;
   + ``RedisStore.decide``, answer read at once; the library asking the store
   first, reading the answer only when it is about to publish; the library
   with store and broker on one server, one script for both), every
   variant a whole dispatch, timed in interleaved turns: each difference is
   what one layer costs where it really runs.
2. Steps timed on their own (hot loops): planning pieces, and the store round
   trip peeled down to a raw socket and the server's own time per EVALSHA.
3. cProfile of the selector task's created path against plain apply_async,
   grouped into the categories the dispatch path is made of. cProfile inflates
   Python-heavy code: read its column as shares.

Internal functions are looked up by name; a step whose function moved is shown
as "n/a" rather than failing the run.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
from harness import TENANT, fresh

from celery_unique.config import runtime
from celery_unique.keys import keyspace

OUT_DIR = Path("/tmp/celery-unique-bench")


def optional(build: Callable[[], Callable[[], object]]) -> Callable[[], object] | None:
    """A case built from internal functions, or None when they are not where expected."""
    try:
        case = build()
        case()
    except Exception as exc:
        print(f"  (skipped a step: {type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    return case


Timing = tuple[float, float] | None


def steps(
    bench: harness.Bench, base_url: str, n: int, rounds: int
) -> tuple[dict[str, Timing], dict[str, float | None]]:
    app, t = bench.app, bench.tasks
    selector = t.selector
    rt = runtime(app)
    store: Any = rt.store
    header = {"v": 1, "a": "unique:v1:{bench}:a:bench.selector\x1forder:1", "s": "queued"}

    def with_unique_header() -> object:
        from celery.utils import uuid

        return t.plain.apply_async(
            (TENANT, fresh()), task_id=uuid(), headers={"celery_unique": header}
        )

    def plan_case() -> Callable[[], object]:
        from celery.utils import uuid

        from celery_unique.dispatch import planning as dispatch

        declaration = selector.__unique__
        return lambda: dispatch.plan(
            selector, declaration, {}, (TENANT, fresh()), None, {}, job_id=uuid(), rt=rt
        )

    def bind_case() -> Callable[[], object]:
        binder = selector.__unique__.binder
        return lambda: binder.bind((TENANT, fresh()), {})

    def selector_case() -> Callable[[], object]:
        from celery_unique.keys.arguments import ArgumentView

        function = selector.__unique__.key.selector
        view = ArgumentView({"tenant_id": TENANT, "n": 12345})
        return lambda: function(view)

    def claim() -> Any:
        from celery.utils import uuid

        from celery_unique.dispatch import planning as dispatch

        planned = dispatch.plan(
            selector, selector.__unique__, {}, (TENANT, fresh()), None, {}, job_id=uuid(), rt=rt
        )
        assert planned is not None
        return planned.claim

    def decide_case() -> Callable[[], object]:
        claims = iter([claim() for _ in range(n * (rounds + 2) + 400)])
        return lambda: store.decide([next(claims)])

    script = store._scripts["decide"]
    client = store.client
    lease = rt.lease_ms or ""

    def eval_args(job: str, key: str) -> list[Any]:
        # ARGV layout of stores/lua/decide.lua for one claim with an active key.
        return ["1", 1, job, selector.name, 1, "q", lease, 0, "", "", "", ""]

    def fresh_key() -> str:
        return keyspace.storage_key(rt.namespace, "a", selector.name, f"order:{fresh()}")

    def script_case() -> Callable[[], object]:
        from celery.utils import uuid

        return lambda: script(keys=[fresh_key()], args=eval_args(uuid(), ""))

    connection = client.connection_pool.get_connection()

    def connection_case() -> Callable[[], object]:
        from celery.utils import uuid

        sha = script.sha

        def call() -> object:
            connection.send_command("EVALSHA", sha, 1, fresh_key(), *eval_args(uuid(), ""))
            return connection.read_response()

        return call

    raw = harness.raw_socket(base_url, bench.store_db)

    def raw_eval_case() -> Callable[[], object]:
        from celery.utils import uuid

        packed = iter(
            [
                b"".join(
                    connection.pack_command(
                        "EVALSHA", script.sha, 1, fresh_key(), *eval_args(uuid(), "")
                    )
                )
                for _ in range(n * (rounds + 2) + 400)
            ]
        )

        def call() -> object:
            raw.sendall(next(packed))
            return raw.recv(4096)

        return call

    def raw_ping() -> object:
        raw.sendall(b"*1\r\n$4\r\nPING\r\n")
        return raw.recv(100)

    def stamp_case() -> Callable[[], object]:
        from celery_unique.receipt import stamp

        result = selector.AsyncResult("x")
        return lambda: stamp(result)

    def header_case() -> Callable[[], object]:
        from celery_unique.dispatch.apply import with_header

        return lambda: with_header({}, header)  # type: ignore[arg-type]

    def validate_case() -> Callable[[], object]:
        return lambda: keyspace.validate_key("order:123456")

    def storage_case() -> Callable[[], object]:
        return lambda: (
            keyspace.storage_key("bench", "a", "bench.selector", "order:123456"),
            keyspace.display_key("bench.selector", "order:123456"),
        )

    def uuid_case() -> Callable[[], object]:
        from celery.utils import uuid

        return uuid

    def fingerprint_case() -> Callable[[], object]:
        from celery_unique.keys.fingerprint import policy_digest, request_fingerprint

        keys = {"active": None, "scope": None, "window": "w", "window_ms": 3600000}
        return lambda: (
            request_fingerprint(
                task_name="bench.window",
                payload={"tenant_id": TENANT, "n": fresh()},
                options={},
                keys=keys,
                headers=None,
                link=None,
                link_error=None,
            ),
            policy_digest(t.window, {}),
        )

    def payload_case() -> Callable[[], object]:
        from celery_unique.keys.arguments import json_payload
        from celery_unique.keys.canonical import canonical_digest

        return lambda: canonical_digest(json_payload({"tenant_id": TENANT, "n": fresh()}))

    results: dict[str, Timing] = {}
    notes: dict[str, float | None] = {}
    print("  timing whole dispatches", file=sys.stderr)
    results |= harness.compare(
        {
            "plain apply_async": lambda: t.plain.apply_async((TENANT, fresh())),
            "plain apply_async + task_id + unique header": with_unique_header,
            "UniqueTask with no key (pass-through + receipt)": lambda: _nokey(bench),
            "unique created: selector key": lambda: selector.apply_async((TENANT, fresh())),
            "unique created: window key": lambda: t.window.apply_async((TENANT, fresh())),
            "unique created: Payload() key": lambda: t.payload.apply_async((TENANT, fresh())),
        },
        n,
        rounds,
    )
    harness.reset_broker(bench)
    print("  timing the store round trip, layer by layer", file=sys.stderr)
    stats_before = _evalsha_stats(bench.store)
    layered = harness.compare(
        {
            "RedisStore.decide([claim])": optional(decide_case),
            "redis-py Script call (client EVALSHA)": optional(script_case),
            "redis-py connection send_command + read_response": optional(connection_case),
            "raw socket EVALSHA decide (pre-packed)": optional(raw_eval_case),
            "raw socket PING (loopback floor)": raw_ping,
        },
        n,
        rounds,
    )
    stats_after = _evalsha_stats(bench.store)
    results |= layered
    calls = stats_after[0] - stats_before[0]
    notes["server time per EVALSHA in us (INFO commandstats)"] = (
        (stats_after[1] - stats_before[1]) / calls if calls else None
    )
    # Each of the four EVALSHA cases: one check call, the warm-up, then the rounds.
    made = 4 * (1 + min(n, 200) + n * rounds)
    notes["EVALSHA calls the server saw / calls made here"] = calls / made
    print("  timing the planning steps", file=sys.stderr)
    results |= harness.compare(
        {
            "plan() (everything before the store)": optional(plan_case),
            "Binder.bind": optional(bind_case),
            "selector(view)": optional(selector_case),
            "validate_key": optional(validate_case),
            "storage_key + display_key": optional(storage_case),
            "uuid()": optional(uuid_case),
            "runtime(app)": lambda: runtime(app),
            "stamp() receipt": optional(stamp_case),
            "with_header()": optional(header_case),
            "request_fingerprint + policy_digest (window row)": optional(fingerprint_case),
            "json_payload + canonical_digest (Payload row)": optional(payload_case),
        },
        n,
        rounds,
    )
    client.connection_pool.release(connection)
    raw.close()
    harness.reset_broker(bench)
    bench.store.flushdb()
    return results, notes


def in_context(bench: harness.Bench, base_url: str, n: int, rounds: int) -> dict[str, Timing]:
    """The created path rebuilt one layer at a time, each variant ending in the same publish.

    Steps timed alone run hot (their code and data stay in cache, Redis never
    sleeps between calls); inside a dispatch they cost more. Here every variant
    is a whole dispatch, so each difference between neighbours is what one
    layer costs where it really runs.
    """
    from celery.app.task import Task
    from celery.utils import uuid

    from celery_unique.dispatch import planning as dispatch
    from celery_unique.dispatch.headers import HEADER

    t = bench.tasks
    selector = t.selector
    rt = runtime(bench.app)
    store: Any = rt.store
    script = store._scripts["decide"]
    sha = script.sha
    # The raw steps below send EVALSHA themselves: a fresh server must know the script.
    store.client.script_load(script.script)
    connection = store.client.connection_pool.get_connection()
    raw = harness.raw_socket(base_url, bench.store_db)
    header = {"v": 1, "a": "unique:v1:{bench}:a:bench.selector\x1forder:1", "s": "queued"}

    def planned() -> Any:
        job_id = uuid()
        return dispatch.plan(
            selector, selector.__unique__, {}, (TENANT, fresh()), None, {}, job_id=job_id, rt=rt
        )

    def evalsha(claim: Any) -> list[Any]:
        active = claim.active
        return [
            "EVALSHA", sha, 1, active.key, "1", 1, claim.job_id, claim.task, 1, "q",
            active.lease_ms or "", 0, "", "", "", "",
        ]  # fmt: skip

    def publish(plan: Any) -> object:
        headers: Any = {HEADER: plan.header}
        return Task.apply_async(
            selector, (TENANT, fresh()), None, task_id=plan.claim.job_id, headers=headers
        )

    def header_publish() -> object:
        headers: Any = {HEADER: header}
        return Task.apply_async(t.plain, (TENANT, fresh()), None, task_id=uuid(), headers=headers)

    def plan_publish() -> object:
        return publish(planned())

    def raw_store() -> object:
        plan = planned()
        raw.sendall(b"".join(connection.pack_command(*evalsha(plan.claim))))
        raw.recv(4096)
        return publish(plan)

    def connection_store() -> object:
        plan = planned()
        connection.send_command(*evalsha(plan.claim))
        connection.read_response()
        return publish(plan)

    def client_store() -> object:
        plan = planned()
        store.decide([plan.claim])
        return publish(plan)

    results = harness.compare(
        {
            "A  plain apply_async": lambda: t.plain.apply_async((TENANT, fresh())),
            "B  A + task_id + unique header": header_publish,
            "C  plan() + publish (no store)": plan_publish,
            "D  C + EVALSHA on a raw socket": raw_store,
            "E  C + EVALSHA via redis-py connection": connection_store,
            "F  C + RedisStore.decide (answer read at once)": client_store,
            "G  the library, store asked first (answer read when publishing)": lambda: (
                t.separate.apply_async((TENANT, fresh()))
            ),
            "H  the library, store and broker one server (one script)": lambda: (
                selector.apply_async((TENANT, fresh()))
            ),
        },
        n,
        rounds,
    )
    store.client.connection_pool.release(connection)
    raw.close()
    harness.reset_broker(bench)
    bench.store.flushdb()
    return results


def _nokey(bench: harness.Bench) -> object:
    # The literal task declares no key: without a per-dispatch key it is a plain dispatch.
    return bench.tasks.literal.apply_async((TENANT, fresh()))


def _evalsha_stats(client: Any) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


#: cProfile categories: (label, [(file suffix, function name), ...]); inclusive times summed.
CATEGORIES: list[tuple[str, list[tuple[str, str]]]] = [
    ("whole dispatch", [("celery_unique/task.py", "apply_async")]),
    ("  option parsing (take_dispatch_options, KeySpec.parse, ...)", [
        ("celery_unique/dispatch/apply.py", "take_dispatch_options"),
        ("celery_unique/options/declaration.py", "parse"),
        ("celery_unique/options/declaration.py", "parse_prefix"),
    ]),
    ("  runtime(app) lookup", [("celery_unique/config.py", "runtime")]),
    ("  job id (uuid)", [("kombu/utils/uuid.py", "uuid")]),
    ("  plan() total", [("celery_unique/dispatch/planning.py", "plan")]),
    ("    binding (Binder.bind)", [("celery_unique/keys/arguments.py", "bind")]),
    ("    selector + key rules (KeySpec.resolve)", [
        ("celery_unique/options/declaration.py", "resolve"),
    ]),
    ("      key validation (validate_key)", [("celery_unique/keys/keyspace.py", "validate_key")]),
    ("    storage key formatting", [
        ("celery_unique/keys/keyspace.py", "storage_key"),
        ("celery_unique/keys/keyspace.py", "display_key"),
    ]),
    ("    fingerprint + policy digest", [
        ("celery_unique/keys/fingerprint.py", "request_fingerprint"),
        ("celery_unique/keys/fingerprint.py", "policy_digest"),
    ]),
    ("    payload JSON round trip", [("celery_unique/keys/arguments.py", "json_payload")]),
    ("    canonical encoding + sha256", [("celery_unique/keys/canonical.py", "canonical_digest")]),
    ("  store round trip (RedisStore.decide)", [("celery_unique/stores/redis.py", "decide")]),
    ("  header merge (with_header)", [("celery_unique/dispatch/apply.py", "with_header")]),
    ("  receipt (stamp)", [("celery_unique/receipt.py", "stamp")]),
    ("  Celery apply_async (message build + publish)", [("celery/app/task.py", "apply_async")]),
    ("    amqp.create_task_message (build)", [("celery/app/amqp.py", "as_task_v2")]),
    ("    amqp.send_task_message (serialize + publish)", [
        ("celery/app/amqp.py", "send_task_message"),
    ]),
    ("      kombu Redis client per publish", [("kombu/transport/redis.py", "_create_client")]),
]  # fmt: skip


def inclusive(stats: pstats.Stats, targets: list[tuple[str, str]]) -> float:
    """Seconds spent inside any of ``targets`` (cProfile's cumulative time, summed)."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    return sum(
        float(cumulative)
        for (filename, _line, name), (_cc, _nc, _tt, cumulative, _callers) in raw.items()
        if any(name == wanted and filename.endswith(suffix) for suffix, wanted in targets)
    )


def profile(bench: harness.Bench, n: int) -> tuple[dict[str, Any], str]:
    """cProfile µs per dispatch by category: selector task, window task, plain task."""
    t = bench.tasks
    out: dict[str, Any] = {}
    texts = []
    for label, task in (("selector", t.selector), ("window", t.window), ("plain", t.plain)):
        for _ in range(200):
            task.apply_async((TENANT, fresh()))
        harness.reset_broker(bench)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(n):
            task.apply_async((TENANT, fresh()))
        profiler.disable()
        stats = pstats.Stats(profiler)
        total = sum(value[2] for value in stats.stats.values())  # type: ignore[attr-defined]
        out[label] = {"total_us": total / n * 1e6}
        for category, targets in CATEGORIES:
            out[label][category] = inclusive(stats, targets) / n * 1e6
        listing = _Capture()
        pstats.Stats(profiler, stream=listing).sort_stats("tottime").print_stats(25)  # type: ignore[arg-type]
        texts.append(f"==== {label}: top functions by own time ({n} dispatches)\n{listing.text}")
    harness.reset_broker(bench)
    bench.store.flushdb()
    return out, "\n".join(texts)


class _Capture:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)


def with_pyinstrument(bench: harness.Bench, n: int) -> str | None:
    try:
        from pyinstrument import Profiler
    except ImportError:
        return None
    task = bench.tasks.selector
    profiler = Profiler(interval=0.0001)
    profiler.start()
    for _ in range(n):
        task.apply_async((TENANT, fresh()))
    profiler.stop()
    harness.reset_broker(bench)
    bench.store.flushdb()
    text: str = profiler.output_text(unicode=False, color=False, show_all=False)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="calls per case per turn")
    parser.add_argument("--rounds", type=int, default=30, help="turns per case")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    parser.add_argument("--pyinstrument", action="store_true", help="also a pyinstrument tree")
    options = parser.parse_args()
    bench = harness.build(options.redis)
    bench.broker.flushdb()
    bench.store.flushdb()
    machine = harness.machine(bench.store)
    print(
        f"machine: {machine['cores']} cores, Python {machine['python']}, Redis "
        f"{machine['redis_server']}, redis-py {machine['redis_py']} ({machine['redis_parser']} "
        f"parser), celery {machine['celery']}, kombu {machine['kombu']}; load "
        f"{machine['load_average']}"
    )
    layers = in_context(bench, options.redis, options.n, options.rounds)
    print(
        f"\n1. the created path rebuilt layer by layer, each a whole dispatch; median of "
        f"{options.rounds} turns x {options.n}"
    )
    print(f"{'variant':<58} {'wall us':>8} {'CPU us':>8} {'+wall':>7} {'+CPU':>7}")
    previous: tuple[float, float] | None = None
    for name, value in layers.items():
        assert value is not None
        step = (
            ""
            if previous is None
            else (f"{value[0] - previous[0]:7.1f} {value[1] - previous[1]:7.1f}")
        )
        print(f"{name:<58} {value[0]:8.1f} {value[1]:8.1f} {step}")
        previous = value
    timings, notes = steps(bench, options.redis, options.n, options.rounds)
    print(f"\n2. steps: median of {options.rounds} turns x {options.n} calls")
    print(f"{'step':<58} {'wall us':>8} {'CPU us':>8}")
    for name, value in timings.items():
        text = "     n/a      n/a" if value is None else f"{value[0]:8.1f} {value[1]:8.1f}"
        print(f"{name:<58} {text}")
    plain = timings["plain apply_async"] or (0.0, 0.0)
    created = timings["unique created: selector key"] or (0.0, 0.0)
    print(
        f"{'extra of the selector row over plain':<58} {created[0] - plain[0]:8.1f} "
        f"{created[1] - plain[1]:8.1f}"
    )
    for name, note in notes.items():
        print(f"{name:<58} {'n/a' if note is None else f'{note:8.2f}':>8}")

    profiled, listing = profile(bench, 2000)
    print("\n3. cProfile, us per dispatch under the profiler (2,000 dispatches each)")
    print(f"{'category':<62} {'selector':>9} {'window':>9} {'plain':>9}")
    for category, _targets in CATEGORIES:
        print(
            f"{category:<62} "
            + " ".join(f"{profiled[label][category]:>9.1f}" for label in profiled)
        )
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "cprofile.txt").write_text(listing)
    print(f"\ntop functions by own time: {OUT_DIR / 'cprofile.txt'}")
    if options.pyinstrument:
        tree = with_pyinstrument(bench, 2000)
        if tree is None:
            print("pyinstrument is not installed (pip install pyinstrument)")
        else:
            (OUT_DIR / "pyinstrument.txt").write_text(tree)
            print(f"pyinstrument tree: {OUT_DIR / 'pyinstrument.txt'}")


if __name__ == "__main__":
    main()
