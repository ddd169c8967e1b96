"""``manage.py unique_stats``: keys per kind, scope and task (``celery unique stats``)."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from celery import Celery

from celery_unique import cli
from celery_unique.config import runtime
from django_integration.management.commands._unique import UniqueCommand, add_json


class Command(UniqueCommand):
    help = "Count held keys per kind, scope and task; then what the store says about itself."
    cli_command = cli.stats

    def add_arguments(self, parser: ArgumentParser) -> None:
        super().add_arguments(parser)
        add_json(parser)

    def after(self, app: Celery, options: dict[str, Any]) -> None:
        extra = runtime(app).store.stats().extra
        if extra and not options["as_json"]:
            self.stdout.write("\n".join(f"{name}: {value}" for name, value in extra.items()))
