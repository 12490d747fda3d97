"""Bad packages and bad tensors: each a clear error naming what was wrong and what was expected."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kubetrt.runtime import InputError, PackageError, load_model


@pytest.fixture
def pkg(zoo, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    copy = tmp_path / "pkg"
    shutil.copytree(zoo.package("small_cnn"), copy)
    return copy


@pytest.fixture
def model(zoo):  # type: ignore[no-untyped-def]
    return load_model(zoo.package("two_in_two_out"))


def good_feeds(model, batch: int = 2) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    return {t.name: np.zeros([batch if d == -1 else d for d in t.shape], dtype=t.dtype) for t in model.inputs}


def test_missing_package_dir(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_directory_that_is_not_a_package(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="not a model package .*manifest.json"):
        load_model(tmp_path)


def test_truncated_model_file_is_caught_by_digest(pkg: Path) -> None:
    onnx_file = pkg / "model.onnx"
    onnx_file.write_bytes(onnx_file.read_bytes()[: onnx_file.stat().st_size // 2])
    with pytest.raises(PackageError, match="model.onnx: digest mismatch"):
        load_model(pkg)


def test_tampered_golden_is_caught_by_digest(pkg: Path) -> None:
    with open(pkg / "golden.npz", "ab") as f:
        f.write(b"x")
    with pytest.raises(PackageError, match="golden.npz: digest mismatch"):
        load_model(pkg)


def test_corrupt_manifest(pkg: Path) -> None:
    (pkg / "manifest.json").write_text("{not json")
    with pytest.raises(PackageError, match="corrupt manifest, not valid JSON"):
        load_model(pkg)


def test_manifest_of_unknown_schema(pkg: Path) -> None:
    data = json.loads((pkg / "manifest.json").read_text())
    data["schema_version"] = 99
    (pkg / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackageError, match="schema_version 99 is not supported"):
        load_model(pkg)


def test_manifest_missing_fields(pkg: Path) -> None:
    data = json.loads((pkg / "manifest.json").read_text())
    del data["inputs"]
    (pkg / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackageError, match="malformed manifest .*inputs"):
        load_model(pkg)


def test_missing_listed_file(pkg: Path) -> None:
    (pkg / "golden.npz").unlink()
    with pytest.raises(PackageError, match="golden.npz listed in the manifest is missing"):
        load_model(pkg)


def test_unreadable_onnx_without_digest_check(pkg: Path) -> None:
    (pkg / "model.onnx").write_bytes(b"\x08garbage")
    with pytest.raises(ValueError, match="model.onnx: not a readable ONNX model"):
        load_model(pkg, verify=False)


def test_unknown_input_name(model) -> None:  # type: ignore[no-untyped-def]
    feeds = good_feeds(model)
    feeds["bogus"] = feeds.pop("features")
    with pytest.raises(InputError, match=r"unknown input 'bogus'.*features \(float32 \[\?, 8\]\)"):
        model.predict(feeds)


def test_missing_input(model) -> None:  # type: ignore[no-untyped-def]
    feeds = good_feeds(model)
    del feeds["ids"]
    with pytest.raises(InputError, match="missing input 'ids'"):
        model.predict(feeds)


def test_wrong_dtype(model) -> None:  # type: ignore[no-untyped-def]
    feeds = good_feeds(model)
    feeds["features"] = feeds["features"].astype(np.float64)
    with pytest.raises(InputError, match="input 'features': expected dtype float32, got float64"):
        model.predict(feeds)


@pytest.mark.parametrize("shape", [(2, 9), (2, 8, 1), (8,)])
def test_wrong_shape(model, shape) -> None:  # type: ignore[no-untyped-def]
    feeds = good_feeds(model)
    feeds["features"] = np.zeros(shape, np.float32)
    with pytest.raises(InputError, match=r"input 'features': expected shape \[\?, 8\], got"):
        model.predict(feeds)


def test_not_an_array(model) -> None:  # type: ignore[no-untyped-def]
    feeds = good_feeds(model)
    feeds["features"] = [[0.0] * 8]
    with pytest.raises(InputError, match="expected a numpy array of float32, got list"):
        model.predict(feeds)


async def test_bad_input_fails_infer_the_same_way(model) -> None:  # type: ignore[no-untyped-def]
    feeds = good_feeds(model)
    feeds["ids"] = feeds["ids"].astype(np.int64)
    with pytest.raises(InputError, match="input 'ids': expected dtype int32, got int64"):
        await model.infer(feeds)
    assert set(model.predict(good_feeds(model))) == {"logits", "score"}  # still usable afterwards


def test_fast_feed_check_decides_as_check_feeds(model) -> None:  # type: ignore[no-untyped-def]
    """Model.validate_inputs takes a shortcut for well-formed feeds; on every kind of feed it must
    accept what check_feeds accepts and fail with check_feeds' own message otherwise."""
    from kubetrt.runtime.model import FeedCheck, check_feeds

    good = good_feeds(model)
    first, spec = next(iter(good)), model.inputs[0]
    fixed_axis = next((i for i, d in enumerate(spec.shape) if d != -1), None)
    variants: list[object] = [
        good,
        good_feeds(model, batch=5),
        {**good, "extra": good[first]},
        {k: v for k, v in good.items() if k != first},
        {**good, first: good[first].astype(np.float64)},
        {**good, first: good[first][None]},
        {**good, first: np.zeros([0] + list(good[first].shape[1:]), good[first].dtype)},
        {**good, first: good[first].tolist()},
        {**good, first: np.ma.masked_array(good[first])},  # an ndarray subclass: check_feeds' call
        list(good.values()),
    ]
    if fixed_axis is not None:
        wrong = list(good[first].shape)
        wrong[fixed_axis] += 1
        variants.append({**good, first: np.zeros(wrong, good[first].dtype)})
    fast = FeedCheck(model.inputs)
    for feeds in variants:
        try:
            want = check_feeds(model.inputs, feeds)  # type: ignore[arg-type]
        except InputError as e:
            with pytest.raises(InputError) as got:
                fast(feeds)  # type: ignore[arg-type]
            assert str(got.value) == str(e)
        else:
            got_feeds = fast(feeds)  # type: ignore[arg-type]
            assert got_feeds.keys() == want.keys() and all(got_feeds[k] is want[k] for k in want)
