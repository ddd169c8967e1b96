"""Experiment: overlap the store's EVALSHA with Celery building the broker message.

Run: ``python bench/overlap.py [--n 100] [--rounds 30] [--repeat 3]``.

Today a created dispatch waits for the store's answer, then lets Celery build
and publish the message: the round trip (and, on a virtual machine, the cost
of both sides sleeping and waking for it) is added to the publish. This
prototype, standalone and without touching the library, sends the EVALSHA on
a redis-py connection (``send_command``), lets Celery's own ``apply_async``
route the job and build the message, and reads the store's answer
(``read_response``) only when kombu is about to publish, through a producer
proxy. A created verdict publishes; any other verdict aborts before anything
is sent, so nothing is published for a reused key.

Variants, all on the selector task (fresh key per dispatch), timed in
interleaved turns:

* ``plain``: plain ``apply_async`` (reference);
* ``no store``: the same planning and publish (task id, header) without any
  store: the floor an overlap could reach;
* ``library``: ``UniqueTask.apply_async`` as it is today;
* ``sequential``: the prototype's code, answer read right after sending;
* ``overlapped``: the same code, answer read just before the publish;
* ``one trip``: the message is built first and handed to a variant of
  decide.lua that LPUSHes it itself when the job is created: one round trip
  for the whole dispatch. Only possible when the store and a Redis broker
  share a database (here both in db 12), and it writes kombu's queue format
  from outside kombu: an upper bound, not a design.

``sequential`` and ``overlapped`` differ only in where ``read_response`` is,
so their difference is what the overlap gains; ``library`` minus
``sequential`` is what skipping redis-py's client layer (``Script.__call__``
-> ``execute_command``) gains.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import harness
from celery.app.task import Task
from celery.utils import uuid
from harness import QUEUE, TENANT, fresh

from celery_unique import dispatch
from celery_unique.config import runtime
from celery_unique.headers import HEADER
from celery_unique.receipt import Disposition, DuplicateMatch, stamp
from celery_unique.stores.base import Claim, Decision, Verdict
from celery_unique.stores.redis import SCOPE_CHARS, _decision, _text, script_source

#: Diagnostics, off while timing: how often the answer had already arrived when read.
PROBE = {"on": 0, "reads": 0, "ready": 0}


class NotCreated(Exception):
    """The store did not create the job: the publish is abandoned before anything is sent."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.verdict.value)
        self.decision = decision


class PendingDecision:
    """An EVALSHA of decide.lua for one claim, sent now, answered later."""

    def __init__(self, store: Any, claim: Claim) -> None:
        self.store, self.claim = store, claim
        active = claim.active
        # The prototype's one case: a declared active key, no window key.
        assert active is not None
        assert claim.window is None
        lease = "" if active.lease_ms is None else active.lease_ms
        self.pool = store.client.connection_pool
        self.connection = self.pool.get_connection()
        # ARGV layout of stores/lua/decide.lua for one claim with an active key only.
        self.connection.send_command(
            "EVALSHA", store._scripts["decide"].sha, 1, active.key,
            "1", 1, claim.job_id, claim.task, 1, SCOPE_CHARS[active.scope], lease,
            0, "", "", "", claim.handoff_from or "",
        )  # fmt: skip
        self.decision: Decision | None = None
        self.published = False

    def result(self) -> Decision:
        if self.decision is None:
            if PROBE["on"]:
                PROBE["reads"] += 1
                PROBE["ready"] += bool(self.connection.can_read(timeout=0))
            try:
                reply = self.connection.read_response()
            finally:
                self.pool.release(self.connection)
            self.decision = first_decision(reply)
        return self.decision

    def close(self) -> None:
        """Always called: read an unread answer; free a created key that was never published."""
        decision = self.result()
        if decision.verdict is Verdict.CREATED and not self.published:
            self.store.rollback(self.claim)


class DecidingProducer:
    """A kombu producer that waits for the store's answer just before it publishes."""

    def __init__(self, producer: Any, pending: PendingDecision) -> None:
        self._producer, self._pending = producer, pending

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(self, body: Any, **options: Any) -> Any:
        decision = self._pending.result()
        if decision.verdict is not Verdict.CREATED:
            raise NotCreated(decision)
        self._pending.published = True
        return self._producer.publish(body, **options)


def prototype(task: Any, args: tuple[Any, ...], *, overlap: bool) -> Any:
    """One dispatch of a task whose only key is a declared active key."""
    rt = runtime(task.app)
    job_id = uuid()
    planned = dispatch.plan(task, task.__unique__, {}, args, None, {}, job_id=job_id, rt=rt)
    assert planned is not None
    pending = PendingDecision(rt.store, planned.claim)
    try:
        if not overlap:
            pending.result()
        with task.app.producer_or_acquire() as producer:
            try:
                deciding: Any = DecidingProducer(producer, pending)
                headers: Any = {HEADER: planned.header}
                result = Task.apply_async(
                    task, args, None, task_id=job_id, producer=deciding, headers=headers
                )
            except NotCreated as reused:
                result = task.AsyncResult(reused.decision.job_id)
                return stamp(result, Disposition.REUSED, DuplicateMatch.ACTIVE)
        return stamp(result)
    finally:
        pending.close()


def first_decision(reply: Any) -> Decision:
    """The first claim's decision in decide.lua's answer (results joined by 0x1E)."""
    return _decision(_text(reply).split("\x1e")[0])


#: decide.lua, plus: a created single claim also LPUSHes the message kombu would have sent
#: (last KEY: the queue list, last ARGV: the message). Needs broker and store in one db.
_RETURN = 'return table.concat(results, "\\30")'
PUSH_SOURCE = (lambda source: source[: source.rindex(_RETURN)] + (
    'if #results == 1 and string.find(results[1], "created", 1, true) == 1 then\n'
    '  redis.call("LPUSH", KEYS[#KEYS], ARGV[#ARGV])\nend\n' + _RETURN + "\n"
))(script_source("decide"))  # fmt: skip


class CapturedPut:
    """Stands in for the Redis channel's ``_put``: keeps the LPUSH kombu would have sent."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.key: str | None = None
        self.payload: str | None = None

    def __call__(self, queue: str, message: Any, **_: Any) -> None:
        from kombu.utils.json import dumps

        channel = self.channel
        self.key = channel._q_for_pri(queue, channel._get_message_priority(message, reverse=False))
        self.payload = dumps(message)


def one_trip(task: Any, args: tuple[Any, ...]) -> Any:
    """Build the message first, then one EVALSHA that decides and, if created, enqueues it."""
    rt = runtime(task.app)
    job_id = uuid()
    planned = dispatch.plan(task, task.__unique__, {}, args, None, {}, job_id=job_id, rt=rt)
    assert planned is not None
    with task.app.producer_or_acquire() as producer:
        channel = producer.channel
        capture = CapturedPut(channel)
        channel._put = capture
        try:
            headers: Any = {HEADER: planned.header}
            result = Task.apply_async(
                task, args, None, task_id=job_id, producer=producer, headers=headers
            )
        finally:
            del channel._put
    claim, active = planned.claim, planned.claim.active
    assert active is not None
    store: Any = rt.store
    pool = store.client.connection_pool
    connection = pool.get_connection()
    try:
        connection.send_command(
            "EVALSHA", PUSH_SHA[0], 2, active.key, capture.key,
            "1", 1, claim.job_id, claim.task, 1, SCOPE_CHARS[active.scope],
            active.lease_ms or "", 0, "", "", "", claim.handoff_from or "", capture.payload,
        )  # fmt: skip
        decision = first_decision(connection.read_response())
    finally:
        pool.release(connection)
    if decision.verdict is Verdict.CREATED:
        return stamp(result)
    return stamp(task.AsyncResult(decision.job_id), Disposition.REUSED, DuplicateMatch.ACTIVE)


PUSH_SHA: list[str] = []


def no_store(task: Any, args: tuple[Any, ...]) -> Any:
    """The floor: the same planning and publish with no store at all."""
    job_id = uuid()
    planned = dispatch.plan(
        task, task.__unique__, {}, args, None, {}, job_id=job_id, rt=runtime(task.app)
    )
    assert planned is not None
    headers: Any = {HEADER: planned.header}
    return stamp(Task.apply_async(task, args, None, task_id=job_id, headers=headers))


def ready_share(bench: harness.Bench, overlap: bool, count: int = 500) -> float:
    """Share of dispatches whose store answer was already waiting when it was read."""
    PROBE.update(on=1, reads=0, ready=0)
    try:
        for _ in range(count):
            prototype(bench.tasks.selector, (TENANT, fresh()), overlap=overlap)
    finally:
        PROBE["on"] = 0
    harness.reset_broker(bench)
    return PROBE["ready"] / max(1, PROBE["reads"])


def check(bench: harness.Bench, same: harness.Bench) -> None:
    """The prototype creates, reuses without publishing, and carries the library's header."""
    task = bench.tasks.selector
    store: Any = runtime(task.app).store
    store.client.script_load(store._scripts["decide"].script)  # the prototype skips NOSCRIPT
    harness.reset_broker(bench)
    bench.store.flushdb()
    same_store: Any = runtime(same.app).store
    PUSH_SHA[:] = [same_store.client.script_load(PUSH_SOURCE)]
    before = bench.broker.llen(QUEUE)
    created = one_trip(same.tasks.selector, (TENANT, 515151))
    again = one_trip(same.tasks.selector, (TENANT, 515151))
    pushed = bench.broker.llen(QUEUE) - before
    if not (
        created.disposition is Disposition.CREATED
        and again.disposition is Disposition.REUSED
        and again.id == created.id
        and pushed == 1
    ):
        raise SystemExit(f"one-trip prototype misbehaves: {created!r} {again!r} {pushed}")
    harness.reset_broker(bench)
    first = prototype(task, (TENANT, 424242), overlap=True)
    second = prototype(task, (TENANT, 424242), overlap=True)
    library = task.apply_async((TENANT, 424242))
    queued = bench.broker.llen(QUEUE)
    if not (
        first.disposition is Disposition.CREATED
        and second.disposition is Disposition.REUSED
        and second.id == first.id == library.id
        and queued == 1
    ):
        raise SystemExit(f"prototype misbehaves: {first!r} {second!r} {library!r}, {queued}")
    message = bench.broker.lindex(QUEUE, 0)
    if message is None or HEADER.encode() not in message:
        raise SystemExit("the prototype's message lacks the celery_unique header")
    harness.reset_broker(bench)
    bench.store.flushdb()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="dispatches per variant per turn")
    parser.add_argument("--rounds", type=int, default=30, help="turns per variant")
    parser.add_argument("--repeat", type=int, default=3, help="whole comparisons")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    options = parser.parse_args()
    bench = harness.build(options.redis)
    bench.broker.flushdb()
    bench.store.flushdb()
    # The one-round-trip variant needs its store in the broker's database.
    same = harness.build(options.redis, store_db=harness.BROKER_DB, name="benchsame")
    check(bench, same)
    t = bench.tasks
    machine = harness.machine(bench.store)
    print(
        f"machine: {machine['cores']} cores, Python {machine['python']}, Redis "
        f"{machine['redis_server']}, redis-py {machine['redis_py']}; load "
        f"{machine['load_average']}",
        file=sys.stderr,
    )
    savings: list[float] = []
    for attempt in range(options.repeat):
        timings = harness.compare(
            {
                "plain": lambda: t.plain.apply_async((TENANT, fresh())),
                "no store": lambda: no_store(t.selector, (TENANT, fresh())),
                "library": lambda: t.selector.apply_async((TENANT, fresh())),
                "sequential": lambda: prototype(t.selector, (TENANT, fresh()), overlap=False),
                "overlapped": lambda: prototype(t.selector, (TENANT, fresh()), overlap=True),
                "one trip": lambda: one_trip(same.tasks.selector, (TENANT, fresh())),
            },
            options.n,
            options.rounds,
        )
        harness.reset_broker(bench)
        bench.store.flushdb()
        savings.append(report(timings, attempt, options))
    ready = {
        name: ready_share(bench, overlap)
        for name, overlap in (("sequential", False), ("overlapped", True))
    }
    bench.store.flushdb()
    bench.broker.flushdb()  # the one-trip variant's keys live there
    print(
        f"\noverlap saved {', '.join(f'{value:.1f}' for value in savings)} us of wall time "
        f"(median {harness.median(savings):.1f} us per dispatch)"
    )
    print(
        "store answer already there when read (a separate, probed pass): "
        + ", ".join(f"{name} {share:.0%}" for name, share in ready.items())
    )


def report(timings: dict[str, tuple[float, float] | None], attempt: int, options: Any) -> float:
    """Print one comparison; return the wall time the overlap saved per dispatch."""
    plain = timings["plain"] or (1.0, 1.0)
    print(f"\nattempt {attempt + 1}: median of {options.rounds} turns x {options.n} dispatches")
    print(f"{'variant':<12} {'wall us':>9} {'extra':>7} {'x plain':>8} {'CPU us':>8} {'extra':>7}")
    for name, value in timings.items():
        assert value is not None
        print(
            f"{name:<12} {value[0]:>9.1f} {value[0] - plain[0]:>7.1f} {plain[0] / value[0]:>8.2f} "
            f"{value[1]:>8.1f} {value[1] - plain[1]:>7.1f}"
        )
    sequential, overlapped = timings["sequential"] or plain, timings["overlapped"] or plain
    saved = sequential[0] - overlapped[0]
    print(
        f"overlap saves {saved:.1f} us of wall time per dispatch "
        f"({saved / max(sequential[0] - plain[0], 1e-9):.0%} of the sequential prototype's "
        f"extra over plain); CPU time differs by {sequential[1] - overlapped[1]:.1f} us"
    )
    return saved


if __name__ == "__main__":
    main()
