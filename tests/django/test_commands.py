"""``manage.py celery_unique``, on the example project.

Each test runs on the example's Django store (SQLite), on PostgreSQL
(``django://postgres``) and on Redis: the commands work on whatever store the
Celery app uses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from django.core.management import (
    ManagementUtility,
    call_command,
    get_commands,
)
from django.core.management.base import CommandError
from django.test import override_settings

from celery_unique import Disposition, cli
from celery_unique.config import reset, runtime
from celery_unique.operations import iter_keys
from tests.django.conftest import require_database
from tests.django.example.shop.tasks import charge, recalculate_totals

pytestmark = pytest.mark.django_db(transaction=True)

REPO = Path(__file__).resolve().parents[2]
ADA = f"{recalculate_totals.name}:customer:ada"
#: The per-operation commands of releases up to 0.1.0, removed since.
OLD_NAMES = ["unique_list", "unique_show", "unique_release", "unique_reap", "unique_stats"]


@pytest.fixture(
    params=[
        pytest.param("django://", id="sqlite"),
        pytest.param(
            "django://postgres",
            id="postgres",
            marks=[
                pytest.mark.postgres,
                pytest.mark.django_db(transaction=True, databases=["default", "postgres"]),
            ],
        ),
        pytest.param("redis", id="redis", marks=pytest.mark.redis),
    ]
)
def store(request: pytest.FixtureRequest, example_app: Celery) -> Iterator[str]:
    """The example app on one store; yields its namespace."""
    url = request.param
    if url == "django://postgres":
        require_database("postgres")
    if url == "redis":
        url = request.getfixturevalue("redis_url")
    # A namespace of its own: the Redis database is shared with other tests and runs.
    namespace = f"example-{uuid.uuid4().hex[:8]}"
    with override_settings(CELERY_UNIQUE_BACKEND=url, CELERY_UNIQUE_NAMESPACE=namespace):
        reset(example_app)
        try:
            yield namespace
        finally:
            for info in iter_keys(example_app):
                runtime(example_app).store.delete(info.storage_key)
            reset(example_app)


def run(*args: str, **options: Any) -> str:
    """What the command printed on stdout."""
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO(), **options)
    return out.getvalue()


def steady(printed: str) -> Any:
    """JSON output without the countdowns, which move between two runs."""

    def without_countdowns(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                name: without_countdowns(each)
                for name, each in value.items()
                if name not in {"expires_in_ms", "keep_ms"}
            }
        if isinstance(value, list):
            return [without_countdowns(each) for each in value]
        return value

    return without_countdowns(json.loads(printed))


def held_jobs(app: Celery) -> set[str]:
    """The jobs holding keys of the app's namespace."""
    return {info.job_id for info in iter_keys(app)}


# -- manage.py celery_unique <command> ----------------------------------------------


def test_list_shows_every_key_of_the_namespace(example_app: Celery, store: str) -> None:
    """celery_unique list prints one row per key: key, kind, scope, state, job, task, expiry."""
    ada = recalculate_totals.delay("ada").id
    order = charge.delay(order_id=1, amount_cents=5).id
    out = run("celery_unique", "list")
    assert out.splitlines()[0].split() == [
        "KEY",
        "KIND",
        "SCOPE",
        "STATE",
        "JOB",
        "TASK",
        "EXPIRES",
        "IN",
    ]
    assert ADA in out
    assert ada in out
    assert order in out
    only_windows = json.loads(run("celery_unique", "list", "--kind", "window", "--json"))
    assert [key["job_id"] for key in only_windows["keys"]] == [order]
    first = json.loads(run("celery_unique", "list", "--limit", "1", "--json"))
    assert (len(first["keys"]), first["more"]) == (1, True)


def test_show_names_the_holder(example_app: Celery, store: str) -> None:
    """celery_unique show finds a key by its display form and tells who holds it."""
    job = recalculate_totals.delay("ada").id
    out = run("celery_unique", "show", ADA)
    assert job in out
    assert "queued" in out
    with pytest.raises(CommandError, match=r"is not held in namespace .* \(released or expired\)$"):
        run("celery_unique", "show", f"{recalculate_totals.name}:customer:nobody")


def test_release_frees_the_key(example_app: Celery, store: str) -> None:
    """celery_unique release --yes frees the key; a second release finds nothing."""
    recalculate_totals.delay("ada")
    assert "released active key" in run("celery_unique", "release", ADA, "--yes")
    assert recalculate_totals.delay("ada").disposition is Disposition.CREATED
    run("celery_unique", "release", "-y", ADA)
    with pytest.raises(CommandError, match="is not held in namespace"):
        run("celery_unique", "release", ADA, "--yes")


def test_release_all_lists_then_frees_every_key(
    example_app: Celery,
    store: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """release --all lists the keys; --dry-run stops there, a "no" keeps them, --yes frees them."""
    ada = recalculate_totals.delay("ada").id
    order = charge.delay(order_id=1, amount_cents=5).id
    dry = run("celery_unique", "release", "--all", "--dry-run")
    assert ada in dry
    assert order in dry
    assert dry.splitlines()[-1] == f"dry run: 2 keys held in namespace {store!r}; nothing released"
    monkeypatch.setattr("sys.stdin", StringIO("n\n"))
    with pytest.raises(CommandError, match="aborted"):
        run("celery_unique", "release", "--all", "--kind", "active")
    assert f"Release the 1 key listed, held in namespace {store!r} (active keys)?" in (
        capsys.readouterr().out
    )
    assert held_jobs(example_app) == {ada, order}
    out = run("celery_unique", "release", "--all", "--task", recalculate_totals.name, "--yes")
    assert out.splitlines()[-1] == "released 1 of 1 key"
    assert held_jobs(example_app) == {order}


def test_release_asks_first(
    example_app: Celery,
    store: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --yes, release asks; anything but yes aborts and leaves the key held."""
    job = recalculate_totals.delay("ada").id
    monkeypatch.setattr("sys.stdin", StringIO("n\n"))
    with pytest.raises(CommandError, match="aborted"):
        run("celery_unique", "release", ADA)
    assert f"Release active key {ADA!r} held by job {job}?" in capsys.readouterr().out
    assert held_jobs(example_app) == {job}
    monkeypatch.setattr("sys.stdin", StringIO("y\n"))
    assert "released active key" in run("celery_unique", "release", ADA)
    assert held_jobs(example_app) == set()


def test_release_with_job_id_is_compare_and_delete(example_app: Celery, store: str) -> None:
    """--job-id of a job that does not hold the key releases nothing."""
    job = recalculate_totals.delay("ada").id
    with pytest.raises(CommandError, match="is not held by job not-that-one"):
        run("celery_unique", "release", ADA, "--job-id", "not-that-one", "--yes")
    assert held_jobs(example_app) == {job}


def test_reap_is_a_dry_run_until_applied(example_app: Celery, store: str) -> None:
    """celery_unique reap reports keys whose job has finished; --apply frees them."""
    done = recalculate_totals.delay("ada").id
    running = recalculate_totals.delay("bob").id
    example_app.backend.mark_as_done(done, 0)
    dry = run("celery_unique", "reap")
    assert "1 orphaned of 2 held active keys" in dry
    assert done in dry
    assert "dry run" in dry
    assert held_jobs(example_app) == {done, running}
    assert "released 1" in run("celery_unique", "reap", "--apply")
    assert held_jobs(example_app) == {running}


def test_stats_counts_keys_and_reports_the_store(example_app: Celery, store: str) -> None:
    """celery_unique stats counts per kind and task; the Django store adds its own figures."""
    recalculate_totals.delay("ada")
    recalculate_totals.delay("bob")
    charge.delay(order_id=1, amount_cents=5)
    out = run("celery_unique", "stats")
    assert f"namespace {store!r}: 3 keys" in out
    assert "active 2" in out
    assert "window 1" in out
    url = runtime(example_app).backend_url
    if url.startswith("django://"):
        assert "expired rows awaiting sweep: 0" in out
        assert f"database: {url.removeprefix('django://') or 'default'}" in out
    else:
        assert "expired rows" not in out
    assert json.loads(run("celery_unique", "stats", "--json"))["kinds"] == {
        "active": 2,
        "window": 1,
    }


def test_explain_tells_what_a_dispatch_would_do(example_app: Celery, store: str) -> None:
    """celery_unique explain gives the verdict of a dispatch without making it."""
    name = recalculate_totals.name
    fresh = run("celery_unique", "explain", name, "--args", '["ada"]')
    assert fresh.splitlines()[1] == "verdict: would create"
    assert held_jobs(example_app) == set()
    job = recalculate_totals.delay("ada").id
    again = json.loads(
        run("celery_unique", "explain", name, "--kwargs", '{"customer": "ada"}', "--json")
    )
    assert again["verdict"] == f"would reuse job {job} (active)"
    out = StringIO()
    # --json reports a dispatch that would fail as JSON, and still fails.
    with pytest.raises(CommandError, match="exited with status 1") as failed:
        call_command(
            "celery_unique", "explain", name, "--kwargs", '{"nope": 1}', "--json", stdout=out
        )
    assert failed.value.returncode == 1
    assert json.loads(out.getvalue())["error"]["code"] == "TypeError"


# -- one parser: the CLI's -----------------------------------------------------------


#: Celery's own program with the ``unique`` group, as its entry point adds it.
CELERY = (
    "import sys; from celery.bin.celery import celery, main; "
    "from celery_unique.cli import unique; celery.add_command(unique); sys.exit(main())"
)


def celery_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A <the example app> unique ARGS``, the program operators run."""
    return subprocess.run(
        [sys.executable, "-c", CELERY, "-A", "tests.django.example.celery:app", "unique", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_negative_limit_is_refused_as_celery_unique_refuses_it(example_app: Celery) -> None:
    """--limit -1: the command refuses it with `celery unique list`'s message."""
    celery = celery_cli("list", "--limit", "-1")
    assert celery.returncode == 2, celery.stderr
    message = celery.stderr.strip().splitlines()[-1].removeprefix("Error: ")
    assert message == "Invalid value for '--limit': -1 is not in the range x>=0."
    with pytest.raises(CommandError) as refused:
        run("celery_unique", "list", "--limit", "-1")
    assert (str(refused.value), refused.value.returncode) == (message, 2)


def test_a_refusal_exits_with_the_clis_status(capsys: pytest.CaptureFixture[str]) -> None:
    """From the command line, manage.py prints the CLI's message and exits 2 like the CLI."""
    with pytest.raises(SystemExit) as exited:
        ManagementUtility(["manage.py", "celery_unique", "list", "--offset", "-3"]).execute()
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "CommandError: Invalid value for '--offset': -3 is not in the range x>=0."
    )


def test_every_cli_command_is_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a command it prints the CLI group's help: every `celery unique` command."""
    run("celery_unique")
    listing = capsys.readouterr().out
    assert "Usage: manage.py celery_unique [OPTIONS] COMMAND [ARGS]..." in listing
    for name in cli.unique.commands:
        assert f"\n  {name} " in listing
    run("celery_unique", "release", "--help")
    helped = capsys.readouterr().out
    assert "Usage: manage.py celery_unique release [OPTIONS] [KEY]" in helped
    assert "--job-id" in helped
    assert "--all" in helped


def test_djangos_options_go_before_the_command(example_app: Celery) -> None:
    """Django's options go before the command; after it they are the CLI's, which refuses them."""
    listed = run("celery_unique", "--app", "tests.django.example.celery:app", "list")
    assert "no keys held in namespace 'example' match" in listed
    with pytest.raises(CommandError) as refused:
        run("celery_unique", "list", "--app", "tests.django.example.celery:app")
    assert str(refused.value) == (
        "No such option '--app'. --app is one of Django's options: give it before 'list'."
    )


def test_app_option_names_another_app() -> None:
    """--app picks the Celery app; one that cannot be imported is a command error."""
    with pytest.raises(CommandError, match="cannot be imported"):
        run("celery_unique", "--app", "no.such.module:app", "stats")


def test_commands_are_listed_under_the_apps_import_name() -> None:
    """manage.py help lists celery_unique, alone, under [celery_unique_django]."""
    assert get_commands()["celery_unique"] == "celery_unique_django"
    assert not set(OLD_NAMES) & set(get_commands())
    text = ManagementUtility(["manage.py", "help"]).main_help_text()
    section = text.split("[celery_unique_django]\n", 1)[1].split("\n\n", 1)[0]
    assert section.split() == ["celery_unique"]
