"""What the Django store does beyond the shared contract: its connection, sweeping, failures."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest
from django.db import connection, connections, transaction

from celery_unique.exceptions import BackendUnavailable
from celery_unique.stores.base import ActiveClaim, Claim, Scope, Verdict, WindowClaim
from celery_unique_django.models import UniqueKey
from celery_unique_django.store import DjangoStore
from tests.django.conftest import require_database

A = "unique:v1:{t}:a:t\x1fa"
B = "unique:v1:{t}:a:t\x1fb"
W = "unique:v1:{t}:w:t\x1fw"


def claim(job: str, key: str = A, lease: int | None = 60_000) -> Claim:
    return Claim(job_id=job, task="t", active=ActiveClaim(key, Scope.QUEUED, lease))


@pytest.fixture
def sqlite_store() -> Iterator[DjangoStore]:
    """The store on the SQLite database, sweeping only when asked to."""
    store = DjangoStore("default", sweep_every_s=math.inf)
    yield store
    store.close()


@pytest.fixture
def pg_store() -> Iterator[DjangoStore]:
    """The store on the PostgreSQL database."""
    require_database("postgres")
    store = DjangoStore("postgres")
    yield store
    store.close()


@pytest.mark.django_db(transaction=True)
def test_touched_expired_keys_and_vacant_placeholders_leave_no_row(
    sqlite_store: DjangoStore,
) -> None:
    """Vacant placeholders never stay; an expired row goes when a decision touches it."""
    sqlite_store.decide([claim("j1", lease=1), claim("j2", key=B)])
    time.sleep(0.01)
    assert UniqueKey.objects.filter(key=A).exists()  # expired, not yet touched
    assert sqlite_store.release("nobody", "unique:v1:{t}:a:t\x1fnever-held") is False
    sqlite_store.decide([Claim("j0", "t", window=WindowClaim(W, 60_000, "fp", "p"))])
    conflict = Claim("j3", "t", window=WindowClaim(W, 60_000, "other", "p"))
    assert sqlite_store.decide([claim("j4"), conflict])[1].verdict is Verdict.CONFLICT
    assert sorted(UniqueKey.objects.values_list("key", flat=True)) == sorted([B, W])


@pytest.mark.django_db(transaction=True)
def test_sweep_deletes_expired_rows(sqlite_store: DjangoStore) -> None:
    """Expired rows are counted by stats and deleted by the sweep; live rows stay."""
    sqlite_store.decide([claim("j1", lease=1), claim("j2", key=B, lease=None)])
    time.sleep(0.01)
    assert sqlite_store.stats().extra["expired rows awaiting sweep"] == 1
    assert sqlite_store.sweep() == 1
    assert list(UniqueKey.objects.values_list("job_id", flat=True)) == ["j2"]


@pytest.mark.django_db(transaction=True)
def test_a_missing_table_is_backend_unavailable_with_the_fix(sqlite_store: DjangoStore) -> None:
    """Without the table (migrations not run) the store is unavailable and says to migrate."""
    with connection.schema_editor() as editor:
        editor.delete_model(UniqueKey)
    try:
        with pytest.raises(BackendUnavailable, match=r"manage\.py migrate celery_unique"):
            sqlite_store.decide([claim("j1")])
    finally:
        with connection.schema_editor() as editor:
            editor.create_model(UniqueKey)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True, databases=["postgres"])
def test_decisions_commit_on_their_own_connection(pg_store: DjangoStore) -> None:
    """Inside the caller's transaction a decision commits at once, and survives its rollback."""
    other = DjangoStore("postgres")
    seen: list[str | None] = []

    def dispatch_then_fail() -> None:
        with transaction.atomic(using="postgres"):
            pg_store.decide([claim("j1")])
            held = other.get(A)  # another connection, before the caller's transaction ends
            seen.append(held.job_id if held else None)
            raise RuntimeError("the caller's transaction rolls back")

    try:
        with pytest.raises(RuntimeError):
            dispatch_then_fail()
        assert seen == ["j1"]
        assert pg_store.decide([claim("j2")])[0].job_id == "j1"
    finally:
        other.close()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True, databases=["postgres"])
def test_a_connection_the_server_dropped_is_reopened(pg_store: DjangoStore) -> None:
    """After the server ends the store's session, the next operation reconnects and succeeds."""
    pg_store.ping()
    with connections[pg_store._db()].cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    assert pg_store.decide([claim("j1")])[0].verdict is Verdict.CREATED


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True, databases=["postgres"])
def test_a_decision_whose_commit_reply_is_lost_is_undone_not_retried(
    pg_store: DjangoStore,
) -> None:
    """COMMIT ran on the server, its reply never came: backend_unavailable, then undone.

    Trying the decision again on a new connection would find the key held by
    its own job id and call that never-published job a duplicate of itself.
    """
    from celery_unique.stores import cleanup
    from tests.faultproxy import FaultProxy
    from tests.polling import eventually

    settings = connections["postgres"].settings_dict
    with FaultProxy(settings["HOST"] or "127.0.0.1", int(settings["PORT"] or 5432)) as proxy:
        connections.settings["pgproxy"] = {
            **settings,
            "HOST": "127.0.0.1",
            "PORT": str(proxy.port),
        }
        store = DjangoStore("pgproxy")
        try:
            store.ping()
            wrapper = connections[store._db()]
            commit = wrapper._commit
            armed = [True]

            def commit_losing_its_reply() -> None:
                if armed[0]:
                    armed[0] = False
                    proxy.reset_on_reply(1)
                commit()

            wrapper._commit = commit_losing_its_reply  # type: ignore[method-assign]
            with pytest.raises(BackendUnavailable) as lost:
                store.decide([claim("j1")])
            assert lost.value.maybe_applied
            eventually(lambda: pg_store.get(A) is None, 10, "the lost decision to be undone")
            assert pg_store.decide([claim("j2")])[0].verdict is Verdict.CREATED
        finally:
            cleanup.discard(store)  # the undo's later repeats: the proxy goes away
            store.close()
            del connections.settings["pgproxy"]
