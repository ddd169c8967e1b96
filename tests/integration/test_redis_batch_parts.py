"""A batch too large for one script is decided in parts, on a real Redis server.

A decide script holds its server while it runs (every client, the broker's too
where they share it), so a batch of more than ``MAX_CLAIMS_PER_SCRIPT`` claims
goes in parts of that size. Each part sees what the parts before it wrote; an
all-or-nothing batch refused in one part sends no later part and leaves nothing
of the earlier ones held. Each test runs a private ``redis-server`` so that the
server's own count of scripts run is this test's alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_unique.exceptions import BackendUnavailable
from celery_unique.stores import cleanup
from celery_unique.stores.base import ActiveClaim, Claim, Scope, Verdict, WindowClaim
from celery_unique.stores.redis import MAX_CLAIMS_PER_SCRIPT, RedisStore, script_parts
from tests.processes import RedisServer, free_port, require_redis_server

LEASE = 600_000


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis_server()
    running = RedisServer(free_port(), tmp_path)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def scripts_run(server: RedisServer) -> int:
    """How many scripts the server ran (``decide`` and others): EVALSHA and EVAL calls,
    less those refused (a script's first EVALSHA on a server meets NOSCRIPT)."""
    client = redis.Redis.from_url(server.url())
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    ran = 0
    for name in ("evalsha", "eval"):
        counts = stats.get(f"cmdstat_{name}", {})
        ran += counts.get("calls", 0) - counts.get("failed_calls", 0)
        ran -= counts.get("rejected_calls", 0)
    return ran


def claim(n: int, key: str | None = None, window: str | None = None, fp: str = "fp") -> Claim:
    return Claim(
        job_id=f"job-{n}",
        task="tasks.big",
        active=ActiveClaim(key or f"unique:v1:t\x1fa\x1ftasks.big\x1fk{n}", Scope.ACTIVE, LEASE),
        window=None if window is None else WindowClaim(window, LEASE, fp, "p"),
    )


def test_parts_are_bounded_by_count_and_by_size() -> None:
    """1,000 claims are one part; 2,500 are three; large ``latest`` arguments cut sooner."""
    assert script_parts([claim(n) for n in range(MAX_CLAIMS_PER_SCRIPT)]) == [(0, 1_000)]
    assert script_parts([claim(n) for n in range(2_500)]) == [
        (0, 1_000),
        (1_000, 2_000),
        (2_000, 2_500),
    ]
    heavy = [
        Claim(
            job_id=f"job-{n}",
            task="tasks.big",
            active=ActiveClaim(f"k{n}", Scope.ACTIVE, LEASE, arguments="x" * 1_500_000),
        )
        for n in range(5)
    ]
    assert script_parts(heavy) == [(0, 2), (2, 4), (4, 5)]


@pytest.mark.parametrize("size", [MAX_CLAIMS_PER_SCRIPT, MAX_CLAIMS_PER_SCRIPT + 1])
def test_a_batch_one_claim_over_the_cap_is_the_first_in_two_parts(
    server: RedisServer, size: int
) -> None:
    store = RedisStore.from_url(server.url())
    try:
        before = scripts_run(server)
        decisions = store.decide([claim(n) for n in range(size)])
        assert scripts_run(server) - before == (1 if size == MAX_CLAIMS_PER_SCRIPT else 2)
    finally:
        store.close()
    assert [d.verdict for d in decisions] == [Verdict.CREATED] * size


def test_a_large_batch_goes_in_parts_and_each_sees_the_parts_before_it(
    server: RedisServer,
) -> None:
    """2,500 claims: three scripts; a claim of part two repeating a key of part one, and
    one of part three repeating a key of part two, reuse those earlier jobs."""
    store = RedisStore.from_url(server.url())
    claims = [claim(n) for n in range(2_500)]
    claims[1_500] = claim(1_500, key=claims[10].active.key)  # type: ignore[union-attr]
    claims[2_200] = claim(2_200, key=claims[1_200].active.key)  # type: ignore[union-attr]
    try:
        before = scripts_run(server)
        decisions = store.decide(claims)
        assert scripts_run(server) - before == 3
    finally:
        store.close()
    reused = Verdict.REUSED_ACTIVE
    assert (decisions[1_500].verdict, decisions[1_500].job_id) == (reused, "job-10")
    assert (decisions[2_200].verdict, decisions[2_200].job_id) == (reused, "job-1200")
    created = [d for d in decisions if d.verdict is Verdict.CREATED]
    assert len(created) == 2_498


def test_an_all_or_nothing_batch_refused_in_a_later_part_leaves_nothing_held(
    server: RedisServer,
) -> None:
    """A window conflict at item 1,700 (part two): part three is never sent, and the
    1,000 jobs part one created are rolled back, so no key of the batch stays held."""
    store = RedisStore.from_url(server.url())
    window = "unique:v1:t\x1fw\x1ftasks.big\x1frequest-7"
    try:
        assert store.decide([claim(-1, window=window, fp="first")])[0].verdict is Verdict.CREATED
        claims = [claim(n) for n in range(2_500)]
        claims[1_700] = claim(1_700, window=window, fp="other")
        before = scripts_run(server)
        decisions = store.decide(claims)
        # part one, part two (refused), then one rollback script: no part three
        assert scripts_run(server) - before == 3
        assert decisions[1_700].verdict.failed
        held = {each.job_id for each in store.scan()}
    finally:
        store.close()
    assert held == {"job--1"}


def test_continue_on_conflict_decides_every_part(server: RedisServer) -> None:
    """Without all-or-nothing, a conflict in part two leaves the other 2,499 created."""
    store = RedisStore.from_url(server.url())
    window = "unique:v1:t\x1fw\x1ftasks.big\x1frequest-7"
    try:
        store.decide([claim(-1, window=window, fp="first")])
        claims = [claim(n) for n in range(2_500)]
        claims[1_700] = claim(1_700, window=window, fp="other")
        decisions = store.decide(claims, all_or_nothing=False)
        held = {each.job_id for each in store.scan()}
    finally:
        store.close()
    assert decisions[1_700].verdict.failed
    assert sum(d.verdict is Verdict.CREATED for d in decisions) == 2_499
    assert len(held) == 2_500  # the 2,499 and the window's first job


def test_a_batch_failing_in_a_later_part_may_have_been_applied_and_is_undone_whole(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part two's script fails on a key that is not the store's (another client's list):
    part one was written, so the error says the batch may have been applied, and every
    claim of the batch is undone (once here: the undo's repeats would outlive the server)."""
    monkeypatch.setattr(cleanup, "UNDO_REPEATS_S", ())
    store = RedisStore.from_url(server.url())
    client = redis.Redis.from_url(server.url())
    try:
        claims = [claim(n) for n in range(MAX_CLAIMS_PER_SCRIPT + 1)]
        client.rpush(claims[-1].active.key, "not a hold")  # type: ignore[union-attr]
        with pytest.raises(BackendUnavailable) as failed:
            store.decide(claims)
        assert failed.value.maybe_applied is True
        client.delete(claims[-1].active.key)  # type: ignore[union-attr]
        assert cleanup.flush(10), "the undo of the batch never landed"
        assert list(store.scan()) == []
    finally:
        cleanup.discard(store)
        store.close()
        client.close()


def test_an_interrupt_between_parts_rolls_back_what_the_parts_before_it_created(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A soft time limit (here a KeyboardInterrupt) strikes as part two is sent: what
    part one created is rolled back before the interrupt goes on."""
    store = RedisStore.from_url(server.url())
    calls = 0
    real_call = store._call

    def interrupted(name: str, *args: object) -> object:
        nonlocal calls
        calls += 1
        if name == "decide" and calls == 2:
            raise KeyboardInterrupt
        return real_call(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "_call", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            store.decide([claim(n) for n in range(MAX_CLAIMS_PER_SCRIPT + 1)])
        assert calls >= 2
        assert list(store.scan()) == []
    finally:
        store.close()
