"""What a huge ``dispatch_many`` costs everyone else on its Redis server.

Run: ``python bench/batch_latency.py [--items 100000]``.

A decide script holds the server while it runs: every other client (the
broker's too, where store and broker share the server) waits for it. A
batch of more than ``MAX_CLAIMS_PER_SCRIPT`` claims is decided in parts, one
script each, so that others get in between. This decides one batch of
``--items`` new claims on a private ``redis-server`` while another client
sends ``PING`` after ``PING``, and prints that client's worst and median
latency, with the batch in parts (as the store does) and in one script (as
it did before the bound), and the batch's own time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_unique.stores import redis as redis_store
from celery_unique.stores.base import ActiveClaim, Claim, Scope
from tests.processes import RedisServer, free_port


def claims(count: int) -> list[Claim]:
    run = uuid.uuid4().hex[:8]
    return [
        Claim(
            job_id=f"{run}-{n}",
            task="bench.big",
            active=ActiveClaim(
                f"unique:v1:bench\x1fa\x1fbench.big\x1f{run}-{n}", Scope.ACTIVE, 600_000
            ),
        )
        for n in range(count)
    ]


#: Another client, in a process of its own (a thread would also wait for this one's
#: GIL): PINGs until its standard input closes, then prints its latencies.
PINGER = """
import select, sys, time, redis
client = redis.Redis.from_url(sys.argv[1])
seen = []
while not select.select([sys.stdin], [], [], 0)[0]:
    started = time.perf_counter()
    client.ping()
    seen.append(time.perf_counter() - started)
print(" ".join(map(repr, seen)))
"""


def measure(url: str, count: int, per_script: int) -> tuple[float, float, float]:
    """Worst and median PING latency of another client during the batch, and the batch's
    own time (seconds)."""
    redis_store.MAX_CLAIMS_PER_SCRIPT = per_script
    store = redis_store.RedisStore.from_url(url)
    store.decide(claims(1))  # the script is loaded: not part of what is timed
    batch = claims(count)
    pinger = subprocess.Popen(
        [sys.executable, "-c", PINGER, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    started = time.perf_counter()
    store.decide(batch)
    took = time.perf_counter() - started
    out, _ = pinger.communicate("")
    store.close()
    latencies = [float(each) for each in out.split()]
    return max(latencies), statistics.median(latencies), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100_000)
    options = parser.parse_args()
    bound = redis_store.MAX_CLAIMS_PER_SCRIPT
    with tempfile.TemporaryDirectory() as directory:
        server = RedisServer(free_port(), Path(directory))
        server.start()
        try:
            print(f"{options.items:,} new claims in one dispatch_many decision")
            print(f"{'how':<28} {'worst PING':>11} {'median PING':>12} {'batch':>9}")
            for how, per_script in (
                (f"parts of {bound:,} (default)", bound),
                ("one script", options.items),
            ):
                worst, median, took = measure(server.url(), options.items, per_script)
                print(f"{how:<28} {worst * 1000:>9.1f}ms {median * 1000:>10.2f}ms {took:>8.2f}s")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
