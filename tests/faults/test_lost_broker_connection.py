"""A worker loses its broker connection while an ``acks_late`` job runs: the job goes on.

Celery lets the run go on (unless ``worker_cancel_long_running_tasks_on_connection_loss``),
and RabbitMQ delivers the unacknowledged message again, to another worker. That
copy must not end the job's hold on its key while the first run goes on: its
release would free the key, and a new job would run beside the first run.

The first worker reaches RabbitMQ through a fault proxy, which resets its
connection while the job runs and refuses it from then on; the second worker
is connected directly. The job holds long on its first run and returns at
once on any later one, so a copy that ran would end first.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from celery_unique import Disposition
from tests.conftest import HOST
from tests.faultproxy import FaultProxy

from ._apps import Spec
from .conftest import Worker, eventually, finished, one_key, starts

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.alone]

FIRST_RUN_S = 8.0
#: Time enough for a copy that ran to have ended and released the key.
COPY_WOULD_HAVE_ENDED_S = 2.0


@pytest.fixture
def broker_proxy(rabbitmq_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(HOST, urlsplit(rabbitmq_url).port or 5672) as running:
        yield running


def test_a_copy_delivered_while_the_first_run_goes_on_leaves_the_key_to_it(
    make_spec: Callable[..., Spec],
    start_worker: Callable[..., Worker],
    marks: Any,
    broker_proxy: FaultProxy,
    rabbitmq_url: str,
) -> None:
    spec = make_spec(broker_url=rabbitmq_url, acks_late=True, lease_s=60.0)
    cut_off = dataclasses.replace(
        spec, broker_url=f"amqp://guest:guest@{HOST}:{broker_proxy.port}//"
    )
    workers = [start_worker(cut_off)]
    with one_key(spec, "lost-connection") as job:
        first = job.dispatch(first_hold_s=FIRST_RUN_S, hold_s=0.0)
        assert first.disposition is Disposition.CREATED
        eventually(lambda: starts(marks, spec), what="the first run to start")
        first_started = time.monotonic()
        workers.append(start_worker(spec))
        broker_proxy.refuse(True)
        broker_proxy.reset_all()

        # RabbitMQ gives the message to the second worker at once; a copy that ran
        # would end (and release) within a moment, well before the first run does.
        eventually(lambda: "received" in workers[1].log(), 15, "the copy to be delivered")
        time.sleep(COPY_WOULD_HAVE_ENDED_S)
        assert time.monotonic() - first_started < FIRST_RUN_S - 1, "too slow to tell"
        for _ in range(3):
            again = job.dispatch(hold_s=0.0)
            assert (again.disposition, again.id) == (Disposition.REUSED, first.id)
        assert [run for _, _, run, _ in starts(marks, spec)] == [1]

        eventually(lambda: first.id in finished(marks, spec), 30, "the first run to end")
        eventually(lambda: job.holder() is None, 40, "the key to be released")
    runs = starts(marks, spec)
    # The copy ran once the first run had ended (at least once: the first run's
    # acknowledgement was lost with its connection).
    assert {job_id for job_id, _, _, _ in runs} == {first.id}
    assert [run for _, _, run, _ in runs] == [1, 2]
