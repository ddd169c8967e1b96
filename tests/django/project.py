"""Django configured from the example project's settings, for the tests and their children.

``configure()`` is called once per process: by ``conftest.py`` when pytest
collects this folder, and by every child process a race test spawns (with the
test databases the parent created).
"""

from __future__ import annotations

import importlib
import socket
from typing import Any

SETTINGS_MODULE = "tests.django.example.settings"

#: Database alias -> the service that serves it (see tests/conftest.py).
SERVICES = {"postgres": "postgres", "mariadb": "mariadb"}


def example_settings() -> dict[str, Any]:
    """Every setting of the example project, by name."""
    module = importlib.import_module(SETTINGS_MODULE)
    return {name: getattr(module, name) for name in dir(module) if name.isupper()}


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _driver(alias: str) -> bool:
    if alias != "mariadb":
        return True
    try:
        import MySQLdb  # noqa: F401
    except ImportError:
        try:
            import pymysql
        except ImportError:
            return False
        pymysql.install_as_MySQLdb()
    return True


def running_databases(databases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``databases`` without the server databases that are down or have no driver here."""
    return {
        alias: config
        for alias, config in databases.items()
        if alias not in SERVICES
        or (_driver(alias) and _reachable(config["HOST"], int(config["PORT"])))
    }


def configure(databases: dict[str, dict[str, Any]] | None = None) -> None:
    """Configure and set up Django: the example settings, these (or the running) databases."""
    import django
    from django.conf import settings

    values = example_settings()
    if databases is None:
        values["DATABASES"] = running_databases(values["DATABASES"])
    else:
        for alias in databases:
            _driver(alias)
        values["DATABASES"] = databases
    settings.configure(**values)
    django.setup()
