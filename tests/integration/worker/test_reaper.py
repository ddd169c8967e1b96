"""The reaper task, run by a real worker, frees the key of a job that ended without release."""

from __future__ import annotations

import time
import uuid
from typing import Any

from celery import Celery, states
from celery.worker import WorkController

from celery_unique.reaper import register_reaper
from celery_unique.stores.base import ActiveClaim, Claim, Scope
from celery_unique.stores.redis import RedisStore

from .conftest import active_key


def test_reaper_task_frees_keys_of_finished_jobs_only(
    celery_app: Celery, celery_worker: WorkController, store: RedisStore, redis_client: Any
) -> None:
    """A key whose job succeeded is released; a key whose job is still pending is kept."""
    reap = register_reaper(celery_app)
    celery_worker.reload()
    # Fresh ids: the result backend never overwrites a SUCCESS it already holds.
    gone, alive = f"job-gone-{uuid.uuid4()}", f"job-alive-{uuid.uuid4()}"
    key_gone, key_alive = active_key("t", "gone"), active_key("t", "alive")
    for job_id, key in ((gone, key_gone), (alive, key_alive)):
        store.decide([Claim(job_id, "t", ActiveClaim(key, Scope.ACTIVE, 60_000))])
    celery_app.backend.store_result(gone, 42, states.SUCCESS)

    report = reap.delay().get(timeout=20)

    assert [orphan["job_id"] for orphan in report["released"]] == [gone]
    assert store.get(key_gone) is None
    held = store.get(key_alive)
    assert held is not None
    assert held.job_id == alive
    assert register_reaper(celery_app) is reap


def test_reaper_keeps_the_key_of_a_new_job_under_a_reused_id(
    celery_app: Celery, celery_worker: WorkController, store: RedisStore, redis_client: Any
) -> None:
    """A fixed task id whose earlier job succeeded: the new job's key is not that job's orphan."""
    reap = register_reaper(celery_app)
    celery_worker.reload()
    job_id = f"nightly-report-{uuid.uuid4()}"
    celery_app.backend.store_result(job_id, "yesterday", states.SUCCESS)
    time.sleep(1.5)  # the earlier run ended well before the new dispatch
    key = active_key("t", "nightly")
    store.decide([Claim(job_id, "t", ActiveClaim(key, Scope.ACTIVE, 60_000))])

    report = reap.delay().get(timeout=20)

    assert report["released"] == []
    assert report["kept"] == {"REUSED_ID": 1}
    held = store.get(key)
    assert held is not None
    assert held.job_id == job_id
