"""Shared fixtures: the cached model zoo (see tests/model_zoo.py).

    def test_x(zoo):                      # function scope
        pkg = zoo.package("mlp")          # lowered model package directory (Path)
        sm = zoo.savedmodel("small_cnn")  # SavedModel directory (Path)

Session/module-scoped fixtures use `model_zoo` (same API). MobileNetV2 and ResNet50 are built
only when asked for, and only from tests marked @pytest.mark.slow (so `-m "not slow"` skips them).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_zoo import Zoo  # noqa: E402


@pytest.fixture(scope="session")
def model_zoo() -> Zoo:
    """The zoo without the slow-marker guard, for fixtures of wider scope."""
    return Zoo()


class MarkedZoo:
    """The zoo as seen from one test: refuses slow models unless the test is marked slow."""

    def __init__(self, zoo: Zoo, node: pytest.Item) -> None:
        self._zoo, self._node = zoo, node
        self.names = zoo.names
        self.root = zoo.root

    def _check(self, name: str) -> None:
        if self._zoo.spec(name).slow and self._node.get_closest_marker("slow") is None:
            raise pytest.UsageError(
                f"{self._node.nodeid}: zoo model {name!r} takes tens of seconds to build; "
                "mark the test @pytest.mark.slow"
            )

    def savedmodel(self, name: str) -> Path:
        self._check(name)
        return self._zoo.savedmodel(name)

    def package(self, name: str) -> Path:
        self._check(name)
        return self._zoo.package(name)


@pytest.fixture
def zoo(model_zoo: Zoo, request: pytest.FixtureRequest) -> MarkedZoo:
    return MarkedZoo(model_zoo, request.node)



@pytest.fixture(scope="session")
def published_cnn(model_zoo: Zoo, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """(store root, package URI, host engine key): the small CNN as the pipeline leaves it in a
    file:// engine store (package published, host engine built, verified and published)."""
    from kubetrt.pipeline.stages import build_verify_publish
    from kubetrt.pipeline.store import open_store

    root = tmp_path_factory.mktemp("store")
    store = open_store(root)
    package = model_zoo.package("small_cnn")
    digest = store.publish_package(package)
    key = build_verify_publish(package, "host", store, tmp_path_factory.mktemp("build")).key
    return root, "file://" + store.package_uri(digest), key
