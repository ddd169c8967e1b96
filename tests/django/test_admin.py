"""The admin: held keys of any store, the Django store's table, and the release permission."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from django.contrib.auth.models import Permission
from django.test import Client, override_settings

from celery_unique import Disposition
from celery_unique.config import reset, runtime
from celery_unique.keys.keyspace import ACTIVE, storage_key
from celery_unique.operations import arguments_digest
from celery_unique.options.duplicates import encode_arguments
from celery_unique.stores.base import (
    ActiveClaim,
    Claim,
    OnDuplicate,
    RunBegun,
    RunStart,
    Scope,
    Store,
)
from celery_unique.testing import held_keys
from celery_unique_django.models import UniqueKey
from tests.django.example.shop.tasks import charge, recalculate_totals

pytestmark = pytest.mark.django_db(transaction=True)

HELD_KEYS = "/admin/celery_unique/storekey/"
DATABASE_KEYS = "/admin/celery_unique/uniquekey/"
TASK = recalculate_totals.name

Login = Callable[..., Client]


@pytest.fixture
def login(django_user_model: Any) -> Login:
    """A client logged in as a staff user with exactly the given permissions."""

    def login(*codenames: str) -> Client:
        user = django_user_model.objects.create_user(
            f"staff-{'-'.join(codenames) or 'none'}", password="pw", is_staff=True
        )
        user.user_permissions.set(
            Permission.objects.filter(
                content_type__app_label="celery_unique", codename__in=codenames
            )
        )
        client = Client()
        client.force_login(user)
        return client

    return login


@pytest.fixture
def keys(example_app: Celery) -> dict[str, str]:
    """Two active keys and a window key held in the example's Django store: name -> job id."""
    return {
        "ada": recalculate_totals.delay("ada").id,
        "bob": recalculate_totals.delay("bob").id,
        "charge": charge.delay(order_id=1, amount_cents=5).id,
    }


@pytest.fixture
def unique_app(example_app: Celery) -> Celery:
    """The app of celery-unique's ``unique_store`` fixture (a memory store, here to show
    a store other than the database)."""
    return example_app


def held_jobs(app: Celery) -> set[str]:
    return {held.job_id for held in runtime(app).store.scan()}


def token(key: str, job_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([key, job_id]).encode()).decode()


# -- Database keys (the Django store's table) --------------------------------------


def test_database_changelist_lists_keys_with_job_kind_and_expiry(
    admin_client: Client, keys: dict[str, str]
) -> None:
    """Each row shows the key as users read it, its kind, job id, task and expiry."""
    page = admin_client.get(DATABASE_KEYS).content.decode()
    assert f"{TASK}:customer:ada" in page
    assert keys["ada"] in page
    assert keys["charge"] in page
    assert "window" in page
    assert "in 29m" in page  # the 30-minute lease, counted on the database's clock


def test_database_changelist_search_and_filters(admin_client: Client, keys: dict[str, str]) -> None:
    """Search finds a job id; filters narrow by kind and by expiry."""
    found = admin_client.get(DATABASE_KEYS, {"q": keys["bob"]}).content.decode()
    assert keys["bob"] in found
    assert keys["ada"] not in found
    windows = admin_client.get(DATABASE_KEYS, {"kind__exact": "window"}).content.decode()
    assert keys["charge"] in windows
    assert keys["ada"] not in windows
    within_the_hour = admin_client.get(DATABASE_KEYS, {"expires": "hour"}).content.decode()
    assert all(job in within_the_hour for job in keys.values())
    within_a_minute = admin_client.get(DATABASE_KEYS, {"expires": "minute"}).content.decode()
    assert not any(job in within_a_minute for job in keys.values())


def test_database_release_action_frees_the_key(
    login: Login, keys: dict[str, str], example_app: Celery
) -> None:
    """With the release permission the action frees the key: the next dispatch creates a job."""
    client = login("view_uniquekey", "release_key")
    row = UniqueKey.objects.get(job_id=keys["ada"])
    response = client.post(
        DATABASE_KEYS, {"action": "release_keys", "_selected_action": [row.pk]}, follow=True
    )
    assert "Released 1 key." in response.content.decode()
    assert keys["ada"] not in held_jobs(example_app)
    assert recalculate_totals.delay("ada").disposition is Disposition.CREATED


def test_database_release_action_never_drops_the_released_job(
    login: Login, keys: dict[str, str], example_app: Celery
) -> None:
    """The job whose key the action released still runs when delivered, beside the job
    the next dispatch created; the store's note of the release is not listed."""
    client = login("view_uniquekey", "release_key")
    row = UniqueKey.objects.get(job_id=keys["ada"])
    client.post(DATABASE_KEYS, {"action": "release_keys", "_selected_action": [row.pk]})
    assert recalculate_totals.delay("ada").disposition is Disposition.CREATED
    assert keys["ada"] not in client.get(DATABASE_KEYS).content.decode()
    start = RunStart("run-1", Scope(row.scope), TASK, None)
    assert runtime(example_app).store.begin_run(keys["ada"], row.key, start) == RunBegun()


def test_database_release_needs_the_permission(
    login: Login, keys: dict[str, str], example_app: Celery
) -> None:
    """Without the release permission the action is not offered and does nothing."""
    client = login("view_uniquekey")
    page = client.get(DATABASE_KEYS).content.decode()
    assert "release_keys" not in page
    row = UniqueKey.objects.get(job_id=keys["ada"])
    client.post(DATABASE_KEYS, {"action": "release_keys", "_selected_action": [row.pk]})
    assert keys["ada"] in held_jobs(example_app)


def test_database_keys_are_read_only(admin_client: Client, keys: dict[str, str]) -> None:
    """No add, change or delete: keys change only through dispatches and releases."""
    row = UniqueKey.objects.get(job_id=keys["ada"])
    assert admin_client.get(f"{DATABASE_KEYS}add/").status_code == 403
    assert admin_client.get(f"{DATABASE_KEYS}{row.pk}/delete/").status_code == 403
    detail = admin_client.get(f"{DATABASE_KEYS}{row.pk}/change/").content.decode()
    assert "Save" not in detail


# -- Held keys (any store, through the store contract) -------------------------------


def test_held_keys_changelist_reads_the_django_store(
    admin_client: Client, keys: dict[str, str]
) -> None:
    """The store-contract view lists the same keys when the store is the database."""
    page = admin_client.get(HELD_KEYS).content.decode()
    assert all(job in page for job in keys.values())
    assert "django://" in page


def test_held_keys_changelist_reads_any_store(
    admin_client: Client, unique_store: Store, example_app: Celery
) -> None:
    """On the memory store (no table at all) the same view lists, searches and filters keys."""
    ada = recalculate_totals.delay("ada").id
    order = charge.delay(order_id=2, amount_cents=5).id
    assert not UniqueKey.objects.exists()
    page = admin_client.get(HELD_KEYS).content.decode()
    assert ada in page
    assert order in page
    assert "memory://" in page
    searched = admin_client.get(HELD_KEYS, {"q": "customer:ada"}).content.decode()
    assert (ada in searched, order in searched) == (True, False)
    windows = admin_client.get(HELD_KEYS, {"kind": "window"}).content.decode()
    assert (ada in windows, order in windows) == (False, True)
    by_task = admin_client.get(HELD_KEYS, {"task": charge.name}).content.decode()
    assert (ada in by_task, order in by_task) == (False, True)


def test_held_keys_release(login: Login, unique_store: Store, example_app: Celery) -> None:
    """The release action frees the selected key of a non-Django store."""
    client = login("view_storekey", "release_key")
    job = recalculate_totals.delay("ada").id
    assert held_keys() == ["tests.django.example.shop.tasks.recalculate_totals:customer:ada"]
    (held,) = held_keys()
    response = client.post(
        HELD_KEYS, {"action": "release", "selected": [token(held.storage_key, job)]}, follow=True
    )
    assert "Released 1 key." in response.content.decode()
    assert held_jobs(example_app) == set()


def test_held_keys_release_leaves_a_key_another_job_took(
    login: Login, unique_store: Store, example_app: Celery
) -> None:
    """A selection made for a job that no longer holds the key releases nothing."""
    client = login("view_storekey", "release_key")
    job = recalculate_totals.delay("ada").id
    (held,) = held_keys()
    response = client.post(
        HELD_KEYS,
        {"action": "release", "selected": [token(held.storage_key, "another-job")]},
        follow=True,
    )
    assert "Released 0 keys." in response.content.decode()
    assert held_jobs(example_app) == {job}


def test_held_keys_release_is_denied_without_the_permission(
    login: Login, keys: dict[str, str], example_app: Celery
) -> None:
    """Viewing is not releasing: the action is not shown and a forged POST gets 403."""
    client = login("view_storekey")
    assert 'value="release"' not in client.get(HELD_KEYS).content.decode()
    (held,) = [h for h in runtime(example_app).store.scan() if h.job_id == keys["ada"]]
    response = client.post(
        HELD_KEYS, {"action": "release", "selected": [token(held.key, keys["ada"])]}
    )
    assert response.status_code == 403
    assert keys["ada"] in held_jobs(example_app)


def test_changelists_need_the_view_permission(login: Login) -> None:
    """A staff user without view permission sees neither list."""
    client = login()
    assert client.get(HELD_KEYS).status_code == 403
    assert client.get(DATABASE_KEYS).status_code == 403


def test_stored_arguments_are_shown_as_a_digest_only(
    login: Login, example_app: Celery, keys: dict[str, str]
) -> None:
    """Staff who may only view keys see a digest of a duplicate's stored arguments (as the
    CLI does), never the arguments or their encoding."""
    rt = runtime(example_app)
    key = storage_key(rt.namespace, ACTIVE, TASK, "card")
    arguments = encode_arguments(
        recalculate_totals,
        ["4111 1111 1111 1111"],
        {},
        1 << 16,
        storage_key=key,
        signing_key=rt.signing_key,
    )
    active = ActiveClaim(key, Scope.ACTIVE, 60_000, OnDuplicate.LATEST, arguments)
    rt.store.decide([Claim("card-job", TASK, active)])
    rt.store.decide([Claim("duplicate", TASK, active)])  # its arguments are kept
    row = UniqueKey.objects.get(job_id="card-job")
    assert row.arguments == arguments

    page = login("view_uniquekey").get(f"{DATABASE_KEYS}{row.pk}/change/")
    assert page.status_code == 200
    shown = page.content.decode()
    assert arguments.rsplit("|", 1)[1] not in shown  # the base64 of the arguments
    assert "4111" not in shown
    assert arguments_digest(arguments) in shown


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://:master-pw@127.0.0.1:1,127.0.0.1:2/mymaster?sentinel_password=sentinel-pw",
        "redis://:master-pw@127.0.0.1:1/0?password=sentinel-pw",
        "reddis://:master-pw@127.0.0.1:1/0",
    ],
    ids=["multi-host-sentinel", "password-in-query", "mistyped-scheme"],
)
def test_the_held_keys_page_shows_the_store_url_without_its_passwords(
    admin_client: Client, example_app: Celery, url: str
) -> None:
    """Whatever the store URL's shape (several sentinel hosts, a password in the query
    string, a mistyped scheme), the page answers (no server error) and shows it masked,
    in the store line and in the error saying the store cannot be read."""
    with override_settings(CELERY_UNIQUE_BACKEND=url, DEBUG=True):
        reset(example_app)
        try:
            response = admin_client.get(HELD_KEYS)
        finally:
            reset(example_app)
    assert response.status_code == 200
    page = response.content.decode()
    assert "***" in page
    assert "master-pw" not in page
    assert "sentinel-pw" not in page


def test_both_release_actions_keep_a_latest_key_whose_duplicates_left_it_arguments(
    login: Login, example_app: Celery
) -> None:
    """A latest job runs with its duplicate's arguments: each release action
    keeps its key, says so, and releases the others selected."""
    rt = runtime(example_app)
    key = storage_key(rt.namespace, ACTIVE, TASK, "latest")
    active = ActiveClaim(key, Scope.ACTIVE, 60_000, OnDuplicate.LATEST, "a|1")
    rt.store.decide([Claim("latest-job", TASK, active)])
    rt.store.decide([Claim("duplicate", TASK, active)])
    plain = recalculate_totals.delay("ada").id
    client = login("view_uniquekey", "view_storekey", "release_key")

    rows = [UniqueKey.objects.get(job_id=job).pk for job in ("latest-job", plain)]
    page = client.post(
        DATABASE_KEYS, {"action": "release_keys", "_selected_action": rows}, follow=True
    ).content.decode()
    assert "Released 1 key." in page
    assert "1 kept: a latest/debounce job holds what its duplicates left it" in page
    assert held_jobs(example_app) == {"latest-job"}

    page = client.post(
        HELD_KEYS, {"action": "release", "selected": [token(key, "latest-job")]}, follow=True
    ).content.decode()
    assert "Released 0 keys." in page
    assert "1 kept: a latest/debounce job holds what its duplicates left it" in page
    assert held_jobs(example_app) == {"latest-job"}
