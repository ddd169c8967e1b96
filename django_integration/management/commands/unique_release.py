"""``manage.py unique_release KEY``: free a key now (``celery unique release``)."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from celery_unique import cli
from django_integration.management.commands._unique import UniqueCommand, add_kind


class Command(UniqueCommand):
    help = (
        "Release KEY now, so that the next dispatch with it creates a job. The job "
        "holding it is not stopped: a new one may run beside it."
    )
    cli_command = cli.release

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("key")
        add_kind(parser)
        parser.add_argument("--job-id", help="release only while this job holds the key")
        parser.add_argument(
            "--noinput",
            "--no-input",
            action="store_false",
            dest="interactive",
            help="do not ask for confirmation",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        super().handle(*args, yes=not options["interactive"], **options)
