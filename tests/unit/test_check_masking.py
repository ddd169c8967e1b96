"""Store URLs in findings and log lines: shown as given, their passwords masked."""

from __future__ import annotations

import logging

import pytest
from celery import Celery, signals

from celery_unique import config as unique_config
from celery_unique import worker
from celery_unique.stores.masking import masked, redacted


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("django://", "django://"),
        ("django://reporting", "django://reporting"),
        ("sqlite:///unique.db", "sqlite:///unique.db"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://user@127.0.0.1/0", "redis://user@127.0.0.1/0"),
        ("redis://:hunter2@127.0.0.1:1/0", "redis://:***@127.0.0.1:1/0"),
        ("mongodb://user:secret@db:27017/x", "mongodb://user:***@db:27017/x"),
        ("redis://user:p@ss/word@host/0", "redis://user:***@host/0"),
        (
            "redis+sentinel://:pw@h1:26379,h2:26379/main?sentinel_password=s3cret&x=1",
            "redis+sentinel://:***@h1:26379,h2:26379/main?sentinel_password=***&x=1",
        ),
        (
            "redis+sentinel://:pw11@h1:26379,u:pw22@h2:26379/main",
            "redis+sentinel://:***@h1:26379,u:***@h2:26379/main",
        ),
        ("reddis://:hunter2@h:1/0", "reddis://:***@h:1/0"),
        ("redis:/:hunter2@h:1/0", "redis:/:***@h:1/0"),
        ("redis:hunter2@h:1/0", "redis:***@h:1/0"),
        (":hunter2@h:1/0", ":***@h:1/0"),
        ("redis://:p,w@h/0", "redis://:***@h/0"),
        ("redis://h/0?password=hunter2&db=1", "redis://h/0?password=***&db=1"),
        ("redis://h/0?a=1&auth_token=xyz", "redis://h/0?a=1&auth_token=***"),
        ("sqlite:///C:/data/unique.db", "sqlite:///C:/data/unique.db"),
        # No password to mask: an empty one, in the credentials or as a parameter.
        ("redis://user:@h/0", "redis://user:@h/0"),
        ("redis://h/0?password=&db=1", "redis://h/0?password=&db=1"),
        # Three sentinels, each with a password: every one masked, every host kept.
        (
            "redis+sentinel://:pw11@h1:26379,:pw22@h2:26379,:pw33@h3:26379/main",
            "redis+sentinel://:***@h1:26379,:***@h2:26379,:***@h3:26379/main",
        ),
        # One host, whose password holds "@" and "," unescaped: not several hosts.
        ("redis://user:a@b,c,d@host/0", "redis://user:***@host/0"),
    ],
)
def test_a_url_is_shown_as_given_with_its_password_masked(url: str, shown: str) -> None:
    """Only the password changes: no URL is parsed and rebuilt (``django://`` stays as is)."""
    assert masked(url) == shown


def test_every_password_of_a_multi_host_url_is_redacted_from_text() -> None:
    url = (
        "redis+sentinel://:first-pw@h1:26379,:second-pw@h2:26379,:last-pw@h3:26379/main"
        "?sentinel_password=third"
    )
    text = f"cannot use {url}: AUTH first-pw, then second-pw, then last-pw, sentinels third"
    assert redacted(text, url) == (
        "cannot use redis+sentinel://:***@h1:26379,:***@h2:26379,:***@h3:26379/main"
        "?sentinel_password=***: AUTH ***, then ***, then ***, sentinels ***"
    )


def test_a_password_inside_another_is_redacted_without_leaving_the_rest() -> None:
    """The longer secret goes first: masking the shorter one inside it first would leave
    the rest of the longer one in the text."""
    url = "redis://:hunter@h/0?sentinel_password=hunter2025"
    text = "AUTH hunter failed; sentinel AUTH hunter2025 failed"
    assert redacted(text, url) == "AUTH *** failed; sentinel AUTH *** failed"


@pytest.mark.parametrize(("password", "in_text"), [("abc", "abc"), ("abcd", "***")])
def test_only_passwords_of_four_characters_or_more_are_masked_in_free_text(
    password: str, in_text: str
) -> None:
    """A URL's password is always masked in the URL; in the rest of a text only from four
    characters on (masking every "1" of a traceback hides more than it protects)."""
    url = f"redis://:{password}@h/0"
    assert redacted(f"{url} said {password}", url) == f"redis://:***@h/0 said {in_text}"


def test_an_error_quoting_the_url_is_redacted() -> None:
    """The URL in a message is masked, and so is its password quoted alone."""
    url = "mongodb://user:secret@db:27017/x"
    text = f"unique_backend {url!r} has no known scheme (password 'secret')"
    assert redacted(text, url) == (
        "unique_backend 'mongodb://user:***@db:27017/x' has no known scheme (password '***')"
    )


class _Worker:
    """What the worker_init signal sends: the worker, and through it its app."""

    def __init__(self, app: Celery) -> None:
        self.app = app


def test_a_store_the_worker_cannot_set_up_is_logged_without_its_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The worker's log says why the store could not be set up, with the password masked."""
    app = Celery("masked", broker="memory://", set_as_current=False)
    app.conf.unique_backend = "mongodb://user:secret@db:27017/x"
    worker.install(app)
    try:
        with caplog.at_level(logging.ERROR, logger="celery_unique"):
            signals.worker_init.send(sender=_Worker(app))
    finally:
        unique_config.reset(app)
    assert "the uniqueness store could not be set up" in caplog.text
    assert "'mongodb://user:***@db:27017/x' has no known scheme" in caplog.text
    assert "secret" not in caplog.text
