"""A message the broker delivers twice, on a real prefork worker.

Brokers deliver at least once: the Redis transport puts back the unacknowledged
messages of a worker that lost its connection (or ran past the visibility
timeout), a publish retried after a dropped connection can land twice. Each
copy carries the job's id and its key header. The tests make such a copy the
way the broker does, by pushing the very message again into the queue the
worker reads, and check that uniqueness still holds:

* a copy of a job that has finished, delivered while another job holds the
  key, does not run (two jobs never run under one key at once), nor does a copy
  of its replacement, a task that is not unique;
* a copy of a job delivered while the job runs waits for the run (it is sent
  again for later), so no new job is created while the job still runs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest

from celery_unique import Disposition
from tests.paths import _app
from tests.paths._pass import Pass

pytestmark = [pytest.mark.slow, pytest.mark.alone]

#: How often the store is sampled.
SAMPLE_S = 0.02
#: Time enough for the worker to take a copy delivered to its queue.
COPY_TAKEN_S = 0.5


def capture(run: Pass, task: str, key: str) -> tuple[str, bytes]:
    """Dispatch ``task`` under ``key`` (scope ``active``) to a queue no worker reads;
    take its message out of the broker, as the broker holds it."""
    result = run.app.tasks[f"{_app.PREFIX}.{task}"].apply_async(
        kwargs={"key": key},
        unique_while="active",
        unique_prefix=False,
        queue=run.spec["idle_queue"],
    )
    assert result.disposition is Disposition.CREATED
    broker = run.broker_client()
    deadline = time.monotonic() + 5
    while (raw := broker.rpop(run.spec["idle_queue"])) is None:
        assert time.monotonic() < deadline, "the message never reached the broker"
        time.sleep(0.01)
    return result.id, raw


def deliver(run: Pass, raw: bytes) -> None:
    """Put a copy of the message in the worker's queue (a fresh delivery tag, as a
    re-published copy has)."""
    message: dict[str, Any] = json.loads(raw)
    properties = message["properties"]
    properties["delivery_tag"] = str(uuid.uuid4())
    properties["delivery_info"] = {"exchange": run.spec["queue"], "routing_key": run.spec["queue"]}
    run.broker_client().lpush(run.spec["queue"], json.dumps(message))


def as_task(raw: bytes, task: str) -> bytes:
    """The message ``raw`` as a message of the path app's task ``task`` (its key header kept)."""
    message: dict[str, Any] = json.loads(raw)
    message["headers"]["task"] = f"{_app.PREFIX}.{task}"
    return json.dumps(message).encode()


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(SAMPLE_S)
    return value


def spans(run: Pass, job_id: str) -> list[tuple[int, int | None]]:
    """(start, end) of each run of the job, on the machine's monotonic clock."""
    starts, ends = run.runs(job_id)
    end_of = {end["run"]: end["end"] for end in ends}
    return [(start["start"], end_of.get(start["run"])) for start in starts]


@pytest.fixture
def cell(matrix_pass: Callable[[str, str], Pass]) -> tuple[Pass, str, str]:
    """A prefork worker on a Redis broker, and a key of the test's own (and its storage key)."""
    run = matrix_pass("redis", "prefork")
    key = f"copies:{uuid.uuid4().hex[:8]}"
    return run, key, run.storage_key(key)


@pytest.mark.parametrize("carried_by", ["success", "tail_plain"])
def test_a_copy_of_a_finished_job_does_not_run_beside_the_job_holding_its_key(
    cell: tuple[Pass, str, str], carried_by: str
) -> None:
    """X runs and ends, Y takes the key, then the broker delivers X again: X stays done.
    Also when X's message is that of its replacement (``tail_plain``), a task that is not
    a UniqueTask."""
    run, key, stored = cell
    first, raw = capture(run, "success", key)
    raw = as_task(raw, carried_by)
    deliver(run, raw)
    wait_for(lambda: spans(run, first) and spans(run, first)[0][1], "the job's first run")
    wait_for(lambda: run.store.get(stored) is None, "the release of the first job's key")

    second = run.app.tasks[f"{_app.PREFIX}.slow"].apply_async(
        kwargs={"key": key}, unique_while="active", unique_prefix=False
    )
    assert second.disposition is Disposition.CREATED
    wait_for(lambda: spans(run, second.id), "the second job's start")
    deliver(run, raw)  # the broker delivers the first job again
    wait_for(lambda: spans(run, second.id)[0][1], "the second job's end")
    time.sleep(1.0)  # any run of the copy would have started by now

    assert len(spans(run, first)) == 1, (
        f"the copy of finished job {first} ran beside job {second.id}, which held its key"
    )
    assert run.store.get(stored) is None, "the key of the job that ran last was not released"
    assert f"job {first} is not run" in run.worker.log()


def test_a_copy_delivered_while_the_job_runs_waits_for_the_run(
    cell: tuple[Pass, str, str],
) -> None:
    """X runs, and the broker delivers X again: the copy does not run beside X (it is sent
    again for later), and no new job is created while X runs. Had the copy run and ended
    first, its release would have freed the key under X."""
    run, key, stored = cell
    job, raw = capture(run, "slow", key)
    deliver(run, raw)
    wait_for(lambda: spans(run, job), "the first copy's start")
    deliver(run, raw)
    time.sleep(COPY_TAKEN_S)

    dispatches = []
    while spans(run, job)[0][1] is None:
        held = run.store.get(stored)
        probe = run.app.tasks[f"{_app.PREFIX}.probe"].apply_async(
            kwargs={"key": key}, unique_while="active", unique_prefix=False
        )
        dispatches.append(probe)
        if probe.disposition is not Disposition.REUSED:
            assert spans(run, job)[0][1] is not None, (
                f"a new job {probe.id} was created while job {job} still ran (key: {held})"
            )
            break
        time.sleep(0.1)
    assert dispatches, "the first copy ended before anything was checked"
    assert len(spans(run, job)) == 1, f"a copy of job {job} ran beside its first run"
    assert "another delivery of it runs" in run.worker.log()
    # Once the first run ended and released the key, the copy runs (the job's second run).
    wait_for(lambda: len(spans(run, job)) == 2 and spans(run, job)[1][1], "the copy's run", 30)
    first, second = spans(run, job)
    assert first[1] is not None
    assert second[0] >= first[1], "the copy started before the first run ended"
    wait_for(lambda: run.store.get(stored) is None, "the release after the copy's run")


#: The Redis broker's visibility timeout for the test of copies sent again.
VISIBILITY_S = 4.0


def messages_of(run: Pass, job_id: str) -> list[dict[str, Any]]:
    """The job's messages the Redis broker holds: waiting in the queue, or taken by the
    worker and not acknowledged yet (an ETA message waits there until it is due)."""
    broker = run.broker_client()
    found = [json.loads(raw) for raw in broker.lrange(run.spec["queue"], 0, -1)]
    # An unacknowledged entry is [message, exchange, routing key].
    found += [json.loads(entry)[0] for entry in broker.hvals("unacked")]
    return [message for message in found if message["headers"]["id"] == job_id]


def test_a_copy_sent_again_comes_back_before_the_broker_would_deliver_it_again(
    matrix_pass: Callable[..., Pass],
) -> None:
    """A copy that finds its job running is sent again for later. The Redis broker
    delivers again a message the worker held unacknowledged past ``visibility_timeout``,
    a message waiting to be due among them: were the copy due later than that, the broker
    would copy it, both would come due together, one would run and the other be sent
    again, one run a round for ever. So it is due sooner, and the job runs twice in all:
    its first delivery, and the copy once the first run released the key."""
    run = matrix_pass("redis", "prefork", visibility_timeout_s=VISIBILITY_S)
    key = f"copies:{uuid.uuid4().hex[:8]}"
    job, raw = capture(run, "slow", key)
    deliver(run, raw)
    wait_for(lambda: spans(run, job), "the first copy's start")
    deliver(run, raw)
    waiting = wait_for(
        lambda: [m for m in messages_of(run, job) if m["headers"].get("eta")],
        "the copy sent again for later",
    )
    seen = datetime.now(timezone.utc)
    due_in = datetime.fromisoformat(waiting[0]["headers"]["eta"]) - seen
    assert due_in.total_seconds() <= VISIBILITY_S / 2, (
        f"the copy is due in {due_in.total_seconds():.1f} s: the broker delivers it again "
        f"after {VISIBILITY_S} s"
    )
    wait_for(lambda: len(spans(run, job)) == 2 and spans(run, job)[1][1], "the copy's run", 30)
    # Nothing of the job is left in the broker: no copy of it can come any more.
    wait_for(lambda: not messages_of(run, job), "the broker done with the job", 30)
    assert len(spans(run, job)) == 2, f"job {job} ran {len(spans(run, job))} times"
    wait_for(lambda: run.store.get(run.storage_key(key)) is None, "the release of the key")
