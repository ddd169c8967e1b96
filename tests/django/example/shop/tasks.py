"""Ordinary Celery tasks of the example shop, made unique with ``base=UniqueTask``."""

from __future__ import annotations

from datetime import timedelta

from celery_unique import Payload, UniqueTask
from celery_unique_django.task import UniqueDjangoTask
from tests.django.example.celery import app


@app.task(base=UniqueTask, unique_key=lambda job: f"customer:{job.customer}")
def recalculate_totals(customer: str) -> int:
    """One recalculation per customer waiting at a time."""
    from tests.django.example.shop.models import Order

    return sum(Order.objects.filter(customer=customer).values_list("total_cents", flat=True))


@app.task(
    base=UniqueTask,
    unique_window_key=Payload(only=[".order_id"]),
    unique_window=timedelta(hours=1),
)
def charge(order_id: int, amount_cents: int) -> str:
    """A retried charge request within the hour is the same job."""
    return f"charged {amount_cents} for order {order_id}"


@app.task(
    base=UniqueDjangoTask, unique_key=lambda job: f"order:{job.order_id}", unique_while="active"
)
def send_receipt(order_id: int) -> str:
    """Dispatched when the order's transaction commits, once per order at a time."""
    return f"receipt for order {order_id}"
