"""Settings of the example project: an ordinary Django project that uses celery-unique.

Everything celery-unique needs is here, read by the Celery app through
``app.config_from_object("django.conf:settings", namespace="CELERY")``
(``example/celery.py``). The tests configure Django from this module
(``tests/django/conftest.py``), keeping only the databases that are running.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent
HOST = "127.0.0.1"

SECRET_KEY = "example-project-only-not-a-secret"
DEBUG = False
ALLOWED_HOSTS = [HOST, "localhost", "testserver"]
USE_TZ = True
TIME_ZONE = "UTC"
# Deliberately not the app's own choice: its migrations must not depend on it.
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "celery_unique_django",
    "tests.django.example.shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.django.example.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "static/"

# One test database per test run, so that runs side by side do not collide.
_TEST_DB = f"test_celery_unique_django_{os.getpid()}"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": BASE_DIR / "example.sqlite3",
        "OPTIONS": {"timeout": 30},
        # A file, not memory: the race test's processes share it.
        "TEST": {"NAME": os.path.join(tempfile.gettempdir(), f"{_TEST_DB}.sqlite3")},
    },
    "postgres": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "test",
        "USER": "postgres",
        "HOST": HOST,
        "PORT": os.environ.get("TEST_POSTGRES_PORT", "5432"),
        "TEST": {"NAME": _TEST_DB, "DEPENDENCIES": []},
    },
    "mariadb": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": "test",
        "USER": "root",
        "HOST": HOST,
        "PORT": os.environ.get("TEST_MARIADB_PORT", "3306"),
        "OPTIONS": {"charset": "utf8mb4"},
        "TEST": {
            "NAME": _TEST_DB,
            "CHARSET": "utf8mb4",
            "COLLATION": "utf8mb4_bin",
            "DEPENDENCIES": [],
        },
    },
}

# -- Celery, read through the CELERY namespace --------------------------------
CELERY_BROKER_URL = "memory://localhost/"
CELERY_RESULT_BACKEND = "cache+memory://"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = False
# -- celery-unique --------------------------------------------------------------
CELERY_UNIQUE_BACKEND = "django://"  # keys in this project's default database
CELERY_UNIQUE_NAMESPACE = "example"
CELERY_UNIQUE_LEASE = timedelta(minutes=30)
CELERY_UNIQUE_FAIL_OPEN = False
# The app the admin, management commands and checks use (else celery.current_app).
CELERY_UNIQUE_APP = "tests.django.example.celery:app"
