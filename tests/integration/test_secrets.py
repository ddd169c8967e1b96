"""A password planted in the store's URL shows up nowhere, whatever the URL's shape.

Every output the library writes without the Django admin is read for it: a
dispatch's error (message, repr, traceback with its causes), the runtime
settings' repr, the checks' messages and hints, the worker's log as it
starts, and the ``celery unique`` commands' output. The URLs cover a
mistyped scheme (with and without ``://``), a password as a query
parameter, a multi-host Sentinel URL with a password per host, options and
databases that cannot be used, a server that refuses the database, and one
that cannot be reached.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_unique import UniquenessError, UniqueTask, checks, worker
from celery_unique import config as unique_config
from celery_unique.checks.at_start import check_at_worker_start
from celery_unique.cli import unique
from tests.conftest import HOST
from tests.processes import RedisServer, free_port

SECRET = "plantedSecret42"

URLS = [
    "reddis://:{pw}@{host}:{port}/0",
    "redis:/:{pw}@{host}:{port}/0",
    "redis:{pw}@{host}:{port}/0",
    "redis://{host}:{port}/0?password={pw}&frobnicate=1",
    "redis://:{pw}@{host}:{port}/abc",
    "redis://:{pw}@[::1:{port}/0",
    "redis+sentinel://:{pw}@{host}:26379,:{pw}2@{host}:26380/main",
    "redis+sentinel://:{pw}@{host}:26379/main?sentinel_password={pw}&ssl_cert_reqs=none",
    "redis://:{pw}@{host}:{port}/33",
    "redis://:{pw}@{host}:{unused}/0",
]


class _Worker:
    """What the worker_init signal sends: the worker, and through it its app."""

    def __init__(self, app: Celery) -> None:
        self.app = app


@pytest.fixture
def make_app(services: RedisServer) -> Iterator[Any]:
    """An app on the memory broker whose store is one of :data:`URLS`."""
    made: list[Celery] = []

    def make(url: str) -> Celery:
        app = Celery(f"secrets{len(made)}", broker="memory://", set_as_current=False)
        app.conf.unique_backend = url.format(
            pw=SECRET, host=HOST, port=services.port, unused=free_port()
        )
        app.conf.unique_strict_checks = False
        made.append(app)
        return app

    yield make
    for app in made:
        unique_config.reset(app)


def told(error: BaseException) -> str:
    return "\n".join([str(error), repr(error), *traceback.format_exception(error)])


@pytest.mark.parametrize("url", URLS)
def test_a_planted_password_is_in_no_output(
    url: str, make_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(url)

    @app.task(shared=False, base=UniqueTask, unique_key="k", name="secrets.job")
    def job() -> None: ...

    worker.install(app)
    seen: list[str] = []
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(UniquenessError) as refused:
            job.delay()
        seen.append(told(refused.value))
        try:
            seen.append(repr(unique_config.runtime(app)))
        except UniquenessError as exc:  # the runtime itself refuses the settings
            seen.append(told(exc))
        seen += [f"{each.message} {each.hint}" for each in checks.run(app)]
        signals.worker_init.send(sender=_Worker(app))
        check_at_worker_start(app)
        context = CLIContext(app=app, no_color=True, workdir=None)
        for command in (["list"], ["stats"], ["check"], ["check", "--json"], ["show", "k"]):
            ran = CliRunner().invoke(unique, command, obj=context)
            seen.append(ran.output)
            if ran.exc_info is not None:
                seen.append("".join(traceback.format_exception(*ran.exc_info)))
    seen.append(caplog.text)
    for each in seen:
        assert SECRET not in each, each
