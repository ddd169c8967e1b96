"""An acknowledgement whose reply the broker connection lost frees the key within seconds.

A real prefork worker reaches its Redis broker through a loopback fault proxy
(``tests.faultproxy``) that lets the acknowledgement of a finished job reach
the broker, then resets the connection instead of forwarding the reply, and
refuses new connections for a while, so redis-py's retries fail too. The
worker cannot know that the broker forgot the message: kombu never confirms
the acknowledgement. The key must not wait for its lease; and since the
broker did forget the message, the job does not run again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from celery_unique import Disposition
from celery_unique.worker.fates import ACK_WAIT_S
from tests.faultproxy import FaultProxy
from tests.processes import Worker

from ._apps import Spec
from .conftest import eventually, finished, one_key, starts

pytestmark = pytest.mark.slow

#: Longer than the test: only the release can free the key in time.
LEASE_S = 300.0
#: How long the proxy refuses the worker's new broker connections after the reset.
REFUSED_S = 4.0


def test_an_acknowledgement_whose_reply_was_lost_frees_the_key(
    make_spec: Callable[..., Spec],
    proxy: FaultProxy,
    start_worker: Callable[..., Worker],
    marks: object,
) -> None:
    spec = make_spec(broker_url=proxy.url(1), acks_late=True, lease_s=LEASE_S)
    worker = start_worker(spec)
    with one_key(spec, "acknowledged") as one:
        job = one.dispatch(hold_s=1.0)
        assert job.disposition is Disposition.CREATED
        eventually(lambda: starts(marks, spec), what="the job to start")
        # kombu's Redis transport acknowledges with ZREM + HDEL of the delivery tag.
        proxy.reset_on_reply_to("zrem", refuse=True)
        eventually(lambda: finished(marks, spec), what="the run to end")
        eventually(lambda: proxy.resets >= 1, what="the acknowledgement's reply to be lost")
        time.sleep(REFUSED_S)
        proxy.refuse(False)
        assert "Couldn't ack" in worker.log()  # kombu never confirmed it
        assert one.holder() == job.id  # not at once: the acknowledgement may be on its way
        eventually(lambda: one.holder() is None, ACK_WAIT_S + 10, "the key to be freed, not leased")
        again = one.dispatch()
        assert again.disposition is Disposition.CREATED
        eventually(lambda: len(finished(marks, spec)) == 2, what="the new job to run")
    assert [start[0] for start in starts(marks, spec)] == [job.id, again.id]
