"""Where the checks found :mod:`celery_unique.masking` first; kept for those who import it here."""

from celery_unique.masking import MASK, masked, redacted

__all__ = ["MASK", "masked", "redacted"]
