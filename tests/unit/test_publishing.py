"""The publish gate: a job leaves only on a decision that lets it out.

At Celery's ``send_task_message`` (which job a message is, what it tells Celery
to declare), in the stand-in producer Celery is handed, and in the dispatch that
publishes behind the gate (what it answers, undoes or reports for each way a
publish ends). Jobs go to kombu's in-memory broker; the store's answers come from
a fake runtime, whose store shares no server with that broker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Queue
from kombu.common import Broadcast, maybe_declare

from celery_unique import config as unique_config
from celery_unique.dispatch import colocated, resend
from celery_unique.dispatch.gate import Gate, NotPublished, gated
from celery_unique.dispatch.publishing import (
    DeferredProducer,
    _declared_already,
    _job_id,
    install_gate,
    publish_deciding,
)
from celery_unique.exceptions import BackendUnavailable
from celery_unique.stores.base import Claim, DecidedAlready, Decision, Verdict
from tests.unit.conftest import queued_job_ids
from tests.unit.fakes import CREATED, AnsweringStore, FakeRuntime

REUSED = Decision(Verdict.REUSED_ACTIVE, "holder")


class Refused(Exception):
    """A store error the gate does not know (not a coded one)."""


def refuse() -> None:
    raise Refused


def test_a_gate_whose_decision_failed_never_lets_its_job_out(app: Celery) -> None:
    """A retried publish (kombu retries a failed put) finds the failure again, never a way
    out: the gate is not "resolved" with no decision."""
    gate = Gate("job", unique_config.runtime(app), None, claim=Claim("job", "task"))
    with pytest.raises(Refused):
        gate.let_out(refuse)  # type: ignore[arg-type]
    for _ in range(2):
        with pytest.raises(Refused):
            gate.let_out()
    assert not gate.passed
    assert not gate.created()


# The gate at Celery's send_task_message


@dataclass
class SeparateRuntime(FakeRuntime):
    """A fake runtime whose store shares no server with the broker (the co-located way
    reads that too)."""

    colocation: Any = False


def decided(decision: Decision, job_id: str = "job") -> Gate:
    """A gate whose question was sent ahead, answered ``decision``."""
    return Gate(job_id, SeparateRuntime(), None, DecidedAlready([decision]))  # type: ignore[arg-type]


def asked(store: AnsweringStore | None = None, job_id: str = "job", **runtime: Any) -> Gate:
    """A gate whose question is asked as the message leaves, of ``store``."""
    rt = SeparateRuntime(store or AnsweringStore(), **runtime)
    return Gate(job_id, rt, None, claim=Claim(job_id, "task"))  # type: ignore[arg-type]


@pytest.fixture
def gated_app(app: Celery) -> Celery:
    install_gate(app)
    # kombu's in-memory broker is one for the whole process: what earlier tests left in
    # its queue is taken off first, so the tests here see their own messages only.
    queued_job_ids(app)
    return app


def test_a_job_leaves_through_its_gate_when_the_store_created_it(
    gated_app: Celery, published: list[dict[str, Any]]
) -> None:
    gate = decided(CREATED)
    with gated(gate):
        gated_app.send_task("tasks.t", task_id="job")
    assert gate.passed
    assert [headers["id"] for headers in published] == ["job"]
    assert queued_job_ids(gated_app) == {"job"}


def test_a_job_the_store_did_not_create_never_reaches_the_broker(
    gated_app: Celery, published: list[dict[str, Any]]
) -> None:
    with gated(decided(REUSED)), pytest.raises(NotPublished):
        gated_app.send_task("tasks.t", task_id="job")
    assert published == []
    assert queued_job_ids(gated_app) == set()


def test_a_task_protocol_1_message_passes_the_gate_of_the_job_in_its_body(
    gated_app: Celery, published: list[dict[str, Any]]
) -> None:
    gated_app.conf.task_protocol = 1
    with gated(decided(REUSED)), pytest.raises(NotPublished):
        gated_app.send_task("tasks.t", task_id="job")
    assert published == []


def test_an_asked_gate_asks_the_store_as_its_message_leaves(gated_app: Celery) -> None:
    gate = asked()
    with gated(gate):
        gated_app.send_task("tasks.t", task_id="job")
    assert gate.passed
    assert gate.rt.store.asked == 1  # type: ignore[attr-defined]
    assert queued_job_ids(gated_app) == {"job"}


def test_other_jobs_leave_as_celery_sends_them(gated_app: Celery) -> None:
    gate = decided(REUSED, job_id="another")
    with gated(gate):
        gated_app.send_task("tasks.t", task_id="job")
    gated_app.send_task("tasks.t", task_id="ungated")
    assert not gate.passed
    assert queued_job_ids(gated_app) == {"job", "ungated"}


def test_the_gate_is_installed_once_an_app(gated_app: Celery) -> None:
    install_gate(gated_app)
    with resend.counting_sends() as sent, gated(decided(CREATED)):
        gated_app.send_task("tasks.t", task_id="job")
    assert sent == ["job"]


def test_a_job_id_is_read_from_the_headers_or_else_a_task_protocol_1_body() -> None:
    assert _job_id(SimpleNamespace(headers={"id": "v2"}, body={"id": "v1"})) == "v2"
    assert _job_id(SimpleNamespace(headers={}, body={"id": "v1"})) == "v1"
    assert _job_id(SimpleNamespace(headers=None, body={"id": "v1"})) == "v1"
    assert _job_id(SimpleNamespace(headers={"id": 7})) is None
    assert _job_id(SimpleNamespace(headers={}, body=b'{"id": "v1"}')) is None
    assert _job_id(object()) is None


# Declaring a unique job's queue


class Recorded:
    """Celery's own send_task_message, as the gate wraps it: records what it is given."""

    def __init__(self) -> None:
        self.options: list[dict[str, Any]] = []

    def __call__(self, producer: Any, name: str, message: Any, **options: Any) -> None:
        self.options.append(options)


@pytest.fixture
def recorded(app: Celery) -> Recorded:
    sends = Recorded()
    app.amqp.send_task_message = sends  # type: ignore[misc]
    install_gate(app)
    return sends


@pytest.fixture
def producer(app: Celery) -> Iterator[Any]:
    with app.producer_or_acquire(None) as taken:
        yield taken


def declared(producer: Any, queue: Queue) -> Queue:
    maybe_declare(queue, producer.channel)
    return queue


def message(job_id: str = "job") -> SimpleNamespace:
    return SimpleNamespace(headers={"id": job_id})


def test_a_unique_job_is_sent_without_declaring_a_queue_its_connection_declared(
    app: Celery, recorded: Recorded, producer: Any
) -> None:
    queue = declared(producer, Queue("q", Exchange("q"), "q"))
    with gated(decided(CREATED)):
        app.amqp.send_task_message(producer, "tasks.t", message(), queue=queue)
    assert recorded.options == [{"queue": queue, "declare": []}]


def test_a_unique_job_captured_for_a_batch_is_sent_without_declaring_it_again(
    app: Celery, recorded: Recorded, producer: Any
) -> None:
    queue = declared(producer, Queue("q", Exchange("q"), "q"))
    with colocated.capturing():
        app.amqp.send_task_message(producer, "tasks.t", message(), queue=queue)
    assert recorded.options == [{"queue": queue, "declare": []}]


def test_another_job_is_left_to_celery_to_declare(
    app: Celery, recorded: Recorded, producer: Any
) -> None:
    queue = declared(producer, Queue("q", Exchange("q"), "q"))
    app.amqp.send_task_message(producer, "tasks.t", message(), queue=queue)
    assert recorded.options == [{"queue": queue}]


def test_a_declared_queue_is_found_by_name_and_a_declaration_asked_for_is_kept(
    app: Celery, producer: Any
) -> None:
    queue = declared(producer, Queue("named", Exchange("named"), "named"))
    app.amqp.queues.add(queue)
    by_name: dict[str, Any] = {"queue": "named"}
    _declared_already(app.amqp, producer, by_name)
    assert by_name == {"queue": "named", "declare": []}
    asked_for: dict[str, Any] = {"queue": queue, "declare": [queue]}
    _declared_already(app.amqp, producer, asked_for)
    assert asked_for == {"queue": queue, "declare": [queue]}


@pytest.mark.parametrize(
    "queue",
    [
        Queue("fresh", Exchange("fresh"), "fresh"),
        Queue("expiring", Exchange("expiring"), "expiring", queue_arguments={"x-expires": 1}),
        Broadcast("fanout", queue="fanout", auto_delete=False),
        None,
        "unknown-name",
    ],
    ids=["not-declared", "expiring", "broadcast", "none", "unknown-name"],
)
def test_a_queue_is_declared_unless_the_connection_declared_it_and_may_keep_it(
    app: Celery, producer: Any, queue: Any
) -> None:
    """kombu's own rule: an expiring or auto-deleted queue is declared with every message;
    a broadcast queue is left to kombu as well."""
    if isinstance(queue, Queue) and queue.name != "fresh":
        producer.channel.connection.client.declared_entities.add(hash(queue))
    options = {"queue": queue}
    _declared_already(app.amqp, producer, options)
    assert options == {"queue": queue}


def test_a_producer_without_a_connection_is_left_to_kombu(app: Celery) -> None:
    options: dict[str, Any] = {"queue": Queue("q", Exchange("q"), "q")}
    _declared_already(app.amqp, SimpleNamespace(channel=None), options)
    assert "declare" not in options


# The stand-in producer


def test_the_stand_in_producer_is_the_callers_own_once_the_job_is_created(
    app: Celery, producer: Any
) -> None:
    stand_in = DeferredProducer(app, producer, decided(CREATED))
    assert stand_in.connection is producer.connection
    stand_in.close()


def test_the_stand_in_producer_takes_one_from_the_pool_and_gives_it_back(app: Celery) -> None:
    stand_in = DeferredProducer(app, None, decided(CREATED))
    taken = stand_in.channel
    stand_in.close()
    stand_in.close()
    with app.producer_or_acquire(None) as again:
        assert again.channel is taken


def test_the_stand_in_of_a_job_not_created_stops_at_its_first_use(app: Celery) -> None:
    stand_in = DeferredProducer(app, SimpleNamespace(connection="given"), decided(REUSED))
    with pytest.raises(NotPublished):
        stand_in.connection  # noqa: B018 - the first use reads the answer
    stand_in.close()


def test_the_stand_in_of_an_asked_gate_leaves_the_question_to_the_message(app: Celery) -> None:
    gate = asked()
    stand_in = DeferredProducer(app, SimpleNamespace(connection="given"), gate)
    assert stand_in.connection == "given"
    assert gate.rt.store.asked == 0  # type: ignore[attr-defined]


# A dispatch behind the gate


class Outcomes:
    """The three ways out of publish_deciding, recorded."""

    def __init__(self) -> None:
        self.refused: list[Decision] = []
        self.undone = 0
        self.created = 0

    def not_published(self, decision: Decision) -> str:
        self.refused.append(decision)
        return "not published"

    def failed(self) -> None:
        self.undone += 1

    def on_created(self) -> None:
        self.created += 1


@pytest.fixture
def outcomes() -> Outcomes:
    return Outcomes()


def deciding(app: Celery, gate: Gate, outcomes: Outcomes, publish: Callable[[Any], Any]) -> Any:
    return publish_deciding(
        app, gate, None, publish, outcomes.not_published, outcomes.failed, outcomes.on_created
    )


def send(app: Celery) -> Callable[[Any], Any]:
    return lambda producer: app.send_task("tasks.t", task_id="job", producer=producer)


def test_a_created_job_is_published_and_signalled_once(
    gated_app: Celery, outcomes: Outcomes, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="celery_unique"):
        result = deciding(gated_app, decided(CREATED), outcomes, send(gated_app))
    assert result.id == "job"
    assert queued_job_ids(gated_app) == {"job"}
    assert (outcomes.refused, outcomes.undone, outcomes.created) == ([], 0, 1)
    assert caplog.records == []


def test_a_job_not_created_is_answered_with_its_decision(
    gated_app: Celery, outcomes: Outcomes
) -> None:
    assert deciding(gated_app, decided(REUSED), outcomes, send(gated_app)) == "not published"
    assert queued_job_ids(gated_app) == set()
    assert (outcomes.refused, outcomes.undone, outcomes.created) == ([REUSED], 0, 0)


def test_an_answer_no_publish_read_is_read_after_it(app: Celery, outcomes: Outcomes) -> None:
    assert deciding(app, decided(REUSED), outcomes, lambda producer: "kept") == "not published"
    assert outcomes.refused == [REUSED]


def test_a_publish_interrupted_after_the_job_was_created_undoes_it(
    gated_app: Celery,
    outcomes: Outcomes,
    interruption: type[BaseException],
    interrupt_publish: Callable[[int], list[str]],
) -> None:
    interrupt_publish(1)
    with pytest.raises(interruption):
        deciding(gated_app, decided(CREATED), outcomes, send(gated_app))
    assert queued_job_ids(gated_app) == set()
    assert (outcomes.refused, outcomes.undone, outcomes.created) == ([], 1, 0)


def test_a_publish_that_failed_before_its_question_was_asked_undoes_nothing(
    app: Celery, outcomes: Outcomes
) -> None:
    gate = asked()

    def fail(producer: Any) -> None:
        raise Refused

    with pytest.raises(Refused):
        deciding(app, gate, outcomes, fail)
    assert gate.rt.store.asked == 0  # type: ignore[attr-defined]
    assert (outcomes.refused, outcomes.undone, outcomes.created) == ([], 0, 0)


def test_a_failed_publish_of_a_job_not_created_undoes_nothing(
    app: Celery, outcomes: Outcomes
) -> None:
    def fail(producer: Any) -> None:
        raise Refused

    with pytest.raises(Refused):
        deciding(app, decided(REUSED), outcomes, fail)
    assert (outcomes.refused, outcomes.undone, outcomes.created) == ([], 0, 0)


def test_a_job_sent_around_every_gate_is_reported_as_a_bug(
    app: Celery, outcomes: Outcomes, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="celery_unique"):
        assert deciding(app, decided(CREATED), outcomes, lambda producer: "sent") == "sent"
    assert [r.getMessage() for r in caplog.records] == [
        f"job job of {app.main} was sent without passing the uniqueness gate (answer: created); "
        "please report this with your Celery version"
    ]
    assert outcomes.created == 1


def test_a_job_published_without_uniqueness_while_the_store_is_down_is_not_created(
    gated_app: Celery, outcomes: Outcomes, caplog: pytest.LogCaptureFixture
) -> None:
    down = AnsweringStore(error=BackendUnavailable("down"))
    with caplog.at_level(logging.ERROR, logger="celery_unique"):
        deciding(gated_app, asked(down, fail_open=True), outcomes, send(gated_app))
        deciding(gated_app, asked(down, fail_open=True), outcomes, lambda producer: "sent")
    assert queued_job_ids(gated_app) == {"job"}
    assert (outcomes.refused, outcomes.undone, outcomes.created) == ([], 0, 0)
    assert caplog.records == []


def test_a_dispatch_with_nothing_to_do_on_creation_publishes_its_job(
    gated_app: Celery, outcomes: Outcomes
) -> None:
    publish = send(gated_app)
    result = publish_deciding(
        gated_app, decided(CREATED), None, publish, outcomes.not_published, outcomes.failed
    )
    assert result.id == "job"
    assert queued_job_ids(gated_app) == {"job"}
