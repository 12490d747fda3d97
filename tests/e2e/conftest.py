"""Fixtures for the process-level end-to-end tests.

The emulated API server (``api``), the operator's client (``kube``), the real kopf operator
(``operator``) and the test's own client (``client``) are the operator integration tests' own
fixtures, imported from tests/operators (not copied). ``restartable_operator`` is the same
operator as a handle that can be stopped and started again against the same API server.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import kopf
import pytest

HERE = Path(__file__).resolve().parent
OPERATOR_TESTS = HERE.parent / "operators"
for path in (HERE, OPERATOR_TESTS):  # kubelet, operator_testlib, test_operator_integration's helpers
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import file_modules  # noqa: E402
from kubetrt.operators import handlers  # noqa: E402
from kubetrt.operators.kube import KubeClient  # noqa: E402
from operator_testlib import CONFIG, ApiServerEmulator  # noqa: E402
from test_operator_integration import client  # noqa: E402,F401  (fixture)

import kubelet  # noqa: E402


_operator_fixtures = file_modules.load("kubetrt_tests_operators_conftest", OPERATOR_TESTS / "conftest.py")
api = _operator_fixtures.api
kube = _operator_fixtures.kube
operator = _operator_fixtures.operator


@pytest.fixture(scope="session", autouse=True)
def mount_namespaces() -> None:
    """The test kubelet runs containers in private mount namespaces; say clearly if it cannot."""
    problem = kubelet.mount_namespaces_work()
    if problem:
        pytest.fail(f"the test kubelet needs private mount namespaces (root, or unprivileged user namespaces): "
                    f"{problem}", pytrace=False)


@pytest.fixture(autouse=True)
def no_container_outlives_its_test() -> Iterator[None]:
    yield
    kubelet.stop_all()


class OperatorRunner:
    """The real kopf operator with kubetrt's handlers, like the ``operator`` fixture, but restartable.

    Each start() is a fresh operator process in all but the OS sense: a new registry, settings,
    memo, thread and event loop (kopf cancels foreign tasks of the loop it exits from); only the
    API server, and what kopf persisted in it, survive a restart.
    """

    def __init__(self, api: ApiServerEmulator, kube: KubeClient) -> None:
        self.api, self.kube = api, kube
        self.starts = 0
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self._errors: list[BaseException] = []

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> kopf.Memo:
        assert not self.running, "the operator is already running"
        registry = kopf.OperatorRegistry()
        handlers.register(registry)
        server = str(self.api.url).rstrip("/")

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=server)

        settings = kopf.OperatorSettings()
        settings.posting.enabled = False
        settings.watching.reconnect_backoff = 0.1
        memo = kopf.Memo(kube=self.kube, config=CONFIG)
        stop, ready = threading.Event(), threading.Event()
        logging.getLogger("kopf").setLevel(logging.WARNING)
        errors = self._errors

        def run() -> None:
            try:
                asyncio.run(kopf.operator(registry=registry, settings=settings, memo=memo, clusterwide=True,
                                          standalone=True, stop_flag=stop, ready_flag=ready))
            except BaseException as exc:  # surfaced by stop()
                errors.append(exc)

        self._stop = stop
        self._thread = threading.Thread(target=run, name=f"kopf-operator-{self.starts}", daemon=True)
        self._thread.start()
        self.starts += 1
        assert await asyncio.to_thread(ready.wait, 15), f"operator did not start: {errors}"
        return memo

    async def stop(self) -> None:
        if self._thread is None:
            return
        assert self._stop is not None
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 20)
        assert not self._thread.is_alive(), "operator did not stop"
        self._thread = None
        assert not self._errors, self._errors


@pytest.fixture
async def restartable_operator(api: ApiServerEmulator, kube: KubeClient) -> AsyncIterator[OperatorRunner]:
    runner = OperatorRunner(api, kube)
    await runner.start()
    yield runner
    await runner.stop()
