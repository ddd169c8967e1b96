"""In Django, stored arguments are signed with a key derived from ``SECRET_KEY`` unless
``CELERY_UNIQUE_SIGNING_KEY`` is set."""

from __future__ import annotations

from celery import Celery
from django.test import override_settings

from celery_unique.config import reset, runtime
from celery_unique.stores.signing import configured_secret


def signing_key(app: Celery) -> bytes:
    reset(app)
    return runtime(app).signing_key


def test_the_key_is_derived_from_secret_key(example_app: Celery) -> None:
    """Another SECRET_KEY, another key; the setting, when set, wins."""
    with override_settings(SECRET_KEY="first secret"):
        first = signing_key(example_app)
        assert configured_secret(example_app) == "first secret"
    with override_settings(SECRET_KEY="second secret"):
        assert signing_key(example_app) != first
    with override_settings(SECRET_KEY="first secret", CELERY_UNIQUE_SIGNING_KEY="own key"):
        assert configured_secret(example_app) == "own key"
        assert signing_key(example_app) != first
    reset(example_app)


def test_an_app_not_configured_from_the_settings_does_not_use_secret_key() -> None:
    """A Celery app of the same process that does not read the Django settings shares
    nothing with the project, its secret least of all."""
    other = Celery("other", broker="memory://", set_as_current=False)
    assert configured_secret(other) is None
