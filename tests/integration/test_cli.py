"""``celery -A app unique ...`` run for real: a subprocess, Redis as store, broker and backend.

Each test writes a small app module into its own directory and points ``-A``
at it. The ``unique`` command reaches ``celery`` through the
``celery.commands`` entry point once the package is installed with it; until
then (and to keep these tests independent of how the package was installed)
``run_celery`` starts Celery's own ``main()`` with the command group added by
hand, which is the same click program the entry point plugs into.
``test_entry_point_registers_the_command`` checks the entry point itself.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from celery.bin.base import CLIContext
from celery.contrib.testing.worker import start_worker
from celery.utils import uuid as job_uuid
from click.testing import CliRunner

from celery_unique import config as unique_config
from celery_unique import operations
from celery_unique.cli import unique
from celery_unique.keys import keyspace
from celery_unique.stores.base import ActiveClaim, Claim, Scope, WindowClaim
from celery_unique.stores.redis import RedisStore
from tests.conftest import fresh_queue_name
from tests.integration.worker.conftest import eventually

REPO = Path(__file__).resolve().parents[2]

#: Whether the installed package registers ``celery unique`` as an entry point.
ENTRY_POINT = any(point.name == "unique" for point in entry_points(group="celery.commands"))

#: Celery's CLI with the ``unique`` group added by hand (what the entry point does).
BOOTSTRAP = (
    "import sys; from celery.bin.celery import celery, main; "
    "from celery_unique.cli import unique; celery.add_command(unique); sys.exit(main())"
)

APP_MODULE = '''
import time

import redis
from celery import Celery

from celery_unique import Payload, UniqueTask

app = Celery("cliapp")
app.conf.update(
    broker_url={broker!r},
    result_backend={broker!r},
    task_default_queue={queue!r},
    task_track_started=True,
    broker_connection_retry_on_startup=False,
    worker_hijack_root_logger=False,
    unique_backend={store!r},
    unique_namespace={namespace!r},
)
gates = redis.Redis.from_url({broker!r})


@app.task(
    base=UniqueTask,
    shared=False,
    name="cli.report",
    unique_key=lambda job: f"tenant:{{job.tenant}}",
    unique_while="active",
)
def report(tenant, gate=None):
    """Recalculate a tenant's report; with a gate, wait for it to open first."""
    deadline = time.monotonic() + 30
    while gate and not gates.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
    return tenant


@app.task(
    base=UniqueTask,
    shared=False,
    name="cli.charge",
    unique_window_key=Payload(only=[".request_id"]),
    unique_window=3600,
)
def charge(request_id, amount):
    return amount


@app.task(
    base=UniqueTask,
    shared=False,
    name="cli.export",
    unique_key=Payload(only=[".tenant"], prefix=False),
    unique_while="exists",
    unique_retention=600,
    unique_window_key=lambda job: f"request:{{job.request_id}}",
    unique_window=3600,
)
def export(tenant, request_id):
    """Export a tenant's data: one export per tenant across every task sharing the key."""
    return tenant


@app.task(
    base=UniqueTask,
    shared=False,
    name="cli.digest",
    unique_key=lambda job: f"tenant:{{job.tenant}}",
    unique_while="active",
    unique_on_duplicate="latest",
)
def digest(tenant, version):
    """Send a tenant's digest: the latest version asked for wins."""
    return version
'''


@dataclass
class CliApp:
    """An app module on disk, imported here too, and the way to run ``celery`` against it."""

    module: ModuleType
    directory: Path
    namespace: str
    store: RedisStore

    @property
    def app(self) -> Any:
        return self.module.app

    def run(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """``celery -A <module> unique <args>`` in a subprocess."""
        return run_celery(self.directory, "-A", self.module.__name__, "unique", *args, input=input)

    def ok(self, *args: str, input: str | None = None) -> str:
        """Run a command that must succeed; its standard output."""
        done = self.run(*args, input=input)
        assert done.returncode == 0, done.stderr or done.stdout
        return done.stdout

    def storage_key(self, kind: str, task: str, key: str) -> str:
        return keyspace.storage_key(self.namespace, kind, task, key)


def run_celery(
    directory: Path, *args: str, input: str | None = None, entry_point: bool = ENTRY_POINT
) -> subprocess.CompletedProcess[str]:
    """Run Celery's command line with ``directory`` importable."""
    python_path = os.pathsep.join(
        [str(directory), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    launcher = ["-m", "celery"] if entry_point else ["-c", BOOTSTRAP]
    return subprocess.run(
        [sys.executable, *launcher, "--no-color", *args],
        input=input if input is not None else "",
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": python_path},
        timeout=120,
        check=False,
    )


@pytest.fixture
def cli_app(
    tmp_path: Path, redis_url: str, celery_redis_url: str, redis_client: Any
) -> Iterator[CliApp]:
    """A fresh app module (own namespace and queue) with its store emptied."""
    name = f"cli_app_{uuid.uuid4().hex[:10]}"
    namespace = f"cli-{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        APP_MODULE.format(
            broker=celery_redis_url, store=redis_url, queue=fresh_queue_name(), namespace=namespace
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))
    store = RedisStore.from_url(redis_url)
    try:
        yield CliApp(module=module, directory=tmp_path, namespace=namespace, store=store)
    finally:
        store.close()
        unique_config.reset(module.app)
        module.gates.close()
        module.app.close()
        sys.modules.pop(name, None)
        with warnings.catch_warnings():
            # Celery's result backend leaves its connections to the collector.
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


@pytest.fixture
def worker(cli_app: CliApp) -> Iterator[Any]:
    """A real worker (solo pool, in a thread) consuming the app module's queue."""
    with start_worker(cli_app.app, perform_ping_check=False, shutdown_timeout=30) as running:
        yield running


def test_entry_point_registers_the_command(cli_app: CliApp) -> None:
    """Plain ``python -m celery -A app unique`` finds the command through its entry point."""
    assert ENTRY_POINT, "the installed package registers no celery.commands entry point 'unique'"
    done = run_celery(
        cli_app.directory, "-A", cli_app.module.__name__, "unique", "--help", entry_point=True
    )
    assert done.returncode == 0, done.stderr
    for command in ("list", "show", "release", "reap", "stats", "explain"):
        assert command in done.stdout


def test_a_running_jobs_key_is_listed_shown_and_released(cli_app: CliApp, worker: Any) -> None:
    """list and show report the job holding a key; release frees it for the next dispatch."""
    gate = f"gate-{uuid.uuid4().hex}"
    running = cli_app.module.report.delay(7, gate=gate)
    eventually(lambda: running.state == "STARTED", what="the job to start")

    listing = cli_app.ok("list").splitlines()
    assert listing[0].split() == ["KEY", "KIND", "SCOPE", "STATE", "JOB", "TASK", "EXPIRES", "IN"]
    assert listing[1].split()[:6] == [
        "cli.report:tenant:7",
        "active",
        "active",
        "held",
        running.id,
        "cli.report",
    ]
    assert len(listing) == 2

    shown = cli_app.ok("show", "cli.report:tenant:7")
    assert f"job:          {running.id} (STARTED)" in shown.splitlines()
    stored = cli_app.storage_key("a", "cli.report", "tenant:7")
    printable = stored.replace("\x1f", "\\x1f")
    assert f"storage key:  {printable}" in shown.splitlines()

    released = cli_app.ok("release", "cli.report:tenant:7", "--yes")
    assert released.strip() == f"released active key 'cli.report:tenant:7' (job {running.id})"
    assert cli_app.store.get(stored) is None
    assert "no keys held" in cli_app.ok("list")

    again = cli_app.module.report.delay(7, gate=gate)
    assert (again.duplicate, again.id != running.id) == (False, True)
    assert cli_app.store.get(stored).job_id == again.id  # type: ignore[union-attr]
    cli_app.module.gates.set(gate, 1)
    assert running.get(timeout=20) == 7
    assert again.get(timeout=20) == 7
    eventually(lambda: cli_app.store.get(stored) is None, what="the key's release")


def test_reap_frees_only_keys_of_jobs_that_ended(cli_app: CliApp, worker: Any) -> None:
    """A key left behind by a finished job is an orphan; a queued job's key is not."""
    finished = cli_app.module.report.delay(1)
    assert finished.get(timeout=20) == 1
    # The release was missed (say the job ran on a worker without the plugin):
    # put its key back through the store contract.
    orphan_key = cli_app.storage_key("a", "cli.report", "tenant:1")
    pending_key = cli_app.storage_key("a", "cli.report", "tenant:2")
    pending_job = job_uuid()  # never sent: the result backend knows nothing of it
    # The worker frees the key just after it stores the result; let it, or its
    # compare-and-delete would take away the key put back below.
    eventually(lambda: cli_app.store.get(orphan_key) is None, what="the worker's release")
    for job_id, key in ((finished.id, orphan_key), (pending_job, pending_key)):
        cli_app.store.decide(
            [Claim(job_id, "cli.report", active=ActiveClaim(key, Scope.ACTIVE, None))]
        )

    dry = cli_app.ok("reap").splitlines()
    assert dry[0].split() == ["KEY", "SCOPE", "JOB", "JOB", "STATE", "KEEP"]
    assert dry[1].split() == ["cli.report:tenant:1", "active", finished.id, "SUCCESS", "-"]
    assert dry[2:] == [
        "1 orphaned of 2 held active keys; kept (job may still run or is unknown): PENDING 1",
        "dry run: nothing released; run with --apply to release them",
    ]
    assert cli_app.store.get(orphan_key) is not None

    applied = json.loads(cli_app.ok("reap", "--apply", "--json"))
    assert [item["job_id"] for item in applied["released"]] == [finished.id]
    assert applied["kept"] == {"PENDING": 1}
    assert cli_app.store.get(orphan_key) is None
    assert cli_app.store.get(pending_key).job_id == pending_job  # type: ignore[union-attr]


def test_list_pages_filters_and_prints_json(cli_app: CliApp) -> None:
    """--limit/--offset page through keys, filters narrow them, --json prints every field."""
    jobs = {tenant: cli_app.module.report.delay(tenant).id for tenant in range(5)}
    cli_app.module.charge.delay("R1", 10)

    first = cli_app.ok("list", "--kind", "active", "--limit", "2").splitlines()
    assert [line.split()[0] for line in first[1:3]] == [
        "cli.report:tenant:0",
        "cli.report:tenant:1",
    ]
    assert first[3] == "... more keys: --offset 2"
    last = json.loads(cli_app.ok("list", "--kind", "active", "--offset", "4", "--json"))
    assert [item["job_id"] for item in last["keys"]] == [jobs[4]]
    assert last["more"] is False
    assert last["keys"][0]["storage_key"] == cli_app.storage_key("a", "cli.report", "tenant:4")

    windows = json.loads(cli_app.ok("list", "--task", "cli.charge", "--json"))["keys"]
    assert [(item["kind"], item["task"]) for item in windows] == [("window", "cli.charge")]
    matched = json.loads(cli_app.ok("list", "--match", "*:tenant:[13]", "--json"))["keys"]
    assert [item["job_id"] for item in matched] == [jobs[1], jobs[3]]


def test_list_by_task_finds_the_key_it_shares_beside_its_own(cli_app: CliApp) -> None:
    """A dispatch holding a key shared across tasks (``prefix=False``) and a window key
    scoped to its task: ``list --task`` finds both, and the reaper would keep the shared
    one for that task's own retention (it goes by the task each key reads back)."""
    job = cli_app.module.export.delay(7, "R1")
    listed = json.loads(cli_app.ok("list", "--task", "cli.export", "--json"))["keys"]
    assert sorted((item["kind"], item["job_id"]) for item in listed) == [
        ("active", job.id),
        ("window", job.id),
    ]
    (shared,) = operations.list_keys(cli_app.app, kind="active")
    assert (shared.key_scope, shared.task) == ("", "cli.export")
    assert operations.retention_ms(cli_app.app, shared) == 600_000


def test_stats_counts_keys(cli_app: CliApp) -> None:
    """stats counts keys per kind, scope and task, as JSON and as a table."""
    for tenant in (1, 2):
        cli_app.module.report.delay(tenant)
    cli_app.module.charge.delay("R1", 10)
    counts = json.loads(cli_app.ok("stats", "--json"))
    assert counts == {
        "namespace": cli_app.namespace,
        "keys": 3,
        "kinds": {"active": 2, "window": 1},
        "scopes": {"queued": 0, "active": 2, "exists": 0},
        "held": 2,
        "finished": 0,
        "tasks": {
            "cli.charge": {"held": 0, "finished": 0, "window": 1},
            "cli.report": {"held": 2, "finished": 0, "window": 0},
        },
    }
    text = cli_app.ok("stats").splitlines()
    assert text[0] == f"namespace {cli_app.namespace!r}: 3 keys"
    assert text[-2].split() == ["cli.charge", "0", "0", "1"]
    assert text[-1].split() == ["cli.report", "2", "0", "0"]


def test_explain_tells_why_a_job_would_not_be_created(cli_app: CliApp) -> None:
    """explain names the job a dispatch would reuse or collide with, and writes nothing."""
    first = cli_app.module.charge.delay("R1", 10)
    same = cli_app.ok("explain", "cli.charge", "--kwargs", '{"request_id": "R1", "amount": 10}')
    assert same.splitlines()[1] == f"verdict: would reuse job {first.id} (window)"
    other = json.loads(cli_app.ok("explain", "cli.charge", "--args", '["R1", 11]', "--json"))
    assert (other["verdict"], other["window"]["same_request"]) == (
        f"would conflict with job {first.id}",
        False,
    )
    fresh = cli_app.ok("explain", "cli.charge", "--args", '["R2", 11]')
    assert fresh.splitlines()[1] == "verdict: would create"
    assert json.loads(cli_app.ok("stats", "--json"))["keys"] == 1

    bad = cli_app.run("explain", "cli.report", "--kwargs", '{"tenant": 1, "nope": 2}')
    assert bad.returncode == 1
    assert bad.stderr.startswith("Error: the dispatch would fail with TypeError: ")
    assert "nope" in bad.stderr
    unknown = cli_app.run("explain", "cli.missing")
    assert (unknown.returncode, "'cli.missing' is not registered" in unknown.stderr) == (1, True)
    invalid = cli_app.run(
        "explain", "cli.report", "--args", "[1]", "--options", '{"unique_key": "x"}'
    )
    assert invalid.returncode == 1
    assert "would fail with uniqueness_key_mismatch" in invalid.stderr


def test_release_asks_first_and_compares_the_job_id(cli_app: CliApp) -> None:
    """Without --yes, release asks; 'n' keeps the key; --job-id of another job keeps it too."""
    held = cli_app.module.report.delay(3)
    stored = cli_app.storage_key("a", "cli.report", "tenant:3")

    refused = cli_app.run("release", "cli.report:tenant:3", input="n\n")
    assert refused.returncode == 1
    assert f"Release active key 'cli.report:tenant:3' held by job {held.id}?" in refused.stdout
    assert cli_app.store.get(stored) is not None

    other = cli_app.run("release", "cli.report:tenant:3", "--job-id", job_uuid(), "--yes")
    assert other.returncode == 1
    assert "'cli.report:tenant:3' is not held by job " in other.stderr
    assert cli_app.store.get(stored) is not None

    cli_app.ok("release", stored.replace("\x1f", "\\x1f"), "--job-id", held.id, input="y\n")
    assert cli_app.store.get(stored) is None
    missing = cli_app.run("show", "cli.report:tenant:3")
    assert missing.returncode == 1
    # A key given with its task is named as not held, without a hint to add a task name.
    assert missing.stderr.strip() == (
        f"Error: 'cli.report:tenant:3' is not held in namespace {cli_app.namespace!r} "
        "(released or expired)"
    )
    bare = cli_app.run("show", "tenant:3")
    assert "'tenant:3' is not held" in bare.stderr
    assert "give '<task name>:tenant:3'" in bare.stderr


def test_release_of_an_ambiguous_key_names_the_candidates(cli_app: CliApp) -> None:
    """The same display key held as active and window key: release asks for --kind."""
    active = cli_app.storage_key("a", "cli.report", "same")
    window = cli_app.storage_key("w", "cli.report", "same")
    cli_app.store.decide(
        [
            Claim("j1", "cli.report", active=ActiveClaim(active, Scope.QUEUED, None)),
            Claim("j2", "cli.report", window=WindowClaim(window, 60_000, "f" * 32, "p" * 16)),
        ]
    )
    runner = CliRunner()
    context = CLIContext(app=cli_app.app, no_color=True, workdir=None)
    ambiguous = runner.invoke(unique, ["release", "cli.report:same", "--yes"], obj=context)
    assert ambiguous.exit_code == 1
    assert "names 2 held keys" in ambiguous.output
    narrowed = runner.invoke(
        unique, ["release", "cli.report:same", "--kind", "window", "--yes"], obj=context
    )
    assert narrowed.exit_code == 0, narrowed.output
    assert (cli_app.store.get(active) is not None, cli_app.store.get(window)) == (True, None)


def test_keys_that_print_invisibly_are_kept_exact_and_shown_escaped(cli_app: CliApp) -> None:
    """A key holding U+202E (which reorders the text after it) or a zero-width space is
    stored exactly, and ``list`` and ``show`` write those characters as ``\\uXXXX``, so two
    keys that look alike on a terminal read apart."""
    tenant = "7\u202e1\u200b"
    job = cli_app.module.report.delay(tenant)
    stored = cli_app.storage_key("a", "cli.report", f"tenant:{tenant}")
    assert cli_app.store.get(stored).job_id == job.id  # type: ignore[union-attr]

    listing = cli_app.ok("list")
    assert listing.splitlines()[1].split()[0] == "cli.report:tenant:7\\u202e1\\u200b"
    shown = cli_app.ok("show", f"cli.report:tenant:{tenant}")
    assert "key:          cli.report:tenant:7\\u202e1\\u200b" in shown.splitlines()
    assert "\\u202e1\\u200b" in next(
        line for line in shown.splitlines() if line.startswith("storage key:")
    )
    for output in (listing, shown):
        assert "\u202e" not in output
        assert "\u200b" not in output


def test_release_all_lists_asks_and_frees_every_key(cli_app: CliApp) -> None:
    """release --all lists what it would release (--dry-run stops there), asks, then frees."""
    jobs = [cli_app.module.report.delay(tenant).id for tenant in (1, 2)]
    window = cli_app.module.charge.delay("R1", 10).id

    def listed() -> set[str]:
        return {item["job_id"] for item in json.loads(cli_app.ok("list", "--json"))["keys"]}

    dry = cli_app.ok("release", "--all", "--dry-run")
    assert [line.split()[1:4] for line in dry.splitlines()[1:4]] == [
        ["active", "held", jobs[0]],
        ["active", "held", jobs[1]],
        ["window", "remembered", window],
    ]
    assert dry.splitlines()[-1] == (
        f"dry run: 3 keys held in namespace {cli_app.namespace!r}; nothing released"
    )
    assert listed() == {*jobs, window}

    refused = cli_app.run("release", "--all", "--task", "cli.report", input="n\n")
    assert refused.returncode == 1
    assert (
        f"Release the 2 keys listed, held in namespace {cli_app.namespace!r} "
        "(all keys of task 'cli.report')?"
    ) in refused.stdout
    assert listed() == {*jobs, window}

    freed = cli_app.ok("release", "--all", "--task", "cli.report", input="y\n")
    assert freed.endswith("? [y/N]: released 2 of 2 keys\n")
    assert listed() == {window}
    assert cli_app.module.report.delay(1).id not in jobs

    cli_app.ok("release", "--all", "--yes")
    assert listed() == set()
    assert cli_app.ok("release", "--all").strip() == (
        f"no keys held in namespace {cli_app.namespace!r}: nothing to release"
    )


def test_release_needs_a_key_or_all_but_not_both(cli_app: CliApp) -> None:
    """release alone, KEY with --all, --task without --all: usage errors, nothing released."""
    cli_app.module.report.delay(1)
    refused = (["release"], ["release", "k:1", "--all"], ["release", "k:1", "--task", "t"])
    for args in refused:
        done = cli_app.run(*args, "--yes")
        assert done.returncode == 2, (args, done.stderr)
    assert json.loads(cli_app.ok("stats", "--json"))["keys"] == 1


def test_bulk_release_leaves_a_key_that_changed_hands(cli_app: CliApp) -> None:
    """release_many deletes each key only while the job it was listed with holds it."""
    app = cli_app.app
    first = cli_app.module.report.delay(1).id
    cli_app.module.report.delay(2)
    listed = operations.list_keys(app)
    assert operations.release(app, "cli.report:tenant:1")
    again = cli_app.module.report.delay(1).id
    assert again != first
    released = operations.release_many(app, listed)
    assert [info.display_key for info in released] == ["cli.report:tenant:2"]
    assert [info.job_id for info in operations.list_keys(app)] == [again]


def test_release_keeps_a_latest_key_whose_duplicates_left_it_arguments_unless_told(
    cli_app: CliApp,
) -> None:
    """A latest job runs with its duplicate's arguments: release (one key or
    --all) keeps its key, saying why, and only --drop-owed releases it."""
    digest = cli_app.module.digest
    job = digest.delay(1, "v1")
    assert digest.delay(1, "v2").arguments_replaced
    stored = cli_app.storage_key("a", "cli.digest", "tenant:1")

    refused = cli_app.run("release", "cli.digest:tenant:1", "--yes")
    assert refused.returncode == 1
    assert f"its job {job.id} follows its duplicates" in refused.stderr
    assert "(latest arguments " in refused.stderr
    assert "--drop-owed" in refused.stderr
    bulk = cli_app.ok("release", "--all", "--yes")
    assert "released 0 of 1 key; 1 kept" in bulk
    assert "'cli.digest:tenant:1'" in bulk
    assert cli_app.store.get(stored).job_id == job.id  # type: ignore[union-attr]

    cli_app.ok("release", "cli.digest:tenant:1", "--yes", "--drop-owed")
    assert cli_app.store.get(stored) is None
