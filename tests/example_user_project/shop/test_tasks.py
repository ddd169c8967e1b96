"""The shop's tasks tested with uniqueness on: no Redis, no worker process needed."""

from celery.contrib.testing.worker import start_worker

from celery_unique.testing import held_keys, wait_released
from shop.tasks import charge, recalculate_totals


def test_a_second_click_gets_the_waiting_job(unique_store, client):
    first = client.post("/recalculate/ada/").json()
    again = client.post("/recalculate/ada/").json()
    assert again == {"job": first["job"], "duplicate": True}
    assert held_keys() == ["shop.tasks.recalculate_totals:customer:ada"]


def test_a_job_run_eagerly_frees_its_key(unique_eager):
    first = recalculate_totals.delay("ada")
    assert first.get() == 3
    assert held_keys() == []
    assert recalculate_totals.delay("ada").id != first.id


def test_a_replayed_charge_is_the_first_charge(unique_eager):
    first = charge.delay(order_id=7, cents=250, request_id="R-1")
    replay = charge.delay(order_id=7, cents=250, request_id="R-1")
    assert replay.duplicate
    assert replay.id == first.id
    assert replay.get(timeout=5) == "charged 250 for order 7"
    assert held_keys() == ["shop.tasks.charge:R-1"]


def test_a_worker_frees_the_key_when_the_job_ends(unique_store):
    with start_worker(recalculate_totals.app, perform_ping_check=False):
        job = recalculate_totals.delay("bob")
        assert job.get(timeout=10) == 3
        wait_released(job)
    assert held_keys() == []
