"""Engine store: atomic, idempotent publish; digests checked on fetch and load; S3 via moto."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kubetrt.pipeline.stages import build_stage, build_verify_publish, verify_stage
from kubetrt.pipeline.store import (
    COMPLETE,
    LocalStore,
    S3Store,
    StoreError,
    model_digest,
    open_store,
)
from kubetrt.pipeline.verify import VerificationError
from kubetrt.runtime import load_model
from kubetrt.runtime.package import PackageError, open_package
from kubetrt.runtime.target import parse_target

HOST = parse_target("host")


@pytest.fixture
def package(zoo) -> Path:
    return zoo.package("small_cnn")


@pytest.fixture
def built(package: Path, tmp_path: Path):
    """A host engine built (not published) with its passing report."""
    manifest = open_package(package)
    b = build_stage(package, manifest, HOST, None, tmp_path / "engine")
    return b, verify_stage(package, manifest, b.engine_dir, b.target)


def test_publish_fetch_and_reuse(package: Path, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    first = build_verify_publish(package, "host", store)
    assert not first.reused and first.summary.startswith("passed")
    digest = model_digest(open_package(package))
    assert store.list_engines(digest) == [first.key]
    report_path = Path(first.uri) / "report.json"
    before = report_path.stat()
    second = build_verify_publish(package, "host", store)
    assert second.reused and second.key == first.key
    after = report_path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    report = store.fetch_engine(digest, first.key, tmp_path / "fetched")
    assert report["passed"] and set(report["files"]) == {p.name for p in (tmp_path / "fetched").iterdir()}
    coverage = report["build"]["coverage"]  # the build report says where every node runs
    assert coverage["device"] == "host" and list(coverage["ops"]) == ["host"] and coverage["fallback_segments"] == []


def test_failing_engine_is_never_published(built, tmp_path: Path) -> None:
    b, report = built
    store = LocalStore(tmp_path / "store")
    bad = dict(report, passed=False, summary="FAILED: max abs error 0.5")
    from kubetrt.pipeline.stages import publish_stage

    with pytest.raises(VerificationError, match="failed verification and was not published: FAILED"):
        publish_stage(store, b, bad)
    with pytest.raises(StoreError, match="refusing to publish"):
        store.publish_engine(b.model_digest, b.key, b.engine_dir, bad)
    assert store.list_engines(b.model_digest) == []
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("report.json"))


def test_crash_mid_copy_leaves_no_visible_engine(built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b, report = built
    (b.engine_dir / "plan.bin").write_bytes(os.urandom(1024))  # a second file, so the copy can fail midway
    store = LocalStore(tmp_path / "store")
    import shutil

    real_copy, calls = shutil.copy2, []

    def flaky_copy(src, dst, **kw):
        calls.append(src)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        return real_copy(src, dst, **kw)

    monkeypatch.setattr(shutil, "copy2", flaky_copy)
    with pytest.raises(StoreError, match="disk full"):
        store.publish_engine(b.model_digest, b.key, b.engine_dir, report)
    monkeypatch.undo()
    assert len(calls) == 2
    assert store.list_engines(b.model_digest) == [] and not store.has_engine(b.model_digest, b.key)
    assert not (tmp_path / "store" / b.model_digest / b.key).exists()
    assert store.publish_engine(b.model_digest, b.key, b.engine_dir, report).reused is False
    assert store.list_engines(b.model_digest) == [b.key]


def test_killed_publisher_leaves_no_visible_engine(built, tmp_path: Path) -> None:
    """SIGKILL during the copy: no cleanup code runs, yet readers still see no engine."""
    b, report = built
    (b.engine_dir / "big.bin").write_bytes(b"\0" * (1 << 20))
    (tmp_path / "report.json").write_text(json.dumps(report))
    marker = tmp_path / "copying"
    script = textwrap.dedent(f"""
        import json, shutil, time
        from pathlib import Path
        from kubetrt.pipeline.store import LocalStore
        real = shutil.copy2
        def slow(src, dst, **kw):
            out = real(src, dst, **kw)
            Path({str(marker)!r}).touch()
            time.sleep(60)
            return out
        shutil.copy2 = slow
        LocalStore({str(tmp_path / 'store')!r}).publish_engine(
            {b.model_digest!r}, {b.key!r}, Path({str(b.engine_dir)!r}),
            json.loads(Path({str(tmp_path / 'report.json')!r}).read_text()))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert proc.poll() is None, "publisher exited before copying"
            assert time.monotonic() < deadline, "publisher never started copying"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = LocalStore(tmp_path / "store")
    leftovers = list((tmp_path / "store" / b.model_digest).iterdir())
    assert leftovers and all(p.name.startswith(".") for p in leftovers)  # only the hidden temp dir
    assert store.list_engines(b.model_digest) == [] and store.read_report(b.model_digest, b.key) is None
    with pytest.raises(StoreError, match="no published engine"):
        store.fetch_engine(b.model_digest, b.key, tmp_path / "f")


def test_tampered_engine_detected_on_fetch_and_load(package: Path, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    rec = build_verify_publish(package, "host", store)
    engine_json = Path(rec.uri) / "engine.json"
    engine_json.write_text(engine_json.read_text().replace('"host"', '"host" ', 1))
    with pytest.raises(StoreError, match="engine.json digest mismatch"):
        store.fetch_engine(rec.model_digest, rec.key, tmp_path / "fetched")
    # On load: the assembled package lists engine digests in its manifest, checked by the runtime.
    from kubetrt.pipeline.store import assemble_package

    pkg = assemble_package(package, {rec.key: (Path(rec.uri), {"backend": "host"})}, tmp_path / "pkg")
    (pkg / "engines" / rec.key / "engine.json").write_text("{}")
    with pytest.raises(PackageError, match="digest mismatch"):
        load_model(pkg, "host", engine_key=rec.key)


def test_store_rejects_unsupported_scheme() -> None:
    with pytest.raises(StoreError, match="not gs://"):
        open_store("gs://bucket/engines")


def test_s3_store_publish_marker_and_tamper(bucket: str, built, tmp_path: Path) -> None:
    b, report = built
    store = open_store(f"s3://{bucket}/engines")
    assert isinstance(store, S3Store)
    # A partial upload (files, no _COMPLETE marker) is invisible.
    client = store.client
    client.put_object(Bucket=bucket, Key=f"engines/{b.model_digest}/{b.key}/engine.json", Body=b"partial")
    assert store.list_engines(b.model_digest) == [] and not store.has_engine(b.model_digest, b.key)
    pub = store.publish_engine(b.model_digest, b.key, b.engine_dir, report)
    assert not pub.reused and pub.uri == f"s3://{bucket}/engines/{b.model_digest}/{b.key}"
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert f"engines/{b.model_digest}/{b.key}/{COMPLETE}" in keys
    assert store.list_engines(b.model_digest) == [b.key]
    assert store.publish_engine(b.model_digest, b.key, b.engine_dir, report).reused
    got = store.fetch_engine(b.model_digest, b.key, tmp_path / "fetched")
    assert got["passed"]
    client.put_object(Bucket=bucket, Key=f"engines/{b.model_digest}/{b.key}/engine.json", Body=b"{}")
    with pytest.raises(StoreError, match="digest mismatch"):
        store.fetch_engine(b.model_digest, b.key, tmp_path / "fetched2")


def test_s3_package_roundtrip_and_cli_build(bucket: str, package: Path, tmp_path: Path, capsys) -> None:
    from kubetrt.cli import main

    store = open_store(f"s3://{bucket}/store")
    digest = store.publish_package(package)
    assert store.has_package(digest)
    fetched = store.fetch_package(digest, tmp_path / "pkg")
    assert model_digest(open_package(fetched)) == digest
    term = tmp_path / "termination-log"
    args = ["build", "--package", store.package_uri(digest), "--target", "host", "--store", f"s3://{bucket}/store",
            "--termination-log", str(term)]
    assert main(args) == 0
    key = capsys.readouterr().out.strip()
    result = json.loads(term.read_text())
    assert result["engineKey"] == key and result["verified"] and not result["reused"]
    assert store.list_engines(digest) == [key]
    assert main(args) == 0
    assert json.loads(term.read_text())["reused"] is True
