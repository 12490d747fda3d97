"""Fixtures: an emulated API server (tests/operators/operator_testlib.py) and the real kopf operator on it."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import kmock
import kopf
import pytest

from kubetrt.operators import crds, handlers
from kubetrt.operators.kube import KubeClient


from operator_testlib import CONFIG, ApiServerEmulator, md_body


@pytest.fixture
def md() -> dict[str, Any]:
    return md_body()


@pytest.fixture
async def api() -> AsyncIterator[ApiServerEmulator]:
    """The emulated API server with built-in resources and the kubetrt/kopf CRDs declared."""
    async with ApiServerEmulator() as handler, kmock.Server(handler):
        handler.resources.load_bundled()
        for crd in crds.all_crds():
            names = crd["spec"]["names"]
            version = crd["spec"]["versions"][0]["name"]
            handler.resources[f"{crd['spec']['group']}/{version}/{names['plural']}"] = kmock.ResourceInfo(
                kind=names["kind"], singular=names["singular"], namespaced=crd["spec"]["scope"] == "Namespaced",
                shortnames=set(names.get("shortNames", [])), subresources={"status"},
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"})
        yield handler


@pytest.fixture
def kube(api: ApiServerEmulator) -> KubeClient:
    return KubeClient.for_host(str(api.url).rstrip("/"))


@pytest.fixture
async def operator(api: ApiServerEmulator, kube: KubeClient) -> AsyncIterator[kopf.Memo]:
    """The real kopf operator with kubetrt's handlers against ``api``.

    It runs in its own thread and event loop, as in production (kopf cancels foreign tasks of the
    loop it exits from); the emulated API server keeps serving in the test's loop.
    """
    registry = kopf.OperatorRegistry()
    handlers.register(registry)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=str(api.url).rstrip("/"))

    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    settings.watching.reconnect_backoff = 0.1
    memo = kopf.Memo(kube=kube, config=CONFIG)
    stop, ready = threading.Event(), threading.Event()
    logging.getLogger("kopf").setLevel(logging.WARNING)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(kopf.operator(registry=registry, settings=settings, memo=memo, clusterwide=True,
                                      standalone=True, stop_flag=stop, ready_flag=ready))
        except BaseException as exc:  # surfaced in the fixture's teardown
            errors.append(exc)

    thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 15), f"operator did not start: {errors}"
    yield memo
    stop.set()
    await asyncio.to_thread(thread.join, 20)
    assert not thread.is_alive(), "operator did not stop"
    assert not errors, errors
