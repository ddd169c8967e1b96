"""What ``manage.py celery_unique`` and its deprecated ``unique_*`` aliases share.

Both run the click group of ``celery -A proj unique`` (:func:`celery_unique.cli.run`)
on the project's Celery app: ``--app``, else the ``CELERY_UNIQUE_APP`` setting,
else Celery's current app. The group parses the command's options itself, so
they are exactly those of ``celery unique``; its errors become ``CommandError``
with the same message and exit status.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any, ClassVar

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


def _metavar(option: click.Option) -> str | None:
    if isinstance(option.type, click.Choice):
        return "{" + ",".join(str(choice) for choice in option.type.choices) + "}"
    return None


def add_mirrored_options(parser: argparse.ArgumentParser, command: click.Command) -> None:
    """Accept ``command``'s arguments and options, to hand them on to it unchecked.

    Every value is kept as the string given: the click command checks and converts it,
    so an alias refuses exactly what ``celery unique`` refuses, with the same message.
    """
    for param in command.params:
        if isinstance(param, click.Argument):
            parser.add_argument(
                param.name or "",
                metavar=param.human_readable_name,
                nargs="*" if param.nargs == -1 else None if param.required else "?",
            )
        elif isinstance(param, click.Option) and param.is_flag and not param.count:
            parser.add_argument(
                *param.opts,
                dest=param.name,
                action="store_true",
                default=argparse.SUPPRESS,
                help=param.help,
            )
            if param.secondary_opts:
                parser.add_argument(
                    *param.secondary_opts,
                    dest=param.name,
                    action="store_false",
                    default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS,
                )
        elif isinstance(param, click.Option) and param.nargs == 1 and not param.count:
            parser.add_argument(
                *param.opts,
                dest=param.name,
                action="append" if param.multiple else "store",
                default=argparse.SUPPRESS,
                metavar=_metavar(param),
                help=param.help,
            )
        else:
            raise TypeError(f"cannot mirror {param!r} of the {command.name!r} command")


def mirrored_args(command: click.Command, options: dict[str, Any]) -> list[str]:
    """``command``'s arguments as the command line that gives ``options`` their values."""
    flags: list[str] = []
    positional: list[str] = []
    for param in command.params:
        if param.name not in options:
            continue
        value = options[param.name]
        if isinstance(param, click.Argument):
            values = value if param.nargs == -1 else [value]
            positional += [str(each) for each in values if each is not None]
        elif isinstance(param, click.Option) and param.is_flag:
            if value:
                flags.append(param.opts[0])
            elif param.secondary_opts:
                flags.append(param.secondary_opts[0])
        else:
            for each in value if param.multiple else [value]:
                if each is not None:
                    flags += [param.opts[0], str(each)]
    # After "--" a key that starts with a dash is still the key.
    return [*flags, "--", *positional] if positional else flags


class DeprecatedAlias(CliCommand):
    """``manage.py unique_<name>``: the old name of ``manage.py celery_unique <name>``."""

    #: The ``celery unique`` command this alias runs.
    subcommand: ClassVar[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = (
            f"Deprecated: use `manage.py {COMMAND} {self.subcommand}`, which it runs. "
            + self.cli_command.get_short_help_str(limit=200)
        )

    @property
    def name(self) -> str:
        return type(self).__module__.rpartition(".")[2]

    @property
    def cli_command(self) -> click.Command:
        return cli.unique.commands[self.subcommand]

    def add_arguments(self, parser: CommandParser) -> None:
        add_app_option(parser)
        add_mirrored_options(parser, self.cli_command)

    def cli_args(self, options: dict[str, Any]) -> list[str]:
        """The arguments of ``celery unique <subcommand>`` these options stand for."""
        return mirrored_args(self.cli_command, options)

    def handle(self, *args: Any, **options: Any) -> None:
        self.stderr.write(
            f"{self.name} is deprecated and will be removed in the next release: "
            f"use `manage.py {COMMAND} {self.subcommand}`",
            style_func=self.style.WARNING,
        )
        self.run_cli([self.subcommand, *self.cli_args(options)], options)
