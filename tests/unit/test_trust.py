"""The store and message headers as trust boundaries: signed arguments, confined keys, W030."""

from __future__ import annotations

import base64
import logging
from typing import Any

import pytest
from celery import Celery

from celery_unique import InvalidPayload, UniqueTask
from celery_unique.checks import app_findings
from celery_unique.config import reset, runtime
from celery_unique.dispatch.headers import VERSION, KeyHeader, confined, own_header
from celery_unique.exceptions import ImproperlyConfigured
from celery_unique.keys import keyspace
from celery_unique.options.duplicates import RefusedArguments, decode_arguments, encode_arguments
from celery_unique.stores import signing

KEY = keyspace.storage_key("unit", keyspace.ACTIVE, "trust.job", "k")


def define(app: Celery, **options: Any) -> Any:
    @app.task(
        name="trust.job",
        shared=False,
        base=UniqueTask,
        unique_key=lambda job: str(job["customer"]),
        unique_while="active",
        **options,
    )
    def job(customer: int) -> None:
        return None

    return job


def stored(app: Celery, task: Any, key: str = KEY, customer: int = 1) -> str:
    signing_key = runtime(app).signing_key
    return encode_arguments(
        task, [], {"customer": customer}, 1024, storage_key=key, signing_key=signing_key
    )


def test_signed_arguments_read_back_for_their_own_key_only(app: Celery) -> None:
    """Arguments read back for the key they were stored under, and for no other key."""
    job = define(app)
    value = stored(app, job)
    signing_key = runtime(app).signing_key
    assert decode_arguments(job, KEY, value, signing_key) == ([], {"customer": 1})
    other = keyspace.storage_key("unit", keyspace.ACTIVE, "trust.job", "other")
    with pytest.raises(RefusedArguments, match="signature does not match"):
        decode_arguments(job, other, value, signing_key)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda v: v.replace("s1:", "s1:A", 1), id="signature changed"),
        pytest.param(lambda v: v[: v.rindex("|") + 1] + "W10=", id="arguments changed"),
        pytest.param(lambda v: v.split("|", 1)[1], id="signature removed"),
    ],
)
def test_changed_arguments_are_refused(app: Celery, change: Any) -> None:
    """Arguments changed in the store fail the check."""
    job = define(app)
    with pytest.raises(RefusedArguments, match="signature does not match"):
        decode_arguments(job, KEY, change(stored(app, job)), runtime(app).signing_key)


def test_only_the_tasks_own_serializer_decodes(app: Celery) -> None:
    """Even signed, arguments in another format than the task's serializer are refused."""
    job = define(app)

    @app.task(name="trust.pickled", shared=False, base=UniqueTask, serializer="pickle")
    def pickled(customer: int) -> None:
        return None

    value = stored(app, pickled)
    with pytest.raises(RefusedArguments, match="not the task's own serializer's"):
        decode_arguments(job, KEY, value, runtime(app).signing_key)


def test_a_pickle_task_refuses_json_arguments_too(app: Celery) -> None:
    """The other way round: the format must be the task's own, not merely a known one."""
    job = define(app)

    @app.task(name="trust.pickled", shared=False, base=UniqueTask, serializer="pickle")
    def pickled(customer: int) -> None:
        return None

    value = stored(app, job)
    with pytest.raises(RefusedArguments, match="not the task's own serializer's"):
        decode_arguments(pickled, KEY, value, runtime(app).signing_key)


def test_signed_arguments_that_do_not_decode_are_refused(app: Celery) -> None:
    """A signature proves where arguments come from, not that they decode: a body the
    serializer refuses is RefusedArguments, never the serializer's own error."""
    job = define(app)
    signing_key = runtime(app).signing_key
    body = base64.b64encode(b"{not json").decode("ascii")
    value = signing.sign(signing_key, KEY, f"application/json|utf-8|{body}")
    with pytest.raises(RefusedArguments, match="cannot be decoded"):
        decode_arguments(job, KEY, value, signing_key)


def test_arguments_the_serializer_cannot_encode_are_an_invalid_payload(app: Celery) -> None:
    job = define(app)
    with pytest.raises(InvalidPayload, match=r"the arguments of trust\.job cannot be stored"):
        encode_arguments(
            job, [], {"customer": object()}, 1024, storage_key=KEY, signing_key=b"k" * 32
        )


def test_the_signing_key_comes_from_the_setting(app: Celery) -> None:
    """Two apps with different unique_signing_key cannot read each other's arguments;
    without the setting, the key is derived from the namespace."""
    job = define(app)
    unset = runtime(app).signing_key
    app.conf.unique_signing_key = "one secret"
    reset(app)
    value = stored(app, job)
    assert runtime(app).signing_key != unset
    app.conf.unique_signing_key = b"another secret"
    reset(app)
    with pytest.raises(RefusedArguments):
        decode_arguments(job, KEY, value, runtime(app).signing_key)


@pytest.mark.parametrize("value", ["", b"", 42])
def test_a_bad_signing_key_is_improperly_configured(app: Celery, value: object) -> None:
    """An empty or non-text key is refused by name, and its value is never shown."""
    app.conf.unique_signing_key = value
    reset(app)
    with pytest.raises(ImproperlyConfigured, match="unique_signing_key must be") as raised:
        runtime(app)
    assert raised.value.code == "improperly_configured"


def test_a_header_keeps_only_keys_of_the_namespace(caplog: pytest.LogCaptureFixture) -> None:
    """Keys outside the namespace (another application's, another namespace's) are dropped
    and logged; a header of the namespace's own keys is returned as it is."""
    own: KeyHeader = {"v": VERSION, "a": KEY, "s": "active"}
    assert confined(own, "unit", "job-1") is own
    spread = keyspace.storage_key("unit", keyspace.ACTIVE, "t", "k", tag="abc")
    assert confined({"v": VERSION, "a": spread}, "unit", "job-1")["a"] == spread
    for foreign in (
        "sessions:abc",
        keyspace.storage_key("unit2", keyspace.ACTIVE, "t", "k"),
        keyspace.storage_key("uni", keyspace.ACTIVE, "t", "k"),
        "unique:v1:unit:x",
    ):
        with caplog.at_level(logging.WARNING, logger="celery_unique"):
            header = confined({"v": VERSION, "a": foreign, "w": KEY}, "unit", "job-2")
        assert header == {"v": VERSION, "w": KEY}
        assert "outside this app's namespace" in caplog.text
        caplog.clear()


def test_a_replacements_own_key_is_confined_too(caplog: pytest.LogCaptureFixture) -> None:
    """The key a replacement holds of its own (``x``) is dropped when foreign, kept when not."""
    own: KeyHeader = {"v": VERSION, "a": KEY, "x": {"v": VERSION, "a": KEY, "s": "queued"}}
    assert confined(own, "unit", "job-1") is own
    with caplog.at_level(logging.WARNING, logger="celery_unique"):
        header = confined({**own, "x": {"v": VERSION, "a": "sessions:abc"}}, "unit", "job-2")
    assert header == {"v": VERSION, "a": KEY}
    assert "'sessions:abc'" in caplog.text


def test_a_message_header_is_read_within_the_apps_namespace(app: Celery) -> None:
    """own_header reads a request's header with the app's namespace."""
    namespace = runtime(app).namespace
    key = keyspace.storage_key(namespace, keyspace.ACTIVE, "t", "k")
    headers = {"celery_unique": {"v": VERSION, "a": key, "s": "active"}}
    assert own_header(app, headers, "job") == headers["celery_unique"]
    headers["celery_unique"]["a"] = "sessions:abc"
    assert own_header(app, headers, "job") == {"v": VERSION, "s": "active"}


def test_w029_without_a_signing_key_on_a_shared_store(app: Celery, tmp_path: Any) -> None:
    """A latest task on a store others can write, with no signing key: W030; none with
    the key, or on the memory store."""
    define(app, unique_on_duplicate="latest")
    assert "celery_unique.W030" not in {f.id for f in app_findings(app)}  # memory://
    app.conf.unique_backend = f"sqlite:///{tmp_path / 'keys.db'}"
    found = [f for f in app_findings(app) if f.id == "celery_unique.W030"]
    assert [f.subject for f in found] == ["unique_signing_key"]
    assert "trust.job" in found[0].message
    app.conf.unique_signing_key = "secret"
    assert "celery_unique.W030" not in {f.id for f in app_findings(app)}
