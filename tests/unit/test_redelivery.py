"""When the broker delivers a message again by itself, and how long a job sent again waits."""

from __future__ import annotations

import math
from typing import Any

import pytest
from celery import Celery

from celery_unique.config.redelivery import visibility_timeout_s
from celery_unique.worker.runs import redelivery_safe_s


def app_of(broker: str | None, **options: Any) -> Celery:
    app = Celery("redelivery", set_as_current=False)
    app.conf.broker_url = broker
    if options:
        app.conf.broker_transport_options = options
    return app


@pytest.mark.parametrize(
    ("broker", "options", "seconds"),
    [
        ("redis://127.0.0.1:6379/1", {}, 3600.0),
        ("rediss://127.0.0.1:6380/1", {"visibility_timeout": 30}, 30.0),
        ("sentinel://127.0.0.1:26379", {"visibility_timeout": "45"}, 45.0),  # from the env
        ("sqs://", {"visibility_timeout": 7.5}, 7.5),
        ("Redis://127.0.0.1:6379/1", {"visibility_timeout": 10}, 10.0),
    ],
)
def test_a_transport_that_delivers_again_by_time_says_after_how_long(
    broker: str, options: dict[str, Any], seconds: float
) -> None:
    app = app_of(broker, **options)
    assert visibility_timeout_s(app) == seconds
    assert redelivery_safe_s(app) == seconds / 2


@pytest.mark.parametrize("broker", ["amqp://guest@127.0.0.1//", "pyamqp://h//", "memory://", None])
def test_a_transport_that_never_delivers_again_by_time_leaves_a_countdown_as_it_is(
    broker: str | None,
) -> None:
    app = app_of(broker, visibility_timeout=5)
    assert visibility_timeout_s(app) is None
    assert redelivery_safe_s(app) == math.inf


def test_a_visibility_timeout_kombu_cannot_read_leaves_the_countdown_to_the_broker() -> None:
    app = app_of("redis://127.0.0.1:6379/1", visibility_timeout="an hour")
    with pytest.raises(ValueError):
        visibility_timeout_s(app)
    assert redelivery_safe_s(app) == math.inf
