"""celery-unique for Django: settings, the ``django://`` store, admin, commands, checks.

Add ``"celery_unique_django"`` to ``INSTALLED_APPS`` and run ``manage.py migrate``.
See ``docs/django.md``.
"""
