"""``python -m celery_unique.demo``: the tour; exit status 1 if an outcome is not as documented."""

import sys

from celery_unique.demo.tour import main

if __name__ == "__main__":
    sys.exit(0 if main().ok else 1)
