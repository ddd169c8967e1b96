"""The example shop's Django project; importing it loads the Celery app, as Celery's
Django guide has it."""

from proj.celery import app as celery_app

__all__ = ["celery_app"]
