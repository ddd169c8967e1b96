"""``manage.py celery_unique COMMAND ...``: the ``celery -A proj unique`` commands in Django.

The command line after COMMAND goes, untouched, to the click group of
:mod:`celery_unique.cli`, which parses it as ``celery unique COMMAND`` does:
same options, same checks, same output, same error messages. Django's own
options (``--app``, ``--settings``, ``--verbosity``, ...) go before COMMAND.
"""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import CommandParser, DjangoHelpFormatter

from celery_unique import cli
from celery_unique_django.management.commands._unique import CliCommand, add_app_option


class _HelpFormatter(DjangoHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Django's help layout, with the list of commands kept one per line."""


def _commands() -> str:
    width = max(len(name) for name in cli.unique.commands)
    return "\n".join(
        f"  {name:<{width}}  {command.get_short_help_str(limit=72)}"
        for name, command in cli.unique.commands.items()
    )


class Command(CliCommand):
    # Kept as written (the help formatter does not rewrap it, to keep the commands' list).
    help = (
        "Inspect and manage held uniqueness keys: the `celery -A proj unique` commands,\n"
        "on the Celery app of --app, else CELERY_UNIQUE_APP, else Celery's current app.\n"
        "Django's options go before COMMAND; everything after it is COMMAND's."
    )

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        kwargs.setdefault(
            "epilog",
            f"commands:\n{_commands()}\n\n"
            f"'{subcommand} COMMAND --help' shows the options of COMMAND.",
        )
        return super().create_parser(prog_name, subcommand, **kwargs)

    def add_arguments(self, parser: CommandParser) -> None:
        add_app_option(parser)
        parser.add_argument(
            "subcommand",
            nargs="?",
            metavar="COMMAND",
            help=f"one of: {', '.join(cli.unique.commands)}",
        )
        # REMAINDER: whatever follows COMMAND, options included, is the click command's to parse.
        parser.add_argument(
            "args",
            nargs=argparse.REMAINDER,
            metavar="ARGS",
            help="the arguments and options of COMMAND, as `celery unique COMMAND` takes them",
        )

    def handle(self, *args: str, **options: Any) -> None:
        subcommand = options["subcommand"]
        # Without a command, the group's help: the commands and what each does.
        self.run_cli([subcommand, *args] if subcommand else ["--help"], options)
