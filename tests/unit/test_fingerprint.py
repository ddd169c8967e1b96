"""Request fingerprints and policy digests: what tells two requests, or two policies, apart."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

from kombu import Exchange, Queue

from celery_unique.keys.arguments import json_payload
from celery_unique.keys.canonical import canonical_digest
from celery_unique.keys.fingerprint import (
    _TASK_POLICY,
    POLICY_HEX,
    policy_digest,
    request_fingerprint,
)


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


def test_a_fingerprint_is_the_digest_of_its_documented_document() -> None:
    """Version 1 covers task, payload, routing, start, keys and extras, in these fields;
    the stored fingerprint is 32 hex digits (128 bits) of its digest."""
    document = {
        "v": 1,
        "task": "t",
        "payload": {"a": 1},
        "routing": {"queue": "q", "exchange": None, "routing_key": None, "priority": 3},
        "start": {"eta": None, "countdown": 5},
        "keys": {"window": "w"},
        "extra": {"headers": {}, "link": None, "link_error": None},
    }
    fingerprint = request_fingerprint(
        task_name="t",
        payload={"a": 1},
        options={"queue": "q", "priority": 3, "countdown": 5},
        keys={"window": "w"},
        headers=None,
        link=None,
        link_error=None,
    )
    assert fingerprint == canonical_digest(document)[:32]
    assert re.fullmatch("[0-9a-f]{32}", fingerprint)


def test_a_policy_digest_is_16_hex_digits() -> None:
    """64 bits tell policies apart: the stored digest is 16 hex digits."""
    assert re.fullmatch("[0-9a-f]{16}", policy_digest(task(max_retries=3), {}))


def test_queues_and_exchanges_are_identified_by_name() -> None:
    """A Queue or Exchange object and its name route the same: the same request."""
    by_name = started(queue="q", exchange="x")
    assert started(queue=Queue("q"), exchange=Exchange("x")) == by_name
    assert started(queue=Queue("other"), exchange=Exchange("x")) != by_name


def test_an_eta_as_a_datetime_is_the_same_request_as_its_iso_text() -> None:
    """A datetime eta is compared by its ISO text; another start time is another request."""
    eta = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert started(eta=eta) == started(eta=eta.isoformat())
    assert started(eta=eta) != started(eta=eta + timedelta(seconds=1))


def signature(task_name: str, **options: Any) -> dict[str, Any]:
    return {"task": task_name, "args": [], "kwargs": {}, "options": options}


def test_job_ids_of_continuations_are_not_part_of_the_request() -> None:
    """Frozen callbacks and chains get fresh ids on every dispatch: the ids in a
    signature's options are left out, in lists and nested signatures too, and what
    the continuation does is kept."""
    first = signature("notify", task_id="1", root_id="r1", parent_id="p1", queue="q")
    again = signature("notify", task_id="2", root_id="r2", parent_id="p2", queue="q")
    assert fingerprint(link=first) == fingerprint(link=again)
    assert fingerprint(link_error=[first]) == fingerprint(link_error=[again])
    assert fingerprint(chain=[first]) == fingerprint(chain=[again])
    nested = signature("outer", link=first, group_id="g1", group_index=0)
    nested_again = signature("outer", link=again, group_id="g2", group_index=1)
    assert fingerprint(link=nested) == fingerprint(link=nested_again)
    assert fingerprint(link=first) != fingerprint(link=signature("notify", queue="other"))
    assert fingerprint(chain=[first]) != fingerprint(chain=[signature("other")])


def test_options_outside_a_signature_keep_their_ids() -> None:
    """Only a signature (a task name beside its options) loses its ids: a header that
    happens to hold an ``options`` mapping is compared whole."""
    assert fingerprint(headers={"options": {"task_id": "1"}}) != fingerprint(
        headers={"options": {"task_id": "2"}}
    )
    unlike_a_signature = {"task": "t", "options": ["task_id", "1"]}
    assert fingerprint(link=unlike_a_signature) != fingerprint(
        link={"task": "t", "options": ["task_id", "2"]}
    )


def test_a_chain_counts_only_when_there_is_one() -> None:
    """An empty chain is no chain: digests of requests without one are unchanged."""
    assert fingerprint(chain=[]) == fingerprint(chain=None) == fingerprint()
    assert fingerprint(chain=[signature("next")]) != fingerprint()


def test_an_option_set_to_none_leaves_the_task_setting() -> None:
    """``time_limit=None`` at dispatch is no override: the task's setting is digested."""
    job = task(time_limit=60)
    assert policy_digest(job, {"time_limit": None}) == policy_digest(job, {})
    assert policy_digest(job, {"time_limit": None}) != policy_digest(task(), {})


def test_an_expiry_as_a_datetime_is_digested_as_its_iso_text() -> None:
    """``expires`` may be a datetime at dispatch: it is digested as its ISO text."""
    when = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    job = task()
    assert policy_digest(job, {"expires": when}) == policy_digest(
        job, {"expires": when.isoformat()}
    )
