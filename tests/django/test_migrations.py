"""The shipped migrations match the models and do not depend on the host project's settings."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from django.core.management import call_command

import celery_unique_django

MIGRATIONS = Path(celery_unique_django.__file__).parent / "migrations"

#: A host project unlike the example: other DEFAULT_AUTO_FIELD, no admin, no time zones.
FOREIGN_HOST = textwrap.dedent(
    """
    import django
    from django.conf import settings
    from django.core.management import call_command

    settings.configure(
        INSTALLED_APPS=[
            "django.contrib.contenttypes",
            "django.contrib.auth",
            "celery_unique_django",
        ],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
        USE_TZ=False,
    )
    django.setup()
    call_command("makemigrations", "celery_unique", "--check", "--dry-run", verbosity=0)
    call_command("migrate", "celery_unique", verbosity=0)
    from django.db import connection
    assert "celery_unique_key" in connection.introspection.table_names()
    """
)


@pytest.mark.django_db
def test_makemigrations_check_is_clean() -> None:
    """``makemigrations --check`` finds nothing to write for the app (nor the example shop)."""
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def test_migrations_are_clean_and_apply_under_other_host_settings() -> None:
    """Another project's DEFAULT_AUTO_FIELD and USE_TZ: no new migration, and migrate works."""
    done = subprocess.run(
        [sys.executable, "-c", FOREIGN_HOST], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", sorted(MIGRATIONS.glob("0*.py")), ids=lambda path: path.name)
def test_migrations_bake_in_no_setting(path: Path) -> None:
    """A migration never reads django.conf.settings or depends on a swappable model."""
    source = path.read_text()
    assert "settings" not in source
    assert "swappable" not in source
