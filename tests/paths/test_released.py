"""An operator's release between a job's dispatch and its delivery, on a real prefork worker.

An operator's release (``operations.release``, as the CLI and the Django admin
do it) frees the key and never stops or drops the job: the next dispatch
creates a new job, and the released job still runs when it is delivered,
beside it. Each cell releases the key of a job that is not running, dispatches
a new job under the key (it runs two seconds, holding the key when the released
job is delivered), and checks that both run as Celery's semantics say:

* ``waiting``: the job waits for its countdown on the worker;
* ``retrying``: the job's first run sent its retry, due a moment later
  (``active``, ``exists``: a ``queued`` key went when the first run started).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from celery_unique import Disposition, operations
from tests.paths import _app
from tests.paths._pass import Pass

pytestmark = [pytest.mark.slow, pytest.mark.alone]

SCOPES = ("queued", "active", "exists")
#: task, its runs, dispatch options, of each case.
CASES = {
    "waiting": ("success", 1, {"countdown": 1}),
    "retrying": ("retry", 2, {}),
}
SAMPLE_S = 0.02
#: How long the jobs of a cell have to run.
RUN_WITHIN_S = 30.0


def play(run: Pass, case: str, scope: str) -> list[str]:
    """Dispatch, release, dispatch again; what went wrong (nothing, if the library is right)."""
    task, runs, options = CASES[case]
    key = f"released:{case}:{scope}:{uuid.uuid4().hex[:8]}"
    stored = run.storage_key(key)
    first = run.app.tasks[f"{_app.PREFIX}.{task}"].apply_async(
        kwargs={"key": key}, unique_while=scope, unique_prefix=False, **options
    )
    if first.disposition is not Disposition.CREATED:
        return [f"the dispatch was {first.disposition}"]
    if case == "retrying":
        # Released once its first run sent the retry (the next attempt is due 0.3 s on).
        deadline = time.monotonic() + RUN_WITHIN_S
        while not run.runs(first.id)[1]:
            if time.monotonic() > deadline:
                return ["the first run never ended"]
            time.sleep(SAMPLE_S)
    if not operations.release(run.app, stored, job_id=first.id):
        return [f"the key was not released: {run.store.get(stored)}"]
    # Runs 2 s: it holds the key when the released job is delivered.
    second = run.app.tasks[f"{_app.PREFIX}.slow"].apply_async(
        kwargs={"key": key}, unique_while=scope, unique_prefix=False
    )
    if second.disposition is not Disposition.CREATED:
        return [f"the dispatch after the release was {second.disposition}"]
    deadline = time.monotonic() + RUN_WITHIN_S
    while time.monotonic() < deadline:
        ran = [len(run.runs(job)[1]) for job in (first.id, second.id)]
        if ran == [runs, 1]:
            return []
        time.sleep(SAMPLE_S)
    return [f"runs ended (released job, new job): {ran}, expected [{runs}, 1]"]


@pytest.mark.parametrize("broker", ["redis", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def test_a_job_whose_key_an_operator_released_still_runs(
    matrix_pass: Callable[[str, str], Pass], broker: str
) -> None:
    """Every case x scope: the released job runs as Celery says, and so does the new job."""
    run = matrix_pass(broker, "prefork")
    cells = [
        (case, scope)
        for case in CASES
        for scope in SCOPES
        if not (case == "retrying" and scope == "queued")
    ]
    with ThreadPoolExecutor(max_workers=len(cells)) as threads:
        problems = list(threads.map(lambda cell: play(run, *cell), cells))
    failures = [
        f"{case} / {scope}: {problem}"
        for (case, scope), found in zip(cells, problems, strict=True)
        for problem in found
    ]
    assert not failures, "\n".join(failures)
