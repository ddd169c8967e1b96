"""The shop's tasks, made unique with ``base=UniqueTask``."""

from datetime import timedelta

from celery import shared_task

from celery_unique import UniqueTask


@shared_task(
    base=UniqueTask, unique_key=lambda job: f"customer:{job.customer}", unique_while="active"
)
def recalculate_totals(customer):
    """One recalculation per customer at a time."""
    return len(customer)


@shared_task(
    base=UniqueTask, unique_window_key=lambda job: job.request_id, unique_window=timedelta(hours=1)
)
def charge(order_id, cents, request_id):
    """A charge request replayed within the hour is the same charge."""
    return f"charged {cents} for order {order_id}"
