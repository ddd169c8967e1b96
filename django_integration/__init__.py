"""celery-unique for Django: settings, the ``django://`` store, admin, commands, checks.

Add ``"django_integration"`` to ``INSTALLED_APPS`` and run ``manage.py migrate``.
See ``docs/django.md``.
"""
