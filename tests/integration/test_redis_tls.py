"""A store that is the broker's Redis inherits the broker's TLS, on a real TLS-only server.

With no ``unique_backend``, the store opens the broker's URL. kombu puts a
``redis://`` broker on TLS when ``broker_use_ssl`` is set; the store must do
the same, or it sends its password in plain text (and a TLS-only server, as
here, refuses it).
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_unique import Disposition, UniqueTask
from celery_unique import config as unique_config
from celery_unique.exceptions import ImproperlyConfigured
from tests.processes import RedisServer, free_port, require_redis_server

PASSWORD = "tls-only-secret"


def _certificates(directory: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1, made with openssl."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=celery-unique-test-ca",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    )
    (directory / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    )
    return {name: directory / f"{name}.crt" for name in ("ca", "server")} | {
        "key": directory / "server.key"
    }


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[RedisServer, dict[str, Path]]]:
    """A redis-server that speaks only TLS, with a password."""
    require_redis_server()
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test's certificates")
    files = _certificates(tmp_path)
    port = free_port()
    server = RedisServer(
        port,
        tmp_path,
        [
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(files["server"]),
            "--tls-key-file",
            str(files["key"]),
            "--tls-ca-cert-file",
            str(files["ca"]),
            "--tls-auth-clients",
            "no",
            "--requirepass",
            PASSWORD,
        ],
    )
    server.start()
    try:
        yield server, files
    finally:
        server.stop()


def test_a_store_on_the_brokers_redis_speaks_tls_when_the_broker_does(
    tls_server: tuple[RedisServer, dict[str, Path]],
) -> None:
    """broker_use_ssl with the CA: the store (no unique_backend) connects over TLS with
    the broker's certificates, so dispatches decide on the TLS-only server."""
    server, files = tls_server
    app = Celery("tls", set_as_current=False)
    app.conf.update(
        broker_url=f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0",
        broker_use_ssl={"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(files["ca"])},
        unique_namespace=f"tls-{uuid.uuid4().hex[:8]}",
        unique_colocated=False,
        task_ignore_result=True,
    )

    @app.task(base=UniqueTask, shared=False, unique_key="nightly")
    def report() -> None: ...

    try:
        url = unique_config.runtime(app).backend_url
        assert url.startswith("rediss://")
        assert "ssl_cert_reqs=required" in url
        first, second = report.delay(), report.delay()
        assert (first.disposition, second.disposition) == (
            Disposition.CREATED,
            Disposition.REUSED,
        )
        assert second.id == first.id
    finally:
        unique_config.reset(app)
        app.close()


def test_broker_tls_options_the_store_cannot_take_are_refused() -> None:
    """An option the store's Redis client has no equivalent for is refused by name,
    rather than dropped (a store silently less strict than its broker)."""
    app = Celery("tls-bad", set_as_current=False)
    app.conf.update(
        broker_url="redis://127.0.0.1:1/0",
        broker_use_ssl={"ssl_cert_reqs": ssl.CERT_REQUIRED, "ciphers": "HIGH"},
    )
    with pytest.raises(ImproperlyConfigured, match="'ciphers'"):
        unique_config.configured_backend_url(app)


def test_a_rediss_sentinel_store_speaks_tls_to_the_sentinels_and_the_master(
    tls_server: tuple[RedisServer, dict[str, Path]], tmp_path: Path
) -> None:
    """``rediss+sentinel://``: the sentinel (TLS-only, with a password of its own) and the
    master (TLS-only) are both reached over TLS with the URL's CA, so neither password
    crosses in plain text; a plain connection to either would be refused."""
    master, files = tls_server
    port = free_port()
    config = tmp_path / "sentinel.conf"
    config.write_text(
        "\n".join(
            [
                "port 0",
                f"tls-port {port}",
                f"tls-cert-file {files['server']}",
                f"tls-key-file {files['key']}",
                f"tls-ca-cert-file {files['ca']}",
                "tls-auth-clients no",
                "tls-replication yes",
                "requirepass sentinel-secret",
                f"sentinel monitor main 127.0.0.1 {master.port} 1",
                f"sentinel auth-pass main {PASSWORD}",
                "",
            ]
        )
    )
    sentinel = subprocess.Popen(
        ["redis-server", str(config), "--sentinel"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        url = (
            f"rediss+sentinel://:{PASSWORD}@127.0.0.1:{port}/main"
            f"?sentinel_password=sentinel-secret&ssl_cert_reqs=required&ssl_ca_certs={files['ca']}"
        )
        app = Celery("tls-sentinel", broker="memory://", set_as_current=False)
        app.conf.update(
            unique_backend=url,
            unique_namespace=f"tls-{uuid.uuid4().hex[:8]}",
            task_ignore_result=True,
        )

        @app.task(base=UniqueTask, shared=False, unique_key="nightly")
        def report() -> None: ...

        try:
            first, second = eventually_dispatched(report)
            assert (first.disposition, second.disposition) == (
                Disposition.CREATED,
                Disposition.REUSED,
            )
        finally:
            unique_config.reset(app)
            app.close()
    finally:
        sentinel.kill()
        sentinel.wait(timeout=10)


def eventually_dispatched(task: Any) -> tuple[Any, Any]:
    """Two dispatches, once the sentinel (just started) names its master."""
    from celery_unique.exceptions import BackendUnavailable
    from tests.polling import eventually

    def first() -> Any:
        try:
            return task.delay()
        except BackendUnavailable:
            return None

    return eventually(first, timeout=20, what="the sentinel to name its master"), task.delay()
