"""The demo's scenes, one module each, in the order the tour plays them.

1. :mod:`~celery_unique.demo.scenes.active_key_scopes`: a job and its
   duplicates in each scope (``queued``, ``active``, ``exists``);
2. :mod:`~celery_unique.demo.scenes.payload_key`: a key derived from some
   paths of the payload;
3. :mod:`~celery_unique.demo.scenes.window_key`: an idempotency window;
4. :mod:`~celery_unique.demo.scenes.invalid_keys`: keys refused before
   anything is written or published.
"""
