"""Model sources and bad inputs: every failure names what was wrong and what was expected."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from kubetrt.pipeline.sources import SourceError, fetch_model, model_name_from_uri, parse_uri, s3_client
from kubetrt.runtime.target import TargetError, parse_target


def test_parse_uri_forms() -> None:
    assert parse_uri("/a/b").scheme == "file"
    assert parse_uri("file:///a/b").path == "/a/b"
    u = parse_uri("s3://bkt/some/prefix/")
    assert (u.scheme, u.bucket, u.path) == ("s3", "bkt", "some/prefix")
    assert str(u.join("x", "y")) == "s3://bkt/some/prefix/x/y"
    assert parse_uri("gs://b/p").scheme == "gs"


@pytest.mark.parametrize("uri, expected", [
    ("ftp://host/model", "unsupported URI scheme 'ftp'"),
    ("s3:///nobucket", "has no bucket"),
    ("file://otherhost/x", "local absolute path"),
    ("", "empty URI"),
])
def test_bad_uris(uri: str, expected: str) -> None:
    with pytest.raises(SourceError, match=expected):
        parse_uri(uri)


def test_missing_model(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="model not found"):
        fetch_model(str(tmp_path / "nope"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="not a SavedModel .*saved_model.pb"):
        fetch_model(f"file://{tmp_path / 'empty'}", tmp_path)


def test_malformed_target_specs() -> None:
    with pytest.raises(TargetError, match="batch profile must be MIN/OPT/MAX"):
        parse_target("tensorrt@H100:fp16:1/8")
    with pytest.raises(TargetError, match="expected BACKEND"):
        parse_target("host fp32")
    with pytest.raises(TargetError, match="backend 'gpu'"):
        parse_target("gpu@H100")
    with pytest.raises(TargetError, match="precision 'fp8'"):
        parse_target("cuda@Tesla-T4:fp8")


def test_model_name_from_uri() -> None:
    assert model_name_from_uri("s3://b/models/resnet/1") == "resnet"
    assert model_name_from_uri("/x/my_cnn") == "my_cnn"


def test_unreachable_s3_endpoint_fails_fast(aws_env: str, closed_port: int, tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(SourceError, match=rf"cannot reach S3 endpoint http://127.0.0.1:{closed_port}"):
        fetch_model("s3://bucket/model", tmp_path, s3_endpoint=f"http://127.0.0.1:{closed_port}")
    assert time.monotonic() - t0 < 10


def test_missing_s3_bucket_and_prefix(bucket: str, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="not found"):
        fetch_model("s3://no-such-bucket-here/model", tmp_path / "a")
    with pytest.raises(SourceError, match="no objects under this prefix"):
        fetch_model(f"s3://{bucket}/absent", tmp_path / "b")


def test_s3_model_source(bucket: str, zoo, tmp_path: Path) -> None:
    from kubetrt.pipeline.sources import s3_upload_dir
    from kubetrt.pipeline.stages import ingest_stage

    sm = zoo.savedmodel("mlp")
    s3_upload_dir(s3_client(), sm, parse_uri(f"s3://{bucket}/models/mlp/1"))
    info = ingest_stage(f"s3://{bucket}/models/mlp/1", tmp_path)
    assert info.path.is_relative_to(tmp_path)
    assert [t.name for t in info.inputs] == ["features"]


def test_gs_without_credentials_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # do not probe the GCE metadata server
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))  # no gcloud user credentials
    with pytest.raises(SourceError, match="no Google Cloud credentials"):
        fetch_model("gs://bucket/model", tmp_path)
