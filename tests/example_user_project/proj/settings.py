"""Settings of the example shop: Redis as broker, result backend and uniqueness store."""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "example-shop-only-not-a-secret"
DEBUG = False
ALLOWED_HOSTS = ["localhost", "testserver"]
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "shop"]
ROOT_URLCONF = "proj.urls"
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "db.sqlite3"}}

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379/0")
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_UNIQUE_BACKEND = REDIS_URL
# Running tasks in-process while developing also writes their keys into the
# store above (window keys stay for their window); tests take a store of
# their own from celery-unique's fixtures either way.
CELERY_TASK_ALWAYS_EAGER = os.environ.get("CELERY_EAGER") == "1"
