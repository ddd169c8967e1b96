"""What the Redis store's decide script costs the server, in instructions per call.

Run: ``python bench/script_cost.py [--against REV] [--calls 300]``.

The script runs inside Redis while the dispatch waits for its answer (a
reused dispatch, a created one whose store is also its broker), so its cost
is part of every such dispatch's latency. Timings of a few microseconds move
with whatever else the machine does; instructions do not: a ``redis-server``
of its own runs under ``valgrind --tool=callgrind``, and the counters are
zeroed before and dumped after each case's calls (``callgrind_control``).
Each line is the whole command as the server sees it (reading the request,
the script, the reply), so the first line, a script that only returns, is
the floor. ``--against`` counts the scripts of another git revision too.
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_unique.stores.redis import script_source
from tests.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
LUA = "celery_unique/stores/lua"
#: A record as a decision leaves it for a job that holds its key (nine fields).
HELD = (
    "a\x1f0\x1f" + "6af09dd4-bcdc-411a-91ac-044768d89497" + "\x1f\x1f\x1f\x1f1700000000000\x1f\x1f"
)


def decide_arguments() -> list[str | int]:
    """One claim on an active key, its first KEYS entry, as the store sends it."""
    return ["1", 1, str(uuid.uuid4()), "", 1, "a", 3_600_000, 0, "", "", "", "", "", "", "", ""]


def source_at(revision: str, name: str) -> str:
    def show(path: str) -> str:
        return subprocess.run(
            ["git", "show", f"{revision}:{path}"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    return show(f"{LUA}/common.lua") + "\n" + show(f"{LUA}/{name}.lua")


class Callgrind:
    """A ``redis-server`` under callgrind, and its instruction counter."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.port = directory, free_port()
        self.process = subprocess.Popen(
            [
                "valgrind", "--tool=callgrind", f"--callgrind-out-file={directory}/out.%p",
                "redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.client = redis.Redis(port=self.port, socket_timeout=120)
        for _ in range(300):
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.1)
        raise SystemExit("redis-server under valgrind did not start")

    def control(self, flag: str) -> None:
        subprocess.run(
            ["callgrind_control", flag, str(self.process.pid)], check=True, capture_output=True
        )

    def per_call(self, calls: int, call: Callable[[], object]) -> float:
        for _ in range(20):
            call()
        self.control("-z")
        for _ in range(calls):
            call()
        before = set(self.directory.glob("out.*"))
        self.control("-d")
        (dump,) = set(self.directory.glob("out.*")) - before
        found = re.search(r"^(?:summary|totals): (\d+)", dump.read_text(), re.M)
        assert found is not None, dump
        return int(found.group(1)) / calls

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="also count the scripts of this revision")
    parser.add_argument("--calls", type=int, default=300)
    options = parser.parse_args()
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        raise SystemExit("needs valgrind (Debian package valgrind)")
    sources = {"this tree": script_source("decide")}
    if options.against:
        sources[options.against] = source_at(options.against, "decide")
    with tempfile.TemporaryDirectory() as directory:
        server = Callgrind(Path(directory))
        try:
            client, fresh = server.client, itertools.count()
            floor = client.script_load("return 1")

            def only_returns() -> object:
                return client.evalsha(floor, 1, "k", *decide_arguments())

            rows = [("script that only returns", server.per_call(options.calls, only_returns))]
            for label, source in sources.items():
                sha = client.script_load(source)

                def created(sha: str = sha) -> object:
                    return client.evalsha(sha, 1, f"created{next(fresh)}", *decide_arguments())

                def reused(sha: str = sha) -> object:
                    client.set("held", HELD)
                    return client.evalsha(sha, 1, "held", *decide_arguments())

                rows.append((f"decide, created ({label})", server.per_call(options.calls, created)))
                client.set("held", HELD)
                reused_calls = server.per_call(options.calls, reused)
                # Each reused call also paid for the SET that restores the record.
                restore = server.per_call(options.calls, lambda: client.set("held", HELD))
                rows.append((f"decide, reused ({label})", reused_calls - restore))
        finally:
            server.stop()
    width = max(len(label) for label, _ in rows)
    print(f"{'command':{width}}  instructions per call")
    for label, count in rows:
        print(f"{label:{width}}  {count:>12,.0f}")


if __name__ == "__main__":
    main()
