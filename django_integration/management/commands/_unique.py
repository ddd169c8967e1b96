"""What the ``unique_*`` management commands share.

Each command is the matching ``celery -A proj unique ...`` command
(:mod:`celery_unique.cli`) with Django's argument parsing and output: same
options, same output, same errors (as ``CommandError``). The Celery app is
``--app``, else the ``CELERY_UNIQUE_APP`` setting, else Celery's current app;
every command acts on that app's namespace.
"""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any, ClassVar

import click
from celery import Celery
from celery.bin.base import CLIContext
from django.core.management.base import BaseCommand, CommandError, OutputWrapper

from celery_unique import cli
from celery_unique.exceptions import UniquenessError
from django_integration.conf import celery_app

KINDS = ["active", "window"]


class _Output(CLIContext):
    """The CLI's context object, writing to the command's stdout."""

    def __init__(self, app: Celery, out: OutputWrapper, *, no_color: bool) -> None:
        super().__init__(app, no_color=no_color, workdir=None)
        self.out = out

    def echo(self, message: Any = None, **kwargs: Any) -> None:
        self.out.write("" if message is None else str(message))


class UniqueCommand(BaseCommand):
    """Runs :attr:`cli_command` with the options this command parsed."""

    cli_command: ClassVar[click.Command]

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--app",
            help="the Celery app as 'proj.celery:app' "
            "(default: the CELERY_UNIQUE_APP setting, else Celery's current app)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            app = celery_app(options["app"])
        except UniquenessError as exc:
            raise CommandError(str(exc)) from exc
        obj = _Output(app, self.stdout, no_color=options.get("no_color", False))
        params = {p.name: options[p.name] for p in self.cli_command.params if p.name in options}
        try:
            with click.Context(cli.unique, obj=obj) as ctx:
                ctx.invoke(self.cli_command, **params)
                self.after(app, options)
        except click.ClickException as exc:
            raise CommandError(exc.format_message()) from exc
        except click.Abort as exc:
            raise CommandError("aborted") from exc

    def after(self, app: Celery, options: dict[str, Any]) -> None:
        """Anything the Django command adds to the CLI's output."""


def add_kind(parser: ArgumentParser) -> None:
    parser.add_argument("--kind", choices=KINDS, help="only keys of this kind")


def add_json(parser: ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", dest="as_json", help="print JSON")
