"""Request fingerprints and policy digests: what tells two requests, or two policies, apart."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from celery_unique.arguments import json_payload
from celery_unique.canonical import canonical_digest
from celery_unique.fingerprint import _TASK_POLICY, POLICY_HEX, policy_digest, request_fingerprint


def task(**settings: Any) -> Any:
    return SimpleNamespace(**dict.fromkeys(_TASK_POLICY) | settings)


def from_scratch(task: Any, options: dict[str, Any]) -> str:
    """The digest's definition, with no cache in the way."""
    document = {name: options.get(name, getattr(task, name)) for name in _TASK_POLICY}
    return canonical_digest(json_payload(document))[:POLICY_HEX]


def test_equal_but_differently_typed_settings_digest_apart() -> None:
    """True == 1 == 1.0 in Python; as settings they mean different things."""
    digests = [policy_digest(task(retry_backoff=value), {}) for value in (True, 1, 1.0)]
    assert digests == [from_scratch(task(retry_backoff=v), {}) for v in (True, 1, 1.0)]
    assert len(set(digests)) == 3


def test_a_changed_task_setting_changes_the_digest() -> None:
    job = task(max_retries=3)
    before = policy_digest(job, {})
    job.max_retries = 5
    after = policy_digest(job, {})
    assert before != after
    assert after == from_scratch(job, {})


def test_dispatch_options_override_task_settings() -> None:
    job = task(time_limit=60)
    assert policy_digest(job, {"time_limit": 30}) == policy_digest(task(time_limit=30), {})
    assert policy_digest(job, {"time_limit": 30}) != policy_digest(job, {})


def test_unhashable_settings_are_digested_too() -> None:
    job = task(retry_backoff=[1, 2])
    assert policy_digest(job, {}) == from_scratch(job, {})
    assert policy_digest(job, {}) != policy_digest(task(retry_backoff=[2, 1]), {})


def fingerprint(**extra: Any) -> str:
    arguments: dict[str, Any] = {"headers": None, "link": None, "link_error": None} | extra
    return request_fingerprint(
        task_name="t", payload={"a": 1}, options={}, keys={"window": "w"}, **arguments
    )


def test_no_headers_and_empty_headers_are_the_same_request() -> None:
    assert fingerprint() == fingerprint(headers={})


def test_headers_and_callbacks_are_part_of_the_request() -> None:
    plain = fingerprint()
    assert fingerprint(headers={"tenant": 1}) != plain
    assert fingerprint(link={"task": "notify"}) != plain
    assert fingerprint(link_error={"task": "notify"}) != plain
    assert fingerprint(link={"task": "notify"}) != fingerprint(link_error={"task": "notify"})


def started(**start: Any) -> str:
    return request_fingerprint(
        task_name="t",
        payload={"a": 1},
        options=start,
        keys={"window": "w"},
        headers=None,
        link=None,
        link_error=None,
    )


def test_no_countdown_and_countdown_zero_are_the_same_request() -> None:
    """Both start the job now; a later start is another request."""
    assert started() == started(countdown=0) == started(countdown=None)
    assert started(countdown=5) != started()
