"""Where keys are held (memory, SQLite, Redis), and what crosses that boundary signed or masked.

A store is chosen by its URL's scheme: one alias map, so a new store is one
file and one line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery_unique.stores.base import Store

#: scheme -> "module:factory"; each factory takes the full URL.
STORES: dict[str, str] = {
    "redis": "celery_unique.stores.redis:RedisStore.from_url",
    "rediss": "celery_unique.stores.redis:RedisStore.from_url",
    "unix": "celery_unique.stores.redis:RedisStore.from_url",
    "redis+cluster": "celery_unique.stores.redis:RedisStore.from_url",
    "rediss+cluster": "celery_unique.stores.redis:RedisStore.from_url",
    "redis+sentinel": "celery_unique.stores.redis:RedisStore.from_url",
    "rediss+sentinel": "celery_unique.stores.redis:RedisStore.from_url",
    "sqlite": "celery_unique.stores.sqlite:SQLiteStore.from_url",
    "memory": "celery_unique.stores.memory:MemoryStore.from_url",
    "django": "celery_unique_django.store:DjangoStore.from_url",
}


def scheme_of(url: str) -> str:
    """The scheme of a store or broker URL, lower-cased; ``""`` without one."""
    return url.split("://", 1)[0].lower() if "://" in url else ""


def open_store(url: str) -> Store:
    """Build the store a ``unique_backend`` URL names; ``improperly_configured``, with any
    password masked, for a URL that cannot be used exactly as written.

    Nothing connects here (but a cluster client, which asks its nodes for the
    slot map): a URL is refused before anything is written or published.
    """
    from celery_unique.exceptions import ImproperlyConfigured, UniquenessError
    from celery_unique.stores.masking import masked, redacted

    target = STORES.get(scheme_of(url))
    if target is None:
        known = ", ".join(f"{name}://" for name in STORES)
        raise ImproperlyConfigured(
            f"unique_backend {masked(url)!r} has no known scheme; use one of: {known}"
        )
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    factory = module
    for part in attribute.split("."):
        factory = getattr(factory, part)
    try:
        store: Store = factory(url)  # type: ignore[operator]
    except UniquenessError:
        raise
    except (ValueError, TypeError) as exc:
        # What a URL parser says of a port, a host or an option it cannot read.
        said = redacted(str(exc), url)
        error = ImproperlyConfigured(
            f"unique_backend {masked(url)!r} cannot be used as written: {said}"
        )
        # Chained only when the parser's own words hold no password.
        raise error from (exc if said == str(exc) else None)
    return store
