"""``manage.py unique_reap [--apply]``: free keys whose job has ended (``celery unique reap``)."""

from __future__ import annotations

from argparse import ArgumentParser

from celery_unique import cli
from django_integration.management.commands._unique import UniqueCommand, add_json


class Command(UniqueCommand):
    help = (
        "Report active keys whose job is in a final state in the result backend "
        "(success, failure, revoked); with --apply, release them. A dry run by default."
    )
    cli_command = cli.reap

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--apply", action="store_true", help="release the orphans")
        add_json(parser)
