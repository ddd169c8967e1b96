"""Boolean settings and options: True/False or a string saying one, else a coded error."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_unique import ImproperlyConfigured, UniqueTask
from celery_unique import config as unique_config
from celery_unique.config.booleans import parse_bool
from celery_unique.exceptions import InvalidBoolean

TRUE = [True, "true", "True", "TRUE", "1", "yes", "Yes", "on", "ON"]
FALSE = [False, "false", "False", "FALSE", "0", "no", "NO", "off", "Off"]
REFUSED = ["", " true", "t", "f", "y", "n", "2", "enable", "none", 1, 0, None, 1.0, [], {}]


@pytest.mark.parametrize("value", TRUE)
def test_true_and_the_strings_saying_it(value: object) -> None:
    assert parse_bool(value, "unique_fail_open") is True


@pytest.mark.parametrize("value", FALSE)
def test_false_and_the_strings_saying_it(value: object) -> None:
    assert parse_bool(value, "unique_fail_open") is False


@pytest.mark.parametrize("value", REFUSED, ids=repr)
def test_anything_else_is_improperly_configured_naming_the_setting(value: object) -> None:
    with pytest.raises(ImproperlyConfigured, match="unique_fail_open") as refused:
        parse_bool(value, "unique_fail_open")
    assert refused.value.code == "improperly_configured"
    assert isinstance(refused.value, InvalidBoolean)
    assert (refused.value.setting, refused.value.value) == ("unique_fail_open", value)


@pytest.mark.parametrize(
    ("name", "value", "read"),
    [
        ("unique_fail_open", "false", lambda rt: rt.fail_open is False),
        ("unique_fail_open", "Yes", lambda rt: rt.fail_open is True),
        ("unique_colocated", "false", lambda rt: rt.colocated is False),
        ("unique_colocated", "Auto", lambda rt: rt.colocated is True),
    ],
)
def test_app_settings_read_strings_as_booleans(
    app: Celery, name: str, value: str, read: Any
) -> None:
    app.conf[name] = value
    assert read(unique_config.runtime(app))


@pytest.mark.parametrize("name", ["unique_fail_open", "unique_colocated", "unique_strict_checks"])
def test_a_bad_app_setting_is_refused_naming_it(app: Celery, name: str) -> None:
    app.conf[name] = "flase"
    with pytest.raises(ImproperlyConfigured, match=name):
        read(app, name)


def read(app: Celery, name: str) -> object:
    """Read ``name`` where the library reads it: the worker's start reads the strict checks
    setting; the runtime, built at first use, reads the others."""
    if name == "unique_strict_checks":
        return unique_config.flag(app, name)
    return unique_config.runtime(app)


def test_a_bad_setting_fails_the_dispatch_before_anything_is_published(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    app.conf.unique_fail_open = "flase"

    @app.task(shared=False, base=UniqueTask, unique_key="k")
    def job() -> None: ...

    with pytest.raises(ImproperlyConfigured, match="unique_fail_open"):
        job.delay()
    assert published == []


def test_task_and_dispatch_options_read_strings_as_booleans(
    app: Celery, published: list[dict[str, Any]]
) -> None:
    @app.task(
        shared=False,
        base=UniqueTask,
        unique_key="k",
        unique_prefix="no",
        unique_overridable="true",
    )
    def job() -> None: ...

    declared = job.__unique__  # type: ignore[attr-defined]
    assert (declared.prefix, declared.overridable) == (False, True)
    assert job.apply_async(unique_key="other", unique_prefix="On").id
    with pytest.raises(ImproperlyConfigured, match="unique_prefix"):
        job.apply_async(unique_key="third", unique_prefix="maybe")
    assert len(published) == 1
