"""Fixtures for pipeline tests: a moto S3 server on loopback, a clean env, a free closed port."""
from __future__ import annotations

import socket
from typing import Iterator

import pytest


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3 API (moto server mode) on 127.0.0.1 and an ephemeral port."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, moto_endpoint: str) -> str:
    """Dummy credentials and AWS_ENDPOINT_URL pointing at moto; returns the endpoint."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return moto_endpoint


@pytest.fixture
def bucket(aws_env: str, request: pytest.FixtureRequest) -> str:
    """A fresh bucket per test (named after it)."""
    from kubetrt.pipeline.sources import s3_client

    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50].strip("-")
    s3_client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
