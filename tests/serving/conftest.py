"""Serving fixtures: real uvicorn servers on ephemeral loopback ports over real model packages."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from kubetrt.runtime import load_model
from kubetrt.serving.app import create_app
from kubetrt.serving.registry import ServingConfig
from serving_support import MAX_BODY, LiveServer


@pytest.fixture(scope="session")
def cnn_package(model_zoo) -> Path:
    return model_zoo.package("small_cnn")


@pytest.fixture(scope="session")
def two_package(model_zoo) -> Path:
    return model_zoo.package("two_in_two_out")


@pytest.fixture(scope="session")
def cnn_model(cnn_package):
    return load_model(cnn_package, "host")


@pytest.fixture(scope="session")
def two_model(two_package):
    return load_model(two_package, "host")


@pytest.fixture(scope="session")
def server(cnn_package, two_package) -> Iterator[LiveServer]:
    """The CLI's configuration over real packages: loads, golden-checks, batches."""
    config = ServingConfig(device="host", max_body_bytes=MAX_BODY)
    with LiveServer(create_app([cnn_package, two_package], config)) as s:
        yield s.wait_ready()


@pytest.fixture
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


