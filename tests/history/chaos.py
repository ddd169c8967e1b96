"""A randomized run under injected faults, recorded, then checked (``scripts/chaos``).

Actors, all real processes on loopback, started and stopped by the run:

* a marks ``redis-server`` (never impaired) for the task bodies' run counters;
* the store: a ``redis-server`` with an append-only file synced on every
  write (a restart loses nothing), reached by every client through a loopback
  fault proxy (:mod:`tests.faultproxy`);
* the broker: another durable ``redis-server``, or the local RabbitMQ, or
  (``colocated``) database 1 of the store's own server, which producers reach
  through the same proxy: each created job's decision carries its message
  (:mod:`celery_unique.dispatch.colocated`), and the proxy's faults hit that script;
* two ``celery worker --pool=prefork --concurrency=4`` nodes (``acks_late``,
  ``reject_on_worker_lost``: a killed job is redelivered, never lost);
* three producer processes dispatching at random (:mod:`tests.history.actors`).

Meanwhile the run injects faults at random: pool children and whole nodes
SIGKILLed (nodes restarted), the store's replies dropped, its connections
reset, the network to it paused, the store and the broker restarted. Then
the faults stop, the queues drain, the actors settle, the keys left in the
store are read through ``celery unique list --json``, and the history is
checked (:mod:`tests.history.checker`)::

    python -m tests.history.chaos --seconds 60 --seed 1 [--broker rabbitmq|colocated]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from celery_unique.stores import open_store
from tests.faultproxy import FaultProxy
from tests.history.actors import Spec, now, produce
from tests.history.broken import OVERRIDE as BROKEN_STORE
from tests.history.broker_log import (
    lost_in_transport,
    message_states,
    removed_unacknowledged,
)
from tests.history.checker import DESCRIPTIONS, History, Report, build_jobs, check
from tests.processes import REPO, RabbitMQNode, RedisServer, Worker, free_port, group_members

HOST = "127.0.0.1"
PRODUCERS = 3
NODES = 2
#: After the queues drained, how long the workers' last owed releases may take.
SETTLE_S = 3.0
#: With the broker empty, how long to wait for jobs that no longer end.
STALLED_S = 10.0
FAULT_KINDS = (
    "child_kill",
    "node_kill",
    "dropped_reply",
    "reset",
    "pause",
    "store_restart",
    "broker_restart",
)


@dataclass
class Config:
    seconds: float
    seed: int
    broker: str = "redis"
    #: Seconds between faults (drawn uniformly).
    fault_gap: tuple[float, float] = (0.3, 1.2)
    #: Longer than a job can wait in the broker while it restarts and nodes die:
    #: a key whose lease ends while its job still waits lets a second job in.
    lease_s: float = 60.0
    retention_s: float = 2.0
    window_s: float = 6.0
    store_override: str | None = None
    directory: Path | None = None
    #: How long after the faults stop the queues may take to drain.
    drain_s: float = 90.0


@dataclass
class Outcome:
    config: Config
    report: Report
    faults: Counter[str]
    seconds: float
    history: History
    rendered: list[str] = field(default_factory=list)
    #: Whether the broker emptied once the faults stopped (else the run never settled).
    drained: bool = True

    @property
    def ok(self) -> bool:
        return self.drained and not self.report.violations

    def failures(self) -> str:
        """Why the run is not ok: the first violations, and a broker that never emptied."""
        found = [v.render(self.history.origin) for v in self.report.violations[:5]]
        if not self.drained:
            drain = self.config.drain_s
            found.insert(0, f"the broker still held messages {drain:g} s after the faults")
        return "\n".join(found)


class Run:
    """The processes of one run, and the faults done to them."""

    def __init__(self, config: Config, directory: Path, stack: ExitStack) -> None:
        self.config, self.directory, self.stack = config, directory, stack
        self.draw = random.Random(config.seed)
        self.faults: Counter[str] = Counter()
        self.upcoming: list[str] = []
        self.record_fd = os.open(
            directory / "orchestrator.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND
        )
        servers = directory / "servers"
        servers.mkdir()
        durable = ("--appendonly", "yes", "--appendfsync", "always")
        # Never rewritten, so its log keeps every message's story (broker_log).
        history = ("--auto-aof-rewrite-percentage", "0")
        colocated = config.broker == "colocated"
        self.marks = RedisServer(free_port(), servers / "marks")
        self.store = RedisServer(
            free_port(), servers / "store", durable + history if colocated else durable
        )
        (servers / "marks").mkdir()
        (servers / "store").mkdir()
        self.broker: RedisServer | None = None
        #: The broker's database on its server (the store keeps db 0 of a shared server).
        self.broker_db = 1 if colocated else 0
        if config.broker == "redis":
            (servers / "broker").mkdir()
            self.broker = RedisServer(free_port(), servers / "broker", durable + history)
        #: RabbitMQ as the broker: a node of the run's own, restarted at will.
        self.rabbitmq: RabbitMQNode | None = None
        if config.broker == "rabbitmq":
            self.rabbitmq = RabbitMQNode(free_port())
            self.rabbitmq.start()
            stack.callback(self.rabbitmq.stop)
        for server in (self.marks, self.store, self.broker):
            if server is not None:
                server.start()
                stack.callback(server.stop)
        self.proxy = FaultProxy(HOST, self.store.port).start()
        stack.callback(self.proxy.close)
        worker_broker_url = None
        if colocated:
            # One server: producers reach it, store and broker, through the proxy, so
            # a created job's decision carries its message and the proxy's faults hit
            # that one script. Workers reach the broker directly, as in the other
            # configurations (behind the proxy, their acks are lost and kombu
            # redelivers at the visibility timeout: its copies, not this path, show).
            self.broker = self.store
            broker_url = self.proxy.url(self.broker_db)
            worker_broker_url = self.store.url(self.broker_db)
        elif self.broker is not None:
            broker_url = self.broker.url(0)
        else:
            assert self.rabbitmq is not None
            broker_url = self.rabbitmq.url()
        self.spec = Spec(
            history=str(directory),
            broker_url=broker_url,
            store_url=f"{self.proxy.url(0)}?socket_timeout=1&socket_connect_timeout=1",
            marks_url=self.marks.url(0),
            namespace=f"chaos-{uuid.uuid4().hex[:8]}",
            queue=f"chaos-{uuid.uuid4().hex[:8]}",
            lease_s=config.lease_s,
            retention_s=config.retention_s,
            window_s=config.window_s,
            store_override=config.store_override,
            worker_broker_url=worker_broker_url,
        )
        (directory / "chaosapp.py").write_text(
            "import os\nfrom tests.history.actors import Spec, build\n"
            "app = build(Spec.from_json(os.environ['CHAOS_SPEC']), role='worker')\n"
        )
        self.nodes: list[Worker | None] = [None] * NODES
        self.node_lock = threading.Lock()
        self.record(
            "config", lease_s=config.lease_s, seed=config.seed, broker=config.broker, t=now()
        )

    def record(self, event: str, **fields: Any) -> None:
        os.write(self.record_fd, (json.dumps({"e": event, **fields}) + "\n").encode())

    # -- workers --------------------------------------------------------------------

    def start_node(self, index: int) -> None:
        """Start node ``index`` and wait until it is ready (without holding the node lock)."""
        worker = Worker(
            self.directory,
            "chaosapp",
            [self.spec.queue],
            f"chaos{index}-{uuid.uuid4().hex[:4]}",
            concurrency=4,
            extra_args=["--without-heartbeat"],
            env={"CHAOS_SPEC": self.spec.to_json()},
        )
        self.stack.callback(worker.close)
        worker.wait_ready()
        with self.node_lock:
            self.nodes[index] = worker

    def kill_child(self) -> None:
        with self.node_lock:
            live = [node for node in self.nodes if node is not None and node.alive()]
            children = [pid for node in live for pid in node.children()]
            if not children:
                return
            pid = self.draw.choice(children)
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.record("kill", pids=[pid], whole=False, t=now())
        self.faults["child_kill"] += 1

    def kill_node(self) -> None:
        with self.node_lock:
            up = [i for i, node in enumerate(self.nodes) if node is not None]
            if not up:
                return
            index = self.draw.choice(up)
            node = self.nodes[index]
            assert node is not None
            pids = group_members(node.process.pid)
            self.record("kill", pids=pids, whole=True, node=node.name, t=now())
            node.kill()
            self.nodes[index] = None
        self.faults["node_kill"] += 1
        pause = self.draw.uniform(0.2, 1.5)

        def restart() -> None:
            # In the background: other faults go on while the node boots.
            time.sleep(pause)
            self.start_node(index)

        threading.Thread(target=restart, daemon=True).start()

    def watch_nodes(self, stop: threading.Event) -> None:
        """Restart a node that died on its own (a worker crashing on a lost broker connection).

        A fleet's supervisor would; its death counts as a kill, found within a
        fifth of a second.
        """
        while not stop.wait(0.2):
            with self.node_lock:
                crashed = [
                    (index, node)
                    for index, node in enumerate(self.nodes)
                    if node is not None and not node.alive()
                ]
                for index, node in crashed:
                    self.record("kill", pids=[], whole=True, node=node.name, crash=True, t=now())
                    self.faults["node_crash"] += 1
                    self.nodes[index] = None
            for index, node in crashed:
                node.close()
                self.start_node(index)

    # -- the store and the broker -------------------------------------------------------

    def impair(self, kind: str, target: str, action: Any, **detail: Any) -> None:
        t0 = now()
        action()
        self.record("fault", kind=kind, target=target, t0=t0, t1=now(), **detail)
        self.faults[kind] += 1

    def inject(self) -> None:
        if not self.upcoming:
            # Every kind once per round, in a random order: even counts of each.
            self.upcoming = self.draw.sample(FAULT_KINDS, len(FAULT_KINDS))
        kind = self.upcoming.pop()
        if kind == "child_kill":
            self.kill_child()
        elif kind == "node_kill":
            self.kill_node()
        elif kind == "dropped_reply":
            self.impair(kind, "store", lambda: (self.proxy.drop_replies(1), time.sleep(1.2)))
        elif kind == "reset":
            self.impair(kind, "store", self.proxy.reset_all)
        elif kind == "pause":

            def pause() -> None:
                self.proxy.pause()
                time.sleep(self.draw.uniform(0.2, 1.5))
                self.proxy.resume()

            self.impair(kind, "store", pause)
        elif kind == "store_restart":
            self.impair(kind, "store", lambda: self.restart(self.store))
        elif kind == "broker_restart":
            self.impair(kind, "broker", self.restart_broker, transport=self.config.broker)

    def restart(self, server: RedisServer) -> None:
        server.stop(signal.SIGKILL)
        time.sleep(self.draw.uniform(0.1, 0.8))
        server.start()

    def restart_broker(self) -> None:
        if self.broker is not None:
            self.restart(self.broker)
        else:
            assert self.rabbitmq is not None
            self.rabbitmq.restart_app()

    def heal(self) -> None:
        self.proxy.heal()
        # Nodes restarting in the background come up by themselves.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with self.node_lock:
                if all(node is not None and node.alive() for node in self.nodes):
                    return
            time.sleep(0.2)

    # -- quiescence ---------------------------------------------------------------------------

    def queue_empty(self) -> bool:
        if self.broker is not None:
            client = redis.Redis.from_url(self.broker.url(self.broker_db))
            try:
                waiting = sum(client.llen(name) for name in self._queue_lists())
                return waiting == 0 and client.hlen("unacked") == 0
            finally:
                client.close()
        assert self.rabbitmq is not None
        listed = self.rabbitmq.ctl("-q", "list_queues", "name", "messages").stdout
        for line in listed.splitlines():
            parts = line.split()
            if parts and parts[0] == self.spec.queue:
                return parts[1] == "0"
        return True

    def _queue_lists(self) -> list[str]:
        return [self.spec.queue] + [f"{self.spec.queue}\x06\x16{n}" for n in range(1, 10)]

    def snapshot_keys(self) -> list[dict[str, Any]]:
        listed = subprocess.run(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "chaosapp",
                "unique",
                "list",
                "--json",
                "--limit",
                "100000",
            ],
            cwd=self.directory,
            env={
                **os.environ,
                "CHAOS_SPEC": self.spec.to_json(),
                "PYTHONPATH": os.pathsep.join([str(self.directory), str(REPO)]),
            },
            capture_output=True,
            text=True,
            check=True,
        )
        entries = json.loads(listed.stdout)["keys"]
        # What the list leaves out, for a violation to show why a key is held: the
        # delivery whose run marks it, and how long it has left.
        store = open_store(self.spec.store_url)
        try:
            records = [store.get(entry["storage_key"]) for entry in entries]
        finally:
            store.close()
        return [
            {
                "key": entry["display_key"],
                "kind": entry["kind"],
                "job": entry["job_id"],
                "finished": entry["finished"],
                "run": None if record is None else record.run,
                "ttl_ms": None if record is None else record.expires_in_ms,
            }
            for entry, record in zip(entries, records, strict=True)
        ]


def run(config: Config) -> Outcome:
    """Play one randomized run, then check its history."""
    began = time.monotonic()
    with ExitStack() as stack:
        directory = config.directory or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="chaos-"))
        )
        directory.mkdir(parents=True, exist_ok=True)
        actors = Run(config, directory, stack)
        for index in range(NODES):
            actors.start_node(index)
        stop_watching = threading.Event()
        stack.callback(stop_watching.set)
        threading.Thread(target=actors.watch_nodes, args=(stop_watching,), daemon=True).start()
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        until = time.time() + config.seconds
        producers = [
            context.Process(target=produce, args=(actors.spec, index, config.seed, until, results))
            for index in range(PRODUCERS)
        ]
        for process in producers:
            process.start()
        stack.callback(lambda: [p.kill() for p in producers if p.is_alive()])
        while time.time() < until:
            time.sleep(actors.draw.uniform(*config.fault_gap))
            if time.time() < until:
                actors.inject()
        for process in producers:
            process.join(timeout=120)
        actors.heal()
        actors.record("quiet", t=now())
        drained = drain(actors, directory, deadline=time.monotonic() + config.drain_s)
        time.sleep(SETTLE_S)  # the workers' last releases
        actors.record("keys", held=actors.snapshot_keys(), t=now())
        if actors.broker is not None:
            # Read whether or not the queues emptied: the log is replayed, so a
            # message still waiting is not taken for lost.
            states = message_states(actors.broker.directory / "appendonlydir")
            for job in sorted(lost_in_transport(states)):
                actors.record("transport_lost", job=job, t=now())
            for job in sorted(removed_unacknowledged(states)):
                actors.record("left_broker", job=job, t=now())
        stop_watching.set()
        for node in actors.nodes:
            if node is not None:
                node.stop()
        history = History.load(directory)
        report = check(history)
        return Outcome(
            config, report, actors.faults, time.monotonic() - began, history, drained=drained
        )


def drain(actors: Run, directory: Path, deadline: float) -> bool:
    """Wait until the broker holds no message and every created job ended (or ``deadline``);
    whether the broker emptied.

    Jobs that will never end (their message is gone) stop the wait once the
    broker is empty and no job has ended for :data:`STALLED_S`.
    """
    steady, unended, since = 0, -1, time.monotonic()
    while time.monotonic() < deadline:
        if actors.queue_empty():
            jobs, _ = build_jobs(History.load(directory))
            left = sum(job.final_end() is None for job in jobs.values())
            if left != unended:
                unended, since = left, time.monotonic()
            steady += 1
            if steady >= 3 and (left == 0 or time.monotonic() - since > STALLED_S):
                return True
        else:
            steady = 0
        time.sleep(1.0)
    return actors.queue_empty()


def render(outcome: Outcome) -> str:
    """The run's table: what it did, what it injected, what the checker found."""
    counts, found = outcome.report.counts, outcome.report.by_invariant()
    rows = [
        ("seed", str(outcome.config.seed)),
        ("broker", outcome.config.broker),
        ("duration", f"{outcome.seconds:.0f} s ({outcome.config.seconds:.0f} s of faults)"),
        ("broker emptied after the faults", "yes" if outcome.drained else "NO"),
        ("dispatches", f"{counts['dispatches']:,}"),
        ("created", f"{counts['created']:,}"),
        ("reused", f"{counts['reused']:,}"),
        ("conflicts", f"{counts['conflicts']:,}"),
        ("errors (store or broker unavailable)", f"{counts['errors']:,}"),
        ("runs", f"{counts['runs']:,}"),
        *(
            (name, f"{counts[name]:,}")
            for name in (
                "arguments replaced (latest/debounce)",
                "runs owed (latest/debounce)",
                "owed runs published",
                "operator releases",
                "operator releases kept for duplicates",
                "operator releases whose answer was lost",
            )
        ),
    ]
    rows += [(f"faults: {kind}", str(outcome.faults[kind])) for kind in FAULT_KINDS]
    rows += [
        ("worker crashes (restarted)", str(outcome.faults["node_crash"])),
        ("lease lapses (documented, not violations)", str(counts["lease lapses"])),
        (
            "messages lost by the Redis transport (restart, worker kill)",
            str(counts["messages lost by the Redis transport"]),
        ),
        ("uncertain publishes that ran", str(counts["uncertain publishes that ran"])),
        (
            "jobs created though their answer was lost (store and broker one script)",
            str(counts["jobs created though their answer was lost"]),
        ),
    ]
    rows += [(f"violations {name} ({DESCRIPTIONS[name]})", str(n)) for name, n in found.items()]
    width = max(len(label) for label, _ in rows)
    lines = [f"| {'':{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {label:{width}} | {value} |" for label, value in rows]
    origin = outcome.history.origin
    for violation in outcome.report.violations[:10]:
        lines.append("")
        lines.append(violation.render(origin))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--minutes", type=float)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--fault-gap",
        type=float,
        nargs=2,
        default=(0.3, 1.2),
        metavar=("MIN", "MAX"),
        help="seconds between two faults, drawn uniformly",
    )
    parser.add_argument(
        "--broker",
        choices=["redis", "rabbitmq", "colocated"],
        default="redis",
        help="colocated: the broker is the store's Redis server (db 1), behind the same proxy",
    )
    parser.add_argument("--keep", type=Path, help="keep the history files in this folder")
    parser.add_argument(
        "--broken-store",
        action="store_true",
        help="run against a store that now and then forgets held keys (the checker must object)",
    )
    options = parser.parse_args(argv)
    seconds = options.minutes * 60 if options.minutes else options.seconds
    override = BROKEN_STORE if options.broken_store else None
    outcome = run(
        Config(
            seconds=seconds,
            seed=options.seed,
            broker=options.broker,
            directory=options.keep,
            store_override=override,
            fault_gap=tuple(options.fault_gap),
        )
    )
    print(render(outcome))
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
