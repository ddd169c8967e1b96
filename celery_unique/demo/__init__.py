"""A guided tour of celery-unique that needs no services: ``python -m celery_unique.demo``.

Everything runs in this process on the embedded defaults: the SQLite store in
a temporary file, kombu's in-memory broker and one worker in a thread (solo
pool, so it runs one job at a time). The tour dispatches real tasks and prints
what each dispatch returned and what the store held just before it, scene by
scene (:mod:`celery_unique.demo.scenes`): active keys in each scope, a key
derived from the payload, a window key, invalid keys.

:func:`main` returns a :class:`Report` with every dispatch as data. The demo
also checks each outcome against the documented behaviour (:func:`check`) and
exits with status 1, naming the scene, if the library did something else.

This package is not imported by ``celery_unique`` itself.
"""

from celery_unique.demo.expected import check
from celery_unique.demo.report import Report, Row
from celery_unique.demo.tour import main

__all__ = ["Report", "Row", "check", "main"]
