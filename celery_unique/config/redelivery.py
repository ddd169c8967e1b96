"""When a transport delivers a message again by itself: its ``visibility_timeout``.

The Redis and SQS transports deliver again a message that a worker has held
unacknowledged for longer than ``visibility_timeout``, whether it runs, waits
for its ETA in the worker, or is lost with its worker. AMQP brokers deliver
again only when the consumer's connection closes.
"""

from __future__ import annotations

from typing import Any

from celery_unique.stores import scheme_of

#: Transports that deliver an unacknowledged message again after ``visibility_timeout``.
VISIBILITY_TRANSPORTS = ("redis", "rediss", "sentinel", "sqs")
#: kombu's ``visibility_timeout`` when ``broker_transport_options`` does not set one.
DEFAULT_VISIBILITY_TIMEOUT_S = 3600.0


def visibility_timeout_s(app: Any) -> float | None:
    """Seconds after which the app's broker delivers an unacknowledged message again;
    ``None`` where time alone never does (AMQP, memory).

    Read as kombu reads it: a number, or a string of one (settings from the
    environment). A value kombu could not use either raises ``ValueError`` or
    ``TypeError``.
    """
    broker = app.conf.broker_url or ""
    if not isinstance(broker, str) or scheme_of(broker).split("+")[0] not in VISIBILITY_TRANSPORTS:
        return None
    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT_S))
