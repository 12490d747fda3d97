"""The servable source: package URI + store URI + engine key -> one local, digest-checked package."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kubetrt.pipeline.servable import ServableError, ServableSource, resolve_servable
from kubetrt.pipeline.store import S3Store, StoreError, model_digest, open_store
from kubetrt.runtime import load_model
from kubetrt.runtime.package import load_golden, open_package


@pytest.fixture
def published(published_cnn: tuple[Path, str, str]) -> tuple[Path, str, str]:
    return published_cnn


def copied_store(root: Path, tmp_path: Path, key: str) -> tuple[Path, str, Path]:
    """(a copy of the store to damage, its model digest, the engine's report.json in it)."""
    other = tmp_path / "store"
    shutil.copytree(root, other)
    digest = next(p.name for p in other.iterdir())
    return other, digest, other / digest / key / "report.json"


def test_package_and_engine_from_a_file_store_load_and_match_tensorflow(published, tmp_path: Path) -> None:
    root, package_uri, key = published
    servable = resolve_servable(ServableSource(package_uri, "file://" + str(root), key), tmp_path / "cache")
    assert servable.package_dir.is_relative_to(tmp_path / "cache")
    assert [e["key"] for e in servable.manifest.engines] == [key] and servable.engine["backend"] == "host"
    assert servable.engine["summary"].startswith("passed"), "the verification summary travels with the engine"
    open_package(servable.package_dir)  # the engine's files are listed with digests in the manifest
    model = load_model(servable.package_dir, "auto", engine_key=key)
    assert model.engine_key == key
    for ins, want in load_golden(servable.package_dir).values():
        got = model.predict(ins)
        for name, ref in want.items():
            np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=1e-4)


def test_a_second_start_reuses_the_cache_and_a_corrupt_cache_is_fetched_again(published, tmp_path: Path) -> None:
    root, package_uri, key = published
    source = ServableSource(package_uri, str(root), key)
    first = resolve_servable(source, tmp_path)
    onnx = first.package_dir / "model.onnx"
    stamp = onnx.stat().st_mtime_ns
    assert resolve_servable(source, tmp_path).package_dir == first.package_dir
    assert onnx.stat().st_mtime_ns == stamp, "a complete cached servable is reused, not copied again"
    onnx.write_bytes(onnx.read_bytes()[:-10])  # truncated by a crash or a bad disk
    again = resolve_servable(source, tmp_path)
    open_package(again.package_dir)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".staging")] == []


def test_a_key_the_store_lacks_is_named_with_what_it_has(published, tmp_path: Path) -> None:
    root, package_uri, key = published
    with pytest.raises(ServableError, match=r"no verified engine tensorrt_x for model .* it has \['" + key):
        resolve_servable(ServableSource(package_uri, str(root), "tensorrt_x"), tmp_path)
    assert not (tmp_path / "servables").exists() or not any((tmp_path / "servables").iterdir())


def test_an_engine_built_for_another_node_type_is_refused(published, tmp_path: Path) -> None:
    root, package_uri, key = published
    other, digest, report_path = copied_store(root, tmp_path, key)
    report = json.loads(report_path.read_text())
    report["target"]["backend_version"] = "numpy0.1-sparc"  # built elsewhere, published under its own key
    fake_key = key.replace("x86_64", "sparc")
    report_path.write_text(json.dumps(report))
    (other / digest / key).rename(other / digest / fake_key)
    with pytest.raises(ServableError, match=f"engine {fake_key} does not match this node: it was built for another node type.*{key}"):
        resolve_servable(ServableSource(f"file://{other}/{digest}/package", str(other), fake_key), tmp_path / "c")


def test_a_gpu_engine_on_a_node_without_that_gpu_is_refused(published, tmp_path: Path) -> None:
    root, package_uri, key = published
    other, digest, report_path = copied_store(root, tmp_path, key)
    report = json.loads(report_path.read_text())
    report["target"].update(backend="tensorrt", gpu_product="NVIDIA-H100-80GB-HBM3")
    report_path.write_text(json.dumps(report))
    with pytest.raises(ServableError, match=f"engine {key} cannot run on this node: .*"):
        resolve_servable(ServableSource(f"file://{other}/{digest}/package", str(other), key), tmp_path / "c")


def test_a_tampered_engine_file_in_the_store_is_refused(published, tmp_path: Path) -> None:
    root, package_uri, key = published
    other, digest, report_path = copied_store(root, tmp_path, key)
    engine_json = report_path.with_name("engine.json")
    engine_json.write_text(engine_json.read_text().replace('"executor"', '"executor" ', 1))
    with pytest.raises(StoreError, match="engine.json digest mismatch"):
        resolve_servable(ServableSource(f"file://{other}/{digest}/package", str(other), key), tmp_path / "c")
    assert not list((tmp_path / "c").glob("servables/*")), "nothing half-fetched is left to be served"


def test_a_missing_package_and_an_unwritable_cache_are_clear_errors(published, tmp_path: Path) -> None:
    root, _, key = published
    with pytest.raises(ValueError, match="does not exist|not found"):
        resolve_servable(ServableSource(f"file://{tmp_path}/nope", str(root), key), tmp_path / "c")
    with pytest.raises(ServableError, match="without an engine key"):
        ServableSource("file:///x", str(root))
    blocked = tmp_path / "blocked"
    blocked.write_text("")  # a path nobody (root included) can create a directory under
    digest = next(p.name for p in root.iterdir())
    with pytest.raises(ServableError, match=f"cache directory {blocked}/cache is not writable"):
        resolve_servable(ServableSource(f"file://{root}/{digest}/package", str(root), key), blocked / "cache")


def test_package_and_engine_from_s3(published, bucket: str, aws_env: str, tmp_path: Path) -> None:
    root, package_uri, key = published
    local = open_store(root)
    s3 = S3Store(f"s3://{bucket}/engines")
    package = Path(package_uri[len("file://"):])
    digest = s3.publish_package(package)
    assert digest == model_digest(open_package(package))
    engine = tmp_path / "engine"
    report = local.fetch_engine(digest, key, engine)
    s3.publish_engine(digest, key, engine, report)
    servable = resolve_servable(ServableSource(s3.package_uri(digest), s3.uri, key), tmp_path / "cache")
    assert servable.engine_key == key
    load_model(servable.package_dir, "host", engine_key=key)
