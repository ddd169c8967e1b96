"""``manage.py unique_show KEY``: who holds a key (``celery unique show``)."""

from __future__ import annotations

from argparse import ArgumentParser

from celery_unique import cli
from django_integration.management.commands._unique import UniqueCommand, add_json, add_kind


class Command(UniqueCommand):
    help = (
        "Show who holds KEY: a display key 'task.name:key', a key shared across tasks, "
        "or a storage key (its unit separator written as \\x1f)."
    )
    cli_command = cli.show

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("key")
        add_kind(parser)
        add_json(parser)
