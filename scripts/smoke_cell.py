"""One cell of scripts/smoke: an installed celery-unique, one broker, dispatched for real.

Run by scripts/smoke with the Python of a virtualenv that holds only the built
wheel (with one extra, or none), from a directory holding only this file, so
that nothing of the source tree or of the dev tools can be imported::

    python smoke_cell.py memory|redis|rabbitmq

Imported (by the worker ``celery -A smoke_cell worker`` it starts), it is the
app: broker, store, queue and namespace come from the environment the cell
sets. The cell dispatches one job twice (created, then reused), runs a worker
(in this process for the in-memory broker, a ``celery worker`` subprocess
otherwise), waits for the job to run and its key to be released, and has the
job created and run once more. It prints one line; exit status 0 when the
cell passed or does not apply to this install, 1 when it failed, 2 when a
service it needs is down (an error only with CI=true, which scripts/smoke
decides).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from celery import Celery
from kombu import Queue

from celery_unique import Disposition, UniqueTask

HOST = "127.0.0.1"
REDIS_PORT = int(os.environ.get("TEST_REDIS_PORT", "6379"))
RABBITMQ_PORT = int(os.environ.get("TEST_RABBITMQ_PORT", "5672"))
#: The databases the test suite uses for the store (flushed at its start) and for Celery.
REDIS_STORE = f"redis://{HOST}:{REDIS_PORT}/9"
REDIS_BROKER = f"redis://{HOST}:{REDIS_PORT}/10"
BROKERS = {
    "memory": "memory://",
    "redis": REDIS_BROKER,
    "rabbitmq": f"amqp://guest:guest@{HOST}:{RABBITMQ_PORT}//",
}
#: How long a step may take before the cell fails (a worker's start included).
PATIENCE_S = 60.0

queue = os.environ.get("SMOKE_QUEUE", "smoke")
app = Celery("smoke_cell")
app.conf.update(
    broker_url=os.environ.get("SMOKE_BROKER", "memory://"),
    unique_backend=os.environ.get("SMOKE_STORE", "memory://"),
    unique_namespace=os.environ.get("SMOKE_NAMESPACE", "smoke"),
    task_default_queue=queue,
    # The queue deletes itself a while after the cell: nothing is left on the broker.
    task_queues=[Queue(queue, routing_key=queue, queue_arguments={"x-expires": 300_000})],
    broker_connection_retry_on_startup=False,
    worker_hijack_root_logger=False,
)


@app.task(
    base=UniqueTask,
    bind=True,
    shared=False,
    name="smoke.touch",
    unique_key=lambda job: f"path:{job.path}",
    unique_while="active",
)
def touch(self: Any, path: str) -> None:
    """Leave the job's id in ``path``: the driver's proof that this job ran."""
    Path(path).write_text(self.request.id)


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def reachable(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=2):
            return True
    except OSError:
        return False


def not_applying(broker: str) -> str | None:
    """Why this install cannot use the broker at all, if it cannot."""
    if broker == "redis" and not has("redis"):
        return "no redis-py in this install (celery-unique[redis] brings it)"
    return None


def service_down(broker: str, store: str) -> str | None:
    needs = {"redis": REDIS_PORT, "rabbitmq": RABBITMQ_PORT}
    if broker in needs and not reachable(needs[broker]):
        return f"{broker} is not reachable on port {needs[broker]}"
    if store.startswith("redis") and not reachable(REDIS_PORT):
        return f"redis (the store) is not reachable on port {REDIS_PORT}"
    return None


def wait_for(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {PATIENCE_S:g} s")
        time.sleep(0.05)


@contextmanager
def worker(broker: str, workdir: Path) -> Iterator[None]:
    """A worker consuming the cell's queue: in this process for the in-memory broker
    (another process cannot see its messages), else a ``celery worker`` subprocess."""
    if broker == "memory":
        from celery.contrib.testing.worker import start_worker

        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
            yield
        return
    log = workdir / "worker.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "celery", "-A", "smoke_cell", "worker", "--pool=solo"),
                *("--without-heartbeat", "--without-gossip", "--without-mingle"),
                *("--loglevel=WARNING", "-Q", queue),
            ],
            cwd=Path(__file__).resolve().parent,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield
    except BaseException:
        print(f"--- worker output ---\n{log.read_text()}", file=sys.stderr)
        raise
    finally:
        process.terminate()
        process.wait(timeout=30)


def dispatch_run_and_release(broker: str, workdir: Path) -> list[str]:
    """Created, reused, run by a worker, released, created and run again."""
    done = workdir / "ran"
    path = str(done)
    first = touch.delay(path)
    assert first.disposition is Disposition.CREATED, f"first dispatch: {first.disposition}"
    again = touch.delay(path)
    assert again.disposition is Disposition.REUSED, f"second dispatch: {again.disposition}"
    assert again.id == first.id, "the reused receipt names another job"
    steps = ["created", "reused"]
    with worker(broker, workdir):
        wait_for("the job ran", lambda: done.exists() and done.read_text() == first.id)
        steps.append("worker ran it")
        # Released once the run ends: a dispatch then creates a new job.
        receipts: list[Any] = []
        wait_for(
            "the key was released after the run",
            lambda: receipts.append(touch.delay(path)) or receipts[-1].id != first.id,
        )
        assert receipts[-1].disposition is Disposition.CREATED
        wait_for("the next job ran", lambda: done.read_text() == receipts[-1].id)
        steps.append("released, created and ran again")
    return steps


def main(broker: str) -> int:
    # The first dispatch logs the task's check findings (no result backend here): not news.
    logging.getLogger("celery_unique").setLevel(logging.ERROR)
    extra = os.environ.get("SMOKE_EXTRA", "?")
    store = os.environ["SMOKE_STORE"]
    cell = f"extra {extra:<7} broker {broker:<9} store {store.split(':', 1)[0]:<7}"
    why = not_applying(broker)
    if why:
        print(f"{cell} not applying: {why}")
        return 0
    down = service_down(broker, store)
    if down:
        print(f"{cell} NOT RUN: {down}")
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="smoke-cell-") as workdir:
        try:
            steps = dispatch_run_and_release(broker, Path(workdir))
        except Exception as exc:
            print(f"{cell} FAILED: {type(exc).__name__}: {exc}")
            raise
    print(f"{cell} ok: {', '.join(steps)} ({time.monotonic() - started:.1f} s)")
    return 0


def configure(broker: str) -> None:
    """The environment the worker subprocess builds the same app from."""
    os.environ.setdefault("SMOKE_QUEUE", f"celery-unique-smoke-{uuid.uuid4().hex[:12]}")
    os.environ["SMOKE_BROKER"] = BROKERS[broker]
    os.environ["SMOKE_NAMESPACE"] = f"smoke-{uuid.uuid4().hex[:12]}"
    # The store a user of this install would pick: Redis when redis-py is there.
    if has("redis"):
        os.environ["SMOKE_STORE"] = REDIS_STORE
    else:
        handle, db = tempfile.mkstemp(prefix="smoke-store-", suffix=".db")
        os.close(handle)
        os.environ["SMOKE_STORE"] = f"sqlite:///{db}"


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in BROKERS:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(BROKERS)}")
    configure(sys.argv[1])
    # The app as the worker builds it: this module under its own name, read from the
    # environment just set (``__main__`` built its app before).
    import smoke_cell

    sys.exit(smoke_cell.main(sys.argv[1]))
