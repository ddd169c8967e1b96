"""What ``manage.py celery_unique`` runs.

It runs the click group of ``celery -A proj unique`` (:func:`celery_unique.cli.run`)
on the project's Celery app: ``--app``, else the ``CELERY_UNIQUE_APP`` setting,
else Celery's current app. The group parses the command's options itself, so
they are exactly those of ``celery unique``; its errors become ``CommandError``
with the same message and exit status.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

import click
from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_unique import cli
from celery_unique.exceptions import UniquenessError
from celery_unique_django.conf import celery_app

#: The management command that runs the ``celery unique`` group.
COMMAND = "celery_unique"


def add_app_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--app",
        help="the Celery app as 'proj.celery:app' "
        "(default: the CELERY_UNIQUE_APP setting, else Celery's current app)",
    )


class CliCommand(BaseCommand):
    """A management command that runs the ``celery unique`` group on the project's app."""

    #: How the program was run, for the click commands' usage lines.
    prog_name = "manage.py"

    #: The options Django parses (its own and ``--app``), to explain them given too late.
    django_options: frozenset[str] = frozenset()

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        # call_command() passes no program name.
        self.prog_name = os.path.basename(prog_name) or "manage.py"
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        self.django_options = frozenset(
            option for action in parser._actions for option in action.option_strings
        )
        return parser

    def run_cli(self, args: Sequence[str], options: dict[str, Any]) -> None:
        """Run ``celery unique ARGS`` on the project's app, printing to this command's stdout."""
        try:
            app = celery_app(options["app"])
        except UniquenessError as exc:
            raise CommandError(str(exc)) from exc
        prog_name = f"{self.prog_name} {COMMAND}"
        try:
            status = cli.run(
                app,
                args,
                prog_name=prog_name,
                write=self.stdout.write,
                no_color=bool(options.get("no_color")),
            )
        except click.NoSuchOption as exc:
            message = exc.format_message()
            if exc.option_name in self.django_options:
                message += (
                    f" {exc.option_name} is one of Django's options: give it before {args[0]!r}."
                )
            raise CommandError(message, returncode=exc.exit_code) from exc
        except click.ClickException as exc:
            raise CommandError(exc.format_message(), returncode=exc.exit_code) from exc
        except click.Abort as exc:
            raise CommandError("aborted") from exc
        if status:
            # explain --json has printed why; the exit status must still say it failed.
            raise CommandError(
                f"{prog_name} {args[0]} exited with status {status}", returncode=status
            )
