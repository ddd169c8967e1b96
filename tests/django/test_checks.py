"""System checks: each misconfiguration has its id; only --deploy connects to the store."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from django.core.checks import ERROR
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from celery_unique import config
from celery_unique.checks import app_findings
from celery_unique_django import checks
from celery_unique_django.conf import celery_app

UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"


class NoUniqueTables:
    """A database router that keeps celery-unique's table off every database."""

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return False if app_label == "celery_unique" else None


@pytest.fixture(autouse=True)
def fresh_runtime() -> Iterator[None]:
    """Every test reads the settings anew and leaves no store open."""
    config.reset(celery_app())
    yield
    config.reset(celery_app())


def ids(**settings: Any) -> list[str]:
    with override_settings(**settings):
        return [message.id for message in checks.check_settings()]


def test_the_example_project_passes() -> None:
    """A correctly configured project gets no message."""
    assert ids() == []


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"CELERY_UNIQUE_BACKEND": "mongodb://localhost"}, "celery_unique.E001"),
        ({"CELERY_UNIQUE_BACKEND": 42}, "celery_unique.E001"),
        ({"CELERY_UNIQUE_BACKEND": "django://reporting"}, "celery_unique.E002"),
        ({"CELERY_UNIQUE_FAIL_OPEN": "nope"}, "celery_unique.E005"),
        ({"CELERY_UNIQUE_LEASE": "1h"}, "celery_unique.E006"),
        ({"CELERY_UNIQUE_LEASE": -5}, "celery_unique.E006"),
        ({"CELERY_UNIQUE_NAMESPACE": "shop}eu"}, "celery_unique.E007"),
        ({"CELERY_UNIQUE_NAMESPACE": ""}, "celery_unique.E007"),
        ({"CELERY_UNIQUE_APP": "no.such.module:app"}, "celery_unique.E008"),
        ({"CELERY_UNIQUE_APP": "django.conf:settings"}, "celery_unique.E008"),
        ({"DATABASE_ROUTERS": [f"{__name__}.NoUniqueTables"]}, "celery_unique.E011"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_each_misconfiguration_has_its_check(settings: dict[str, Any], expected: str) -> None:
    """Each wrong setting is reported under its own id, and only that one."""
    assert ids(**settings) == [expected]


@pytest.mark.parametrize("value", [True, "false", "OFF", "1"])
def test_a_boolean_setting_may_be_a_string_saying_one(value: object) -> None:
    """Settings read from the environment arrive as strings: the usual ones are accepted."""
    assert ids(CELERY_UNIQUE_FAIL_OPEN=value) == []


#: A project that chose the Django store but did not install the app.
NOT_INSTALLED = textwrap.dedent(
    """
    import django
    from celery import Celery
    from django.conf import settings
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    from celery_unique.exceptions import ImproperlyConfigured
    from celery_unique.stores import open_store

    settings.configure(
        INSTALLED_APPS=["django.contrib.contenttypes"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    )
    app = Celery("proj")
    app.config_from_object({"unique_backend": "django://"})
    for stage in ("before setup", "after setup"):
        try:
            open_store("django://")
        except ImproperlyConfigured as exc:
            print(stage, exc)
        django.setup()
    import celery_unique_django.on_commit  # the project uses it without installing the app
    try:
        call_command("check")
    except SystemCheckError as exc:
        print(exc)
    """
)


def test_django_store_without_the_app_installed() -> None:
    """A project using django:// without the app: the store and ``check`` both say what to add."""
    done = subprocess.run(
        [sys.executable, "-c", NOT_INSTALLED], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    before, after, *check = done.stdout.splitlines()
    assert before.startswith("before setup")
    assert "django.setup()" in before
    assert after.startswith("after setup")
    assert "'celery_unique_django' is not in INSTALLED_APPS" in after
    assert "(celery_unique.E003)" in "\n".join(check)


def test_missing_client_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """A redis:// store without redis-py installed names the extra to install."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with override_settings(CELERY_UNIQUE_BACKEND="redis://:hunter2@localhost:6379/0"):
        messages = checks.check_settings()
    assert [m.id for m in messages] == ["celery_unique.E009"]
    assert "celery-unique[redis]" in str(messages[0].hint)
    assert "'redis://:***@localhost:6379/0'" in messages[0].msg


def test_a_store_url_is_shown_without_its_password() -> None:
    """E001 names the URL as given, its password masked."""
    with override_settings(CELERY_UNIQUE_BACKEND="mongodb://user:secret@db:27017/x"):
        [message] = checks.check_settings()
    assert message.id == "celery_unique.E001"
    assert "'mongodb://user:***@db:27017/x' is not a store URL" in message.msg
    assert "secret" not in message.msg


def test_no_store_is_the_same_error_as_the_librarys() -> None:
    """No store and a broker that is not Redis: one id, one severity, in Django and elsewhere."""
    bare = Celery("bare", broker="memory://", set_as_current=False)
    # Only the store's finding: the app also has the shared tasks other tests declared.
    [library] = [each for each in app_findings(bare) if each.subject == "unique_backend"]
    with override_settings(CELERY_UNIQUE_APP=bare):
        [django] = [m for m in checks.check_settings() if m.id == library.id]
    assert (library.id, library.is_error) == ("celery_unique.E001", True)
    assert django.level == ERROR


def test_settings_the_app_does_not_read_are_reported() -> None:
    """CELERY_UNIQUE_* in settings.py but an app not configured from them: W001 (and E001)."""
    bare = Celery("bare", broker="memory://", set_as_current=False)
    assert ids(CELERY_UNIQUE_APP=bare) == ["celery_unique.W001", "celery_unique.E001"]


def test_manage_py_check_fails_with_an_actionable_message() -> None:
    """``manage.py check`` stops on an error, saying what is wrong and how to fix it."""
    with (
        override_settings(CELERY_UNIQUE_BACKEND="django://reporting"),
        pytest.raises(SystemCheckError) as failed,
    ):
        call_command("check", stdout=StringIO(), stderr=StringIO())
    text = str(failed.value)
    assert "celery_unique.E002" in text
    assert "'reporting'" in text
    assert "DATABASES" in text


def test_plain_check_does_not_connect_to_the_store() -> None:
    """An unreachable Redis store passes ``manage.py check``: it is never contacted."""
    out = StringIO()
    with override_settings(CELERY_UNIQUE_BACKEND=UNREACHABLE_REDIS):
        call_command("check", "--tag", checks.TAG, stdout=out)
    assert "no issues" in out.getvalue()


@pytest.mark.parametrize(
    ("fail_open", "expected"), [(False, "celery_unique.E012"), (True, "celery_unique.W012")]
)
def test_deploy_check_pings_the_store(fail_open: bool, expected: str) -> None:
    """``check --deploy`` reaches the store: unreachable is an error when failing closed."""
    with override_settings(
        CELERY_UNIQUE_BACKEND=UNREACHABLE_REDIS, CELERY_UNIQUE_FAIL_OPEN=fail_open
    ):
        assert [m.id for m in checks.check_store_reachable()] == [expected]


@pytest.mark.django_db(transaction=True)
def test_deploy_check_passes_on_a_reachable_store() -> None:
    """The example's Django store answers the deploy check's ping."""
    assert checks.check_store_reachable() == []


def test_every_check_id_is_documented() -> None:
    """docs/django.md lists every id the app can report, and no id it cannot."""
    app = Path(checks.__file__).parent
    pattern = re.compile(r"celery_unique\.[EW]\d{3}")
    reported = {
        found
        for module in ("checks.py", "store.py")
        for found in pattern.findall((app / module).read_text())
    }
    page = (Path(__file__).resolve().parents[2] / "docs" / "django.md").read_text()
    table = page.split("## System checks", 1)[1].split("\n## ", 1)[0]
    documented = set(pattern.findall(table)) | {
        f"celery_unique.{short}" for short in re.findall(r"/ `([EW]\d{3})`", table)
    }
    assert reported
    assert documented == reported


def test_manage_py_check_reports_the_librarys_own_checks() -> None:
    """A task declared with unique_* options but without base=UniqueTask fails ``check``."""
    app = celery_app()

    @app.task(
        name="shop.forgot_base",
        shared=False,
        unique_key=lambda job: job.order_id,
        unique_while="active",
    )
    def forgot_base(order_id: int) -> None: ...

    try:
        with pytest.raises(SystemCheckError) as failed:
            call_command("check", stdout=StringIO(), stderr=StringIO())
        text = str(failed.value)
        assert "shop.forgot_base: (celery_unique.E020)" in text
        assert "base=UniqueTask" in text
    finally:
        del app.tasks["shop.forgot_base"]
    assert [m.id for m in checks.check_tasks()] == []
