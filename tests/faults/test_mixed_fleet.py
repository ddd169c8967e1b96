"""A fleet halfway through a rollout: producers and workers with and without the plugin.

A job sent without keys runs normally on a worker with the plugin. A job sent
with keys and run by a worker without the plugin runs normally too; nothing
releases its key, so the key is held until its lease ends (dispatches meanwhile
are REUSED), and then it is free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from celery_unique import Disposition
from celery_unique.keys import keyspace
from celery_unique.stores.redis import RedisStore

from ._apps import JOB, Spec
from .conftest import (
    Worker,
    eventually,
    finished,
    one_key,
    open_store,
    producer,
    starts,
    task_of,
)

pytestmark = pytest.mark.slow

#: Long enough for a trivial job to be run and looked at; short enough to wait for.
LEASE_S = 5.0


def held_keys(store: RedisStore, spec: Spec) -> list[str]:
    """Every key the store holds in the spec's namespace."""
    return [held.key for held in store.scan(prefix=keyspace.namespace_prefix(spec.namespace))]


def test_a_job_sent_without_the_plugin_runs_on_a_worker_with_it(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """A keyless job from a plain producer runs on a plugin worker; nothing breaks or is held."""
    spec = make_spec()
    worker = start_worker(spec)
    with producer(spec, plain=True) as app:
        sent = [app.send_task(JOB, kwargs={"hold_s": 0}) for _ in range(2)]
        plain = task_of(app).delay()
    ids = {result.id for result in [*sent, plain]}
    eventually(lambda: set(finished(marks, spec)) == ids, what="the jobs to run")
    assert sorted((job_id, keyed) for job_id, _, _, keyed in starts(marks, spec)) == sorted(
        (job_id, False) for job_id in ids
    )
    with open_store(spec.store_url) as store:
        assert held_keys(store, spec) == []
    log = worker.log()
    assert "Traceback" not in log, log
    assert "ERROR" not in log, log


def test_a_keyed_job_run_by_a_worker_without_the_plugin_frees_its_key_by_lease(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """A plain worker runs the keyed job; its key stays held (REUSED) until the lease ends."""
    spec = make_spec(lease_s=LEASE_S)
    start_worker(spec, plain=True)
    with one_key(spec, "rollout") as job:
        first = job.dispatch()
        assert first.disposition is Disposition.CREATED
        eventually(lambda: first.id in finished(marks, spec), what="the job to run")

        assert job.holder() == first.id, "nothing may release it"
        again = job.dispatch()
        assert (again.disposition, again.id) == (Disposition.REUSED, first.id)

        eventually(lambda: job.holder() is None, 4 * LEASE_S, "the lease to end")
        second = job.dispatch()
        assert second.disposition is Disposition.CREATED
        eventually(lambda: second.id in finished(marks, spec), what="the next job to run")
    assert [(job_id, keyed) for job_id, _, _, keyed in starts(marks, spec)] == [
        (first.id, True),
        (second.id, True),
    ]
