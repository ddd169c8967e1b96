"""The store and the message header are trust boundaries, on a real prefork worker.

Whoever can write the store (but not the broker) must not choose what a worker
runs: records of ``faults.follow`` (``latest``) are changed behind the app's
back, and the worker refuses them. Whoever can publish a message must not make
a worker touch keys outside the app's namespace.

The worker accepts pickle (``accept_content``), so that a planted pickle
would run if stored arguments were decoded as messages are.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from celery_unique.keys import keyspace

from ._apps import FOLLOW, JOB, KEY_HEADER, Spec
from .conftest import Worker, eventually, follow_runs, job_key, producer, starts, task_of

pytestmark = pytest.mark.slow

#: The fields of a Redis store record, in order (celery_unique/stores/lua/common.lua).
TASK_FIELD, ARGS_FIELD = 3, 11
SECRET = "faults-signing-key"


class _Planted:
    """Pickled, runs ``touch <path>`` wherever it is unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.path}",)


def planted_pickle(path: Path) -> str:
    """Stored arguments as an earlier version wrote them, holding a planted pickle."""
    body = base64.b64encode(pickle.dumps([[_Planted(path)], {}])).decode()
    return f"application/x-python-serialize|binary|{body}"


def json_arguments(kwargs: dict[str, Any]) -> str:
    return base64.b64encode(json.dumps([[], kwargs]).encode()).decode()


def tamper(client: Any, key: str, **fields: str) -> None:
    """Change fields of the record at ``key`` in place (its TTL kept)."""
    record = client.get(key).decode().split(keyspace.SEPARATOR)
    record += [""] * (ARGS_FIELD + 1 - len(record))
    for name, value in fields.items():
        record[TASK_FIELD if name == "task" else ARGS_FIELD] = value
    client.set(key, keyspace.SEPARATOR.join(record), keepttl=True)


def refusals(worker: Worker) -> int:
    return worker.log().count("are refused")


def test_a_changed_record_is_refused_and_the_worker_runs_nothing_from_it(
    make_spec: Callable[..., Spec],
    start_worker: Callable[..., Worker],
    marks: Any,
    tmp_path: Path,
) -> None:
    """Arguments changed under their signature, a record naming another task, and planted
    pickle bytes: each is refused and logged; no owed run is published, no planted code
    runs, the job whose queued arguments were replaced runs with its own, every key is
    freed."""
    spec = make_spec(settings={"accept_content": ["json", "pickle"], "unique_signing_key": SECRET})
    planted = tmp_path / "planted"
    with producer(spec) as app:
        follow = task_of(app, FOLLOW)
        # Queued: a duplicate's arguments replace the job's, then pickle replaces them.
        queued = follow.delay(customer=0, version=0)
        assert follow.delay(customer=0, version=1).arguments_replaced
        tamper(marks, job_key(spec, "customer:0", FOLLOW), args=planted_pickle(planted))

        # Celery refuses to accept pickle as root unless told to (a CI container's user).
        worker = start_worker(spec, concurrency=3, env={"C_FORCE_ROOT": "1"})
        ended = (f"[{queued.id}] succeeded", f"[{queued.id}] raised")
        eventually(lambda: any(line in worker.log() for line in ended), what="the queued job")
        assert not planted.exists()
        assert follow_runs(marks, spec)[0][:2] == (queued.id, 0)
        assert "runs with the arguments of its own message" in worker.log()

        # Running: each duplicate owes a run, whose record is then changed.
        holders = [follow.delay(customer=c, version=0, until_let_go=True).id for c in (1, 2, 3)]
        eventually(lambda: marks.llen(f"{spec.marks}:follow_started") == 4, what="3 holders")
        for customer in (1, 2, 3):
            assert follow.delay(customer=customer, version=1).rerun_requested
        keys = {c: job_key(spec, f"customer:{c}", FOLLOW) for c in (1, 2, 3)}
        signed = marks.get(keys[1]).decode().split(keyspace.SEPARATOR)[ARGS_FIELD]
        signature, _, encoded = signed.partition("|")
        forged = "|".join(
            [*encoded.split("|")[:2], json_arguments({"customer": 1, "version": 666})]
        )
        tamper(marks, keys[1], args=f"{signature}|{forged}")
        unsigned_job = f"application/json|utf-8|{json_arguments({'hold_s': 0})}"
        tamper(marks, keys[2], task=JOB, args=unsigned_job)
        tamper(marks, keys[3], args=planted_pickle(planted))
        before = refusals(worker)
        marks.set(f"{spec.marks}:let_go", 1)

        eventually(lambda: refusals(worker) >= before + 3, what="three refusals logged")
        log = worker.log()
        assert "signature does not match" in log
        assert f"the record names the task {JOB!r}, not {FOLLOW!r}" in log
        for key in keys.values():
            eventually(lambda key=key: marks.get(key) is None, what=f"{key!r} freed")
    ran = [job for job, *_ in follow_runs(marks, spec)]
    assert sorted(ran[1:]) == sorted(holders)  # the holders, and no owed run
    assert starts(marks, spec) == []  # faults.job never ran
    assert not planted.exists()


def test_keys_named_by_a_message_outside_the_namespace_are_ignored(
    make_spec: Callable[..., Spec],
    start_worker: Callable[..., Worker],
    marks: Any,
) -> None:
    """A crafted message names a key of another application (``sessions:…``) and another
    namespace's key held by the same job id: the worker runs the job, logs each key as
    ignored, and neither creates the first nor deletes the second."""
    spec = make_spec()
    other = make_spec()
    job_id = uuid.uuid4().hex
    sessions = f"sessions:{uuid.uuid4().hex}"
    marks.set(f"{sessions}-kept", "session data")
    with producer(other) as other_app:
        # Held by job_id in the other namespace; no worker consumes the other queue.
        task_of(other_app).apply_async(task_id=job_id, unique_key="k", unique_while="active")
    foreign = job_key(other, "k")
    assert marks.get(foreign) is not None

    worker = start_worker(spec)
    with producer(spec, plain=True) as plain:
        for key in (sessions, f"{sessions}-kept", foreign):
            plain.send_task(
                JOB,
                task_id=job_id if key == foreign else uuid.uuid4().hex,
                headers={KEY_HEADER: {"v": 1, "a": key, "s": "active"}},
            )
    eventually(lambda: len(starts(marks, spec)) == 3, what="the three jobs to run")
    # A job of the app's own, after them: once its key is released, so would theirs be.
    with producer(spec) as app:
        task_of(app).apply_async(unique_key="after", unique_while="active")
    eventually(lambda: len(starts(marks, spec)) == 4, what="the app's own job to run")
    eventually(lambda: marks.get(job_key(spec, "after")) is None, what="its key released")
    assert marks.get(sessions) is None
    assert marks.get(f"{sessions}-kept") == b"session data"
    held = marks.get(foreign)
    assert held is not None
    assert job_id in held.decode()
    assert worker.log().count("outside this app's namespace") == 3
