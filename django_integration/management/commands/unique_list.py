"""``manage.py unique_list``: the held keys of the app's namespace (``celery unique list``)."""

from __future__ import annotations

from argparse import ArgumentParser

from celery_unique import cli
from django_integration.management.commands._unique import UniqueCommand, add_json, add_kind


class Command(UniqueCommand):
    help = "List held uniqueness keys, ordered by storage key."
    cli_command = cli.list_

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        add_kind(parser)
        parser.add_argument("--task", help="only keys written by this task")
        parser.add_argument("--match", help="shell pattern on the key, e.g. 'shop.tasks.*:7'")
        parser.add_argument("--limit", type=int, default=100, help="at most this many (100)")
        parser.add_argument("--offset", type=int, default=0, help="skip this many")
        add_json(parser)
