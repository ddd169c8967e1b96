"""``manage.py unique_list``: the deprecated name of ``manage.py celery_unique list``."""

from __future__ import annotations

from celery_unique_django.management.commands._unique import DeprecatedAlias


class Command(DeprecatedAlias):
    subcommand = "list"
