"""An acknowledgement whose reply the broker connection lost frees the key within seconds.

A real prefork worker reaches its Redis broker through a loopback fault proxy
(``tests.faultproxy``) that lets the acknowledgement of a finished job reach
the broker, then resets the connection instead of forwarding the reply, and
refuses new connections for a while, so redis-py's retries fail too. The
worker cannot know that the broker forgot the message: kombu never confirms
the acknowledgement. The key must not wait for its lease; and since the
broker did forget the message, the job does not run again. A job that follows
its duplicates does not wait even that long to hand its key to the run they
are owed: a worker killed in those seconds must not take that run with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_unique import Disposition
from celery_unique.worker.fates import ACK_WAIT_S
from tests.faultproxy import FaultProxy
from tests.processes import RedisServer, Worker

from ._apps import FOLLOW, Spec
from .conftest import (
    eventually,
    finished,
    follow_runs,
    job_key,
    one_key,
    open_store,
    producer,
    starts,
    task_of,
)

pytestmark = pytest.mark.slow

#: Longer than the test: only the release can free the key in time.
LEASE_S = 300.0
#: How long the proxy refuses the worker's new broker connections after the reset.
REFUSED_S = 4.0
#: After the acknowledgement's reply is lost, how long the killed worker had to hand
#: the key to a run owed (done at once; the release itself waits up to ACK_WAIT_S).
HAND_OVER_S = 2.0


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


def test_a_run_owed_to_duplicates_survives_a_worker_killed_while_its_ack_is_unconfirmed(
    make_spec: Callable[..., Spec],
    proxy: FaultProxy,
    services: RedisServer,
    start_worker: Callable[..., Worker],
    marks: Any,
) -> None:
    """A ``latest`` job with a duplicate owed a run ends, its acknowledgement's reply is
    lost, and its node is killed before the 10 s its release gives kombu to confirm it:
    the owed run was handed the key and published at once, so the next worker runs it."""
    # Only the worker's consumer (whose acknowledgement is cut off) goes through the
    # proxy; publishing, the owed run's included, reaches the broker directly. One
    # pool process: busy with the job, the consumer has no BRPOP out that could take
    # the owed run's message off the queue as the connection breaks (kombu's Redis
    # transport would lose it, not the hand-over).
    spec = make_spec(
        acks_late=True,
        lease_s=LEASE_S,
        settings={"broker_read_url": proxy.url(1), "broker_write_url": services.url(1)},
    )
    worker = start_worker(spec, concurrency=1)
    with producer(spec) as app, open_store(spec.store_url) as store:
        follow = task_of(app, FOLLOW)
        first = follow.delay(customer=1, version=0, hold_s=1.0)
        assert first.disposition is Disposition.CREATED
        eventually(lambda: marks.llen(f"{spec.marks}:follow_started"), what="the job to start")
        assert follow.delay(customer=1, version=1).rerun_requested
        proxy.reset_on_reply_to("zrem", refuse=True)
        eventually(lambda: proxy.resets >= 1, what="the acknowledgement's reply to be lost")
        time.sleep(HAND_OVER_S)
        assert "Couldn't ack" in worker.log()
        worker.kill()  # well within ACK_WAIT_S of the lost acknowledgement
        proxy.heal()

        start_worker(spec)
        eventually(lambda: len(follow_runs(marks, spec)) == 2, 20, "the owed run to run")
        (job_1, version_1, *_), (job_2, version_2, *_) = follow_runs(marks, spec)
        assert (job_1, version_1) == (first.id, 0)
        assert job_2 != first.id
        assert version_2 == 1
        key = job_key(spec, "customer:1", FOLLOW)
        eventually(lambda: store.get(key) is None, what="the key to be freed, not leased")
