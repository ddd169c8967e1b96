"""``replace()`` by a unique task of another name: the replacement's own key applies.

A task that declares a key always uses it, a replacement too: a keyless job
replaced by ``faults.keyed`` holds that task's key under the job's id until
the replacement ends, and a replacement whose key another job holds is
refused before anything is sent, never run beside that job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_unique import Disposition

from ._apps import JOB, KEYED, KEYED_REPLACER, REPLACER, Spec
from .conftest import Worker, eventually, finished, job_key, open_store, producer, starts, task_of

pytestmark = pytest.mark.slow

LEASE_S = 60.0
SHORT_LEASE_S = 1.5


def test_a_replacement_by_a_unique_task_holds_its_key_until_it_ends(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """The replacement claims its task's key under the replaced job's id: a dispatch with
    that key while it runs is that job, not a second run beside it."""
    spec = make_spec(lease_s=LEASE_S)
    start_worker(spec)
    with producer(spec) as app, open_store(spec.store_url) as store:
        replaced = task_of(app, REPLACER).delay(n=1, hold_s=3)
        [(job_id, _, _, keyed)] = eventually(
            lambda: starts(marks, spec), what="the replacement to start"
        )
        assert (job_id, keyed) == (replaced.id, True)
        again = task_of(app, KEYED).delay(n=1)
        assert (again.disposition, again.id) == (Disposition.REUSED, replaced.id)

        eventually(lambda: replaced.id in finished(marks, spec), what="the replacement to end")
        stored = job_key(spec, "k:1", KEYED)
        eventually(lambda: store.get(stored) is None, what="the key to be released")
    assert [job_id for job_id, _, _, _ in starts(marks, spec)] == [replaced.id]


def test_a_keyed_jobs_replacement_holds_both_keys_until_it_ends(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """A job holding ``r:3`` replaced by ``faults.keyed``: the replacement holds the job's key
    and its own under the job's id while it runs, and its end releases both."""
    spec = make_spec(lease_s=LEASE_S)
    start_worker(spec)
    with producer(spec) as app, open_store(spec.store_url) as store:
        replaced = task_of(app, KEYED_REPLACER).delay(n=3, hold_s=3)
        [(job_id, _, _, _)] = eventually(
            lambda: starts(marks, spec), what="the replacement to start"
        )
        assert job_id == replaced.id
        for name in (KEYED, KEYED_REPLACER):
            again = task_of(app, name).delay(n=3)
            assert (again.disposition, again.id) == (Disposition.REUSED, replaced.id)

        eventually(lambda: replaced.id in finished(marks, spec), what="the replacement to end")
        keys = [job_key(spec, "k:3", KEYED), job_key(spec, "r:3", KEYED_REPLACER)]
        eventually(lambda: [store.get(key) for key in keys] == [None, None], what="releases")
    assert [job_id for job_id, _, _, _ in starts(marks, spec)] == [replaced.id]


def test_a_replacements_own_key_is_renewed_while_it_runs(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """The key a replacement holds of its own outlives its lease while it runs: the worker
    renews it beside the job's."""
    spec = make_spec(lease_s=SHORT_LEASE_S)
    start_worker(spec)
    with producer(spec) as app:
        replaced = task_of(app, KEYED_REPLACER).delay(n=4, hold_s=4 * SHORT_LEASE_S)
        eventually(lambda: starts(marks, spec), what="the replacement to start")
        time.sleep(2 * SHORT_LEASE_S)  # past the lease its decision gave the key
        assert replaced.id not in finished(marks, spec)
        for name in (KEYED, KEYED_REPLACER):
            again = task_of(app, name).delay(n=4)
            assert (again.disposition, again.id) == (Disposition.REUSED, replaced.id)


def test_a_replacement_whose_key_another_job_holds_is_refused_before_it_is_sent(
    make_spec: Callable[..., Spec], start_worker: Callable[..., Worker], marks: Any
) -> None:
    """replace() raises unsupported_combination when the replacement's key is held by
    another job: the replaced job fails, and only the holder runs under that key."""
    spec = make_spec(lease_s=LEASE_S)
    worker = start_worker(spec)
    with producer(spec) as app, open_store(spec.store_url) as store:
        holder = task_of(app, KEYED).delay(n=2, hold_s=30)
        eventually(lambda: starts(marks, spec), what="the holder to start")
        replaced = task_of(app, REPLACER).delay(n=2)

        def refused() -> bool:
            return any(
                replaced.id in line and "UnsupportedCombination" in line
                for line in worker.log().splitlines()
            )

        eventually(refused, what="replace() to be refused")
        # Sent after the refusal, run once the replaced job's pool child is free: a
        # replacement sent before it would have run first.
        after = task_of(app, JOB).delay()
        eventually(lambda: after.id in finished(marks, spec), what="the next job to run")
        held = store.get(job_key(spec, "k:2", KEYED))
        assert held is not None
        assert held.job_id == holder.id
    assert [job_id for job_id, _, _, _ in starts(marks, spec)] == [holder.id, after.id]
