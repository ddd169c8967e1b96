"""``manage.py unique_release``: the deprecated name of ``manage.py celery_unique release``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from celery_unique_django.management.commands._unique import DeprecatedAlias


class Command(DeprecatedAlias):
    subcommand = "release"

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        # Django's spelling of --yes, which this command took before it forwarded to the CLI.
        parser.add_argument(
            "--noinput",
            "--no-input",
            action="store_false",
            dest="interactive",
            help="Do not ask for confirmation (as --yes).",
        )

    def cli_args(self, options: dict[str, Any]) -> list[str]:
        args = super().cli_args(options)
        return args if options["interactive"] else ["--yes", *args]
