"""Uniqueness mixed into Celery's own ``DjangoTask``: its ``delay_on_commit`` deduplicates."""

from __future__ import annotations

import pytest
from celery import Celery
from django.db import transaction

from celery_unique import UniqueMixin
from celery_unique.config import runtime

DjangoTask = pytest.importorskip("celery.contrib.django.task", reason="Celery 5.4+").DjangoTask

pytestmark = pytest.mark.django_db(transaction=True)


class UniqueCeleryDjangoTask(UniqueMixin, DjangoTask):  # type: ignore[misc,valid-type]
    abstract = True


def test_delay_on_commit_of_a_mixed_in_task_makes_one_job(
    example_app: Celery, published: list[str]
) -> None:
    @example_app.task(
        base=UniqueCeleryDjangoTask,
        name="mixin.rebuild",
        unique_key=lambda job: f"rebuild:{job.site}",
        shared=False,
    )
    def rebuild(site: str) -> None:
        return None

    with transaction.atomic():
        rebuild.delay_on_commit("a")
        rebuild.delay_on_commit("a")
        rebuild.delay_on_commit("b")
        assert published == []
    held = {h.key.rsplit("\x1f", 1)[-1]: h.job_id for h in runtime(example_app).store.scan()}
    assert sorted(held) == ["rebuild:a", "rebuild:b"]
    # Three dispatches at commit, two jobs: the duplicate was handed the first.
    assert sorted(published) == sorted(held.values())
