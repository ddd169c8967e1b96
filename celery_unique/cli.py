"""``celery -A proj unique ...``: look at and manage held keys from the command line.

Registered through Celery's ``celery.commands`` entry point, so the app, its
configuration and ``--no-color``/``--quiet`` come from ``celery`` itself::

    celery -A proj unique list [--kind active|window] [--task NAME] [--match GLOB]
                               [--limit N] [--offset N] [--json]
    celery -A proj unique show KEY [--kind active|window] [--json]
    celery -A proj unique release KEY [--kind ...] [--job-id ID] [--yes]
    celery -A proj unique release --all [--task NAME] [--kind ...] [--dry-run] [--yes]
    celery -A proj unique reap [--apply] [--json]
    celery -A proj unique stats [--json]
    celery -A proj unique explain TASK_NAME [--args JSON] [--kwargs JSON] [--options JSON] [--json]
    celery -A proj unique check [--fleet] [--no-store] [--json]

Every command acts on the app's namespace (``unique_namespace``) only.

:func:`run` runs the same group inside another program, on an app that
program already has: the Django app's ``manage.py celery_unique`` does, so
its options are these and cannot drift from them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click
from celery import Celery
from celery.bin.base import CeleryCommand, CeleryOption, CLIContext, handle_preload_options

from celery_unique import checks, operations
from celery_unique.config import runtime
from celery_unique.exceptions import UniquenessError
from celery_unique.explain import explain_dispatch
from celery_unique.keys import keyspace
from celery_unique.keys.keyspace import shown
from celery_unique.operations import KeyInfo, format_ms
from celery_unique.stores.base import Store

F = TypeVar("F", bound=Callable[..., Any])

_KIND = click.Choice(["active", "window"])


def _operator_errors(command: F) -> F:
    """Report the library's errors as a one-line message and exit status 1."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (UniquenessError, operations.AmbiguousKey, operations.OwedToDuplicates) as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper  # type: ignore[return-value]


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Rows as left-aligned columns under their headers."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    )


def _echo_json(ctx: click.Context, value: Any) -> None:
    ctx.obj.echo(json.dumps(value, indent=2, sort_keys=True))


def _app(ctx: click.Context) -> Any:
    return ctx.obj.app


def _job_state(app: Any, job_id: str) -> str:
    try:
        return operations.job_state(app, job_id)
    except NotImplementedError:
        return "unknown (no result backend)"


@click.group(name="unique")
@click.pass_context
@handle_preload_options
def unique(ctx: click.Context) -> None:
    """Inspect and manage celery-unique keys: list, show, release, reap, stats, explain, check."""


@unique.command(name="list", cls=CeleryCommand)
@click.option("--kind", type=_KIND, cls=CeleryOption, help_group="Filters", help="Key kind.")
@click.option(
    "--task", cls=CeleryOption, help_group="Filters", help="Only keys written by this task."
)
@click.option(
    "--match",
    cls=CeleryOption,
    help_group="Filters",
    help="Shell pattern on the display key, e.g. 'proj.tasks.report:tenant:*'.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=100,
    show_default=True,
    cls=CeleryOption,
    help_group="Paging",
    help="At most this many keys.",
)
@click.option(
    "--offset",
    type=click.IntRange(min=0),
    default=0,
    cls=CeleryOption,
    help_group="Paging",
    help="Skip this many keys (ordered by storage key).",
)
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help="Print JSON.")
@click.pass_context
@_operator_errors
def list_(
    ctx: click.Context,
    kind: str | None,
    task: str | None,
    match: str | None,
    limit: int,
    offset: int,
    as_json: bool,
) -> None:
    """List held keys."""
    app = _app(ctx)
    # One more than asked for tells whether another page exists.
    found = operations.list_keys(
        app, kind=kind, task=task, match=match, limit=limit + 1, offset=offset
    )
    page, more = found[:limit], len(found) > limit
    if as_json:
        _echo_json(ctx, {"keys": [info.as_dict() for info in page], "offset": offset, "more": more})
        return
    if not page:
        ctx.obj.echo(f"no keys held in namespace {runtime(app).namespace!r} match")
        return
    ctx.obj.echo(
        table(
            ["KEY", "KIND", "SCOPE", "STATE", "JOB", "TASK", "EXPIRES IN"],
            [
                [
                    shown(info.display_key),
                    info.kind.value,
                    info.scope.value if info.scope else "-",
                    info.state,
                    info.job_id,
                    info.task,
                    format_ms(info.expires_in_ms),
                ]
                for info in page
            ],
        )
    )
    if more:
        ctx.obj.echo(f"... more keys: --offset {offset + limit}")


def _describe(info: KeyInfo, state: str) -> str:
    rows = [
        ("key", shown(info.display_key)),
        ("storage key", info.printable_storage_key),
        ("kind", info.kind.value + (f" (while {info.scope.value})" if info.scope else "")),
        ("job", f"{info.job_id} ({state})"),
        ("task", info.task),
        ("state", info.state),
        ("expires in", format_ms(info.expires_in_ms)),
    ]
    if info.fingerprint:
        rows += [("fingerprint", info.fingerprint), ("policy", info.policy or "-")]
    if info.duplicates:
        rows.append(("duplicates", info.duplicates))
    return "\n".join(f"{name + ':':<13} {value}" for name, value in rows)


def _not_held(app: Any, key: str, job_id: str | None = None) -> str:
    """Why nothing was found for KEY: it is not held, and, if it may lack its task, how to ask."""
    if job_id:
        why = f"is not held by job {job_id} in namespace {runtime(app).namespace!r} (released, "
        why += "expired or held by another job)"
    else:
        why = f"is not held in namespace {runtime(app).namespace!r} (released or expired)"
    return f"{key!r} {why}" + _scoped_hint(app, key)


def _scoped_hint(app: Any, key: str) -> str:
    """A hint for a key given without its task name; none for a key that has one."""
    if key.startswith(keyspace.PREFIX) or _names_a_task(app, key):
        return ""
    return (
        f"; if it is scoped to its task (declared without unique_prefix=False), "
        f"give '<task name>:{key}', or find it with: unique list --match '*:{key}'"
    )


def _names_a_task(app: Any, key: str) -> bool:
    """Whether KEY starts with the name of one of the app's tasks: a display key."""
    app.loader.import_default_modules()
    return any(key.startswith(f"{name}:") for name in app.tasks)


@unique.command(cls=CeleryCommand)
@click.argument("key")
@click.option("--kind", type=_KIND, cls=CeleryOption, help="Only this kind of key.")
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help="Print JSON.")
@click.pass_context
@_operator_errors
def show(ctx: click.Context, key: str, kind: str | None, as_json: bool) -> None:
    """Show who holds KEY (a display key 'task:key', a bare key, or a storage key)."""
    app = _app(ctx)
    found = operations.show(app, key, kind=kind)
    if not found:
        raise click.ClickException(_not_held(app, key))
    states = [_job_state(app, info.job_id) for info in found]
    if as_json:
        _echo_json(
            ctx,
            [
                {**info.as_dict(), "job_state": state}
                for info, state in zip(found, states, strict=True)
            ],
        )
        return
    ctx.obj.echo(
        "\n\n".join(_describe(info, state) for info, state in zip(found, states, strict=True))
    )


@unique.command(cls=CeleryCommand)
@click.argument("key", required=False)
@click.option("--kind", type=_KIND, cls=CeleryOption, help="Only this kind of key.")
@click.option("--job-id", cls=CeleryOption, help="Release only while this job holds the key.")
@click.option(
    "--all",
    "release_all",
    is_flag=True,
    cls=CeleryOption,
    help="Release every held key of the namespace (of --task, of --kind), listing them first.",
)
@click.option("--task", cls=CeleryOption, help="With --all: only keys written by this task.")
@click.option(
    "--dry-run", is_flag=True, cls=CeleryOption, help="With --all: list the keys, release none."
)
@click.option(
    "--drop-owed",
    is_flag=True,
    cls=CeleryOption,
    help="Release even a latest/debounce key whose job holds what its duplicates left it "
    "(a run owed to them, their arguments): that is lost.",
)
@click.option("--yes", "-y", is_flag=True, cls=CeleryOption, help="Do not ask for confirmation.")
@click.pass_context
@_operator_errors
def release(
    ctx: click.Context,
    key: str | None,
    kind: str | None,
    job_id: str | None,
    release_all: bool,
    task: str | None,
    dry_run: bool,
    drop_owed: bool,
    yes: bool,
) -> None:
    """Release KEY (or, with --all, every held key) now, so the next dispatch creates a job.

    The job holding it is not stopped; a duplicate of it may then run beside it.
    A latest/debounce key whose job holds what its duplicates left it (a run owed to
    them, their arguments) is kept, unless --drop-owed.
    """
    if release_all:
        if key is not None or job_id is not None:
            raise click.UsageError("--all releases every key: give no KEY and no --job-id")
        _release_every_key(ctx, kind=kind, task=task, dry_run=dry_run, drop_owed=drop_owed, yes=yes)
        return
    if key is None:
        raise click.UsageError("give the KEY to release, or --all")
    if task is not None or dry_run:
        raise click.UsageError("--task and --dry-run go with --all")
    app = _app(ctx)
    info = operations.resolve(app, key, kind=kind, job_id=job_id)
    if info is None:
        raise click.ClickException(_not_held(app, key, job_id))
    if not yes:
        click.confirm(
            f"Release {info.kind.value} key {info.display_key!r} held by job {info.job_id}?",
            abort=True,
        )
    if not operations.release(app, info.storage_key, job_id=info.job_id, drop_owed=drop_owed):
        raise click.ClickException(
            f"{info.display_key!r} was not released: it no longer points at job {info.job_id}"
        )
    ctx.obj.echo(f"released {info.kind.value} key {info.display_key!r} (job {info.job_id})")


def _keys(count: int) -> str:
    return f"{count} key" if count == 1 else f"{count} keys"


def _release_every_key(
    ctx: click.Context,
    *,
    kind: str | None,
    task: str | None,
    dry_run: bool,
    drop_owed: bool,
    yes: bool,
) -> None:
    """``release --all``: list what would go, ask, then release each key still held by its job."""
    app = _app(ctx)
    held = operations.list_keys(app, kind=kind, task=task)
    where = f"namespace {runtime(app).namespace!r}"
    if kind or task:
        where += f" ({kind or 'all'} keys{f' of task {task!r}' if task else ''})"
    if not held:
        ctx.obj.echo(f"no keys held in {where}: nothing to release")
        return
    ctx.obj.echo(
        table(
            ["KEY", "KIND", "STATE", "JOB", "TASK"],
            [[shown(i.display_key), i.kind.value, i.state, i.job_id, i.task] for i in held],
        )
    )
    if dry_run:
        ctx.obj.echo(f"dry run: {_keys(len(held))} held in {where}; nothing released")
        return
    if not yes:
        click.confirm(f"Release the {_keys(len(held))} listed, held in {where}?", abort=True)
    spared: list[operations.KeyInfo] = []
    released = operations.release_many(app, held, drop_owed=drop_owed, spared=spared)
    moved = len(held) - len(released) - len(spared)
    ctx.obj.echo(
        f"released {len(released)} of {_keys(len(held))}"
        + (f"; {moved} changed hands since listed and were left alone" if moved else "")
        + (
            f"; {len(spared)} kept, their latest/debounce jobs holding what their "
            "duplicates left them (--drop-owed releases them): "
            + ", ".join(repr(info.display_key) for info in spared)
            if spared
            else ""
        )
    )


@unique.command(cls=CeleryCommand)
@click.option(
    "--apply", is_flag=True, cls=CeleryOption, help="Release the orphans (default: dry run)."
)
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help="Print JSON.")
@click.pass_context
@_operator_errors
def reap(ctx: click.Context, apply: bool, as_json: bool) -> None:
    """Find active keys whose job has ended (result backend) and, with --apply, release them."""
    report = operations.reap(_app(ctx), apply=apply)
    if as_json:
        _echo_json(ctx, report.as_dict())
        return
    if report.orphans:
        ctx.obj.echo(
            table(
                ["KEY", "SCOPE", "JOB", "JOB STATE", "KEEP"],
                [
                    [
                        shown(orphan.key.display_key),
                        orphan.key.scope.value if orphan.key.scope else "-",
                        orphan.key.job_id,
                        orphan.state,
                        "-" if orphan.keep_ms == 0 else format_ms(orphan.keep_ms),
                    ]
                    for orphan in report.orphans
                ],
            )
        )
    kept = ", ".join(f"{state} {count}" for state, count in sorted(report.kept.items()))
    ctx.obj.echo(
        f"{len(report.orphans)} orphaned of {report.checked} held active keys"
        + (f"; kept (job may still run or is unknown): {kept}" if kept else "")
    )
    if apply:
        ctx.obj.echo(f"released {len(report.released)}")
    elif report.orphans:
        ctx.obj.echo("dry run: nothing released; run with --apply to release them")


@unique.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help="Print JSON.")
@click.pass_context
@_operator_errors
def stats(ctx: click.Context, as_json: bool) -> None:
    """Count held keys per kind, scope and task."""
    counts = operations.stats(_app(ctx))
    if as_json:
        _echo_json(ctx, counts)
        return
    kinds, scopes = counts["kinds"], counts["scopes"]
    ctx.obj.echo(
        f"namespace {counts['namespace']!r}: {counts['keys']} keys\n"
        f"active {kinds['active']} (held {counts['held']}, finished {counts['finished']}), "
        f"window {kinds['window']}\n"
        + ", ".join(f"{scope} {count}" for scope, count in scopes.items())
    )
    if counts["tasks"]:
        ctx.obj.echo("")
        ctx.obj.echo(
            table(
                ["TASK", "HELD", "FINISHED", "WINDOW"],
                [
                    [name, *(str(count) for count in each.values())]
                    for name, each in counts["tasks"].items()
                ],
            )
        )
    details = _store_details(_app(ctx))
    if details:
        ctx.obj.echo("\n".join(f"{name}: {value}" for name, value in details.items()))


@unique.command(name="check", cls=CeleryCommand)
@click.option(
    "--fleet",
    is_flag=True,
    cls=CeleryOption,
    help="Also ask the running workers whether they run the plugin.",
)
@click.option(
    "--no-store", is_flag=True, cls=CeleryOption, help="Only the checks that connect to nothing."
)
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help="Print JSON.")
@click.pass_context
def check(ctx: click.Context, fleet: bool, no_store: bool, as_json: bool) -> None:
    """Find misconfigurations; exit status 1 if any is an error."""
    app = _app(ctx)
    # As a worker would: the tasks of an app that autodiscovers them are in other modules
    # (and, with Celery's Django fixup, this sets Django up first).
    findings = checks.import_task_modules(app)
    findings += checks.run(app, store=not no_store, fleet=fleet)
    errors = sum(each.is_error for each in findings)
    if as_json:
        _echo_json(
            ctx,
            {
                "errors": errors,
                "warnings": len(findings) - errors,
                "findings": [each.as_dict() for each in findings],
            },
        )
    else:
        for each in findings:
            ctx.obj.echo(f"{each.id} [{each.level.value}] {each.subject}: {each.message}")
            ctx.obj.echo(f"    fix: {each.hint}")
        ctx.obj.echo(
            f"{errors} error(s), {len(findings) - errors} warning(s)"
            if findings
            else "no problems found"
        )
    ctx.exit(1 if errors else 0)


def _store_details(app: Any) -> dict[str, object]:
    """What the store says about itself beyond the counts (the Django store: its database)."""
    store = runtime(app).store
    # The default Store.stats scans every key to count them, which operations.stats has just
    # done, and adds nothing: only a store that overrides it has details of its own.
    if type(store).stats is Store.stats:
        return {}
    return store.stats().extra


def _json_option(value: str | None, what: str, kind: type) -> Any:
    if value is None:
        return kind()
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=what) from exc
    if not isinstance(parsed, kind):
        raise click.BadParameter(f"must be a JSON {kind.__name__}", param_hint=what)
    return parsed


@unique.command(cls=CeleryCommand)
@click.argument("task_name")
@click.option("--args", "args_json", cls=CeleryOption, help="Positional arguments, a JSON list.")
@click.option("--kwargs", "kwargs_json", cls=CeleryOption, help="Keyword arguments, a JSON object.")
@click.option(
    "--options",
    "options_json",
    cls=CeleryOption,
    help="apply_async options, a JSON object: unique_key, queue, countdown, ...",
)
@click.option("--json", "as_json", is_flag=True, cls=CeleryOption, help="Print JSON.")
@click.pass_context
@_operator_errors
def explain(
    ctx: click.Context,
    task_name: str,
    args_json: str | None,
    kwargs_json: str | None,
    options_json: str | None,
    as_json: bool,
) -> None:
    """Tell what dispatching TASK_NAME with these arguments would do now (writes nothing)."""
    app = _app(ctx)
    args = _json_option(args_json, "--args", list)
    kwargs = _json_option(kwargs_json, "--kwargs", dict)
    options = _json_option(options_json, "--options", dict)
    app.loader.import_default_modules()
    task = app.tasks.get(task_name)
    if task is None:
        raise click.ClickException(
            f"task {task_name!r} is not registered in this app (is its module in "
            "'imports'/'include', or autodiscovered?)"
        )
    if not hasattr(task, "__unique__"):
        raise click.ClickException(f"task {task_name!r} is not a UniqueTask: nothing to explain")
    try:
        explanation = explain_dispatch(task, args, kwargs, **options)
    except (UniquenessError, TypeError) as exc:
        # TypeError: the arguments do not fit the task's signature.
        code = exc.code if isinstance(exc, UniquenessError) else type(exc).__name__
        if as_json:
            _echo_json(ctx, {"task": task_name, "error": {"code": code, "message": str(exc)}})
            ctx.exit(1)
        raise click.ClickException(f"the dispatch would fail with {code}: {exc}") from exc
    if as_json:
        _echo_json(ctx, explanation.as_dict())
    else:
        ctx.obj.echo(str(explanation))


class _EmbeddedContext(CLIContext):
    """The commands' context object when another program runs them: its app, its output."""

    def __init__(self, app: Celery, write: Callable[[str], None], *, no_color: bool) -> None:
        super().__init__(app, no_color=no_color, workdir=None)
        self._write = write

    def echo(self, message: Any = None, **kwargs: Any) -> None:
        self._write("" if message is None else str(message))


def run(
    app: Celery,
    args: Sequence[str],
    *,
    prog_name: str,
    write: Callable[[str], None],
    no_color: bool = False,
) -> int:
    """Run ``celery -A app unique ARGS`` in this process and return its exit status.

    ``args`` are parsed by the very commands ``celery unique`` has; what they print goes
    to ``write``, one call per message, without its final newline. ``--help`` and a
    confirmation prompt use standard output, as in ``celery``; help returns 0. Errors are
    raised, not printed: :class:`click.ClickException` (bad usage, or an operator error,
    with the message and exit status ``celery`` would show) and :class:`click.Abort` (a
    release that was not confirmed).
    """
    context = _EmbeddedContext(app, write, no_color=no_color)
    status = unique.main(
        args=list(args),
        prog_name=prog_name,
        standalone_mode=False,
        obj=context,
        color=False if no_color else None,
    )
    # A command that finishes returns None; one that calls ctx.exit() (--help, or explain
    # --json reporting a failed dispatch) returns the status it exits with.
    return status if isinstance(status, int) else 0
