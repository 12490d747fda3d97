"""Calibration data: the formats a user really has, every way they can be wrong, the split, the digest."""
# no `from __future__ import annotations`: kfp reads the test pipeline's annotations as types
import hashlib
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from kubetrt.pipeline.calibration import (
    CalibrationData,
    CalibrationError,
    CalibrationOptions,
    data_digest,
    fetch_calibration,
    fetch_options,
    prepare_calibration,
    read_calibration,
    split,
)
from kubetrt.pipeline.errors import LowerError
from kubetrt.pipeline.sources import SourceError, s3_client
from kubetrt.runtime.package import TensorSpec

IMAGE = [TensorSpec("image", "float32", (-1, 6, 8, 3))]
GRAY = [TensorSpec("pixels", "float32", (-1, 5, 5, 1))]
TWO = [TensorSpec("features", "float32", (-1, 4)), TensorSpec("ids", "int32", (-1, 2))]
SEQ = [TensorSpec("seq", "float32", (-1, -1, 3))]


def read(source: Path, specs: list[TensorSpec], **options: object) -> CalibrationData:
    return read_calibration(CalibrationOptions(str(source), **options), specs)  # type: ignore[arg-type]


def two_input_arrays(n: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"features": rng.standard_normal((n, 4)), "ids": rng.integers(0, 9, (n, 2)).astype(np.int64)}


# --------------------------------------------------------------------------- npz


def test_npz_one_array_per_input_cast_to_the_model_dtypes_with_labels(tmp_path: Path) -> None:
    arrays = two_input_arrays()
    np.savez(tmp_path / "cal.npz", **arrays, labels=np.arange(5))
    data = read(tmp_path / "cal.npz", TWO)
    assert (data.kind, data.samples) == ("npz", 5)
    assert data.inputs["features"].dtype == np.float32 and data.inputs["ids"].dtype == np.int32
    np.testing.assert_array_equal(data.inputs["features"], arrays["features"].astype(np.float32))
    np.testing.assert_array_equal(data.inputs["ids"], arrays["ids"])
    np.testing.assert_array_equal(data.labels, np.arange(5))


def test_npz_key_labels_is_an_input_when_the_model_has_one_named_so(tmp_path: Path) -> None:
    specs = [TensorSpec("labels", "float32", (-1, 2))]
    np.savez(tmp_path / "cal.npz", labels=np.ones((3, 2)))
    data = read(tmp_path / "cal.npz", specs)
    assert data.labels is None and data.inputs["labels"].shape == (3, 2)


def test_dynamic_non_batch_dims_take_any_size(tmp_path: Path) -> None:
    np.savez(tmp_path / "cal.npz", seq=np.zeros((4, 7, 3), np.float32))
    assert read(tmp_path / "cal.npz", SEQ).inputs["seq"].shape == (4, 7, 3)


# --------------------------------------------------------------------------- npy directories


def test_npy_directory_with_one_file_per_input_and_labels(tmp_path: Path) -> None:
    arrays = two_input_arrays(6)
    for name, array in arrays.items():
        np.save(tmp_path / f"{name}.npy", array)
    np.save(tmp_path / "labels.npy", np.arange(6) % 2)
    data = read(tmp_path, TWO)
    assert (data.kind, data.samples) == ("npy", 6)
    np.testing.assert_array_equal(data.inputs["ids"], arrays["ids"])
    np.testing.assert_array_equal(data.labels, np.arange(6) % 2)


def test_npy_directory_with_one_file_per_sample_is_stacked_in_name_order(tmp_path: Path) -> None:
    for i in (2, 0, 10, 1):  # written out of order; "sample-10" sorts between 1 and 2
        np.save(tmp_path / f"sample-{i}.npy", np.full((6, 8, 3), i, np.float32))
    data = read(tmp_path, IMAGE)
    assert (data.kind, data.samples, data.labels) == ("npy-samples", 4, None)
    assert [float(data.inputs["image"][k, 0, 0, 0]) for k in range(4)] == [0.0, 1.0, 10.0, 2.0]


def test_per_sample_files_of_different_shapes_are_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.zeros((6, 8, 3)))
    np.save(tmp_path / "b.npy", np.zeros((6, 7, 3)))
    with pytest.raises(CalibrationError, match=r"differ in shape \(a\.npy is \[6, 8, 3\], b\.npy is \[6, 7, 3\]\)"):
        read(tmp_path, IMAGE)


def test_per_sample_files_need_a_single_input_model(tmp_path: Path) -> None:
    np.save(tmp_path / "0.npy", np.zeros(4))
    np.save(tmp_path / "1.npy", np.zeros(4))
    with pytest.raises(CalibrationError, match=r"missing model input\(s\) features, ids: one \.npy per sample fits a "
                                               r"single-input model only"):
        read(tmp_path, TWO)


# --------------------------------------------------------------------------- images


def write_image(path: Path, rgb: tuple[int, int, int], size: tuple[int, int] = (20, 15)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, rgb).save(path)


RGB = (10, 100, 200)
PRESET_EXPECTED = {
    "none": [10.0, 100.0, 200.0],
    "unit": [10 / 255, 100 / 255, 200 / 255],
    "tf": [10 / 127.5 - 1, 100 / 127.5 - 1, 200 / 127.5 - 1],
    "caffe": [200 - 103.939, 100 - 116.779, 10 - 123.68],  # BGR order, ImageNet means
    "torch": [(10 / 255 - 0.485) / 0.229, (100 / 255 - 0.456) / 0.224, (200 / 255 - 0.406) / 0.225],
}


@pytest.mark.parametrize("preset", sorted(PRESET_EXPECTED))
def test_image_directory_with_each_preprocessing_preset(tmp_path: Path, preset: str) -> None:
    write_image(tmp_path / "imgs" / "a.png", RGB)  # 20x15, resized to the model's 8x6
    write_image(tmp_path / "imgs" / "b.bmp", RGB, size=(8, 6))
    data = read(tmp_path / "imgs", IMAGE, preprocess=preset)
    x = data.inputs["image"]
    assert (data.kind, x.shape, x.dtype, data.labels) == ("images", (2, 6, 8, 3), np.float32, None)
    np.testing.assert_allclose(x[:, 3, 4, :], [PRESET_EXPECTED[preset]] * 2, rtol=1e-5, atol=1e-5)


def test_grayscale_input_decodes_luminance_and_jpeg_is_read(tmp_path: Path) -> None:
    Image.new("L", (5, 5), 77).save(tmp_path / "g.png")
    Image.new("RGB", (9, 9), (77, 77, 77)).save(tmp_path / "h.jpg", quality=95)
    data = read(tmp_path, GRAY, preprocess="none")
    assert data.inputs["pixels"].shape == (2, 5, 5, 1)
    np.testing.assert_allclose(data.inputs["pixels"][:, 2, 2, 0], [77, 77], atol=2)


def test_channel_presets_refuse_grayscale_models(tmp_path: Path) -> None:
    Image.new("L", (5, 5), 1).save(tmp_path / "g.png")
    with pytest.raises(CalibrationError, match=r"preprocessing 'torch' normalizes 3 RGB channels; the model's images have 1"):
        read(tmp_path, GRAY, preprocess="torch")


def test_class_subdirectories_become_labels_in_sorted_order(tmp_path: Path) -> None:
    write_image(tmp_path / "zebra" / "1.png", (1, 1, 1))
    write_image(tmp_path / "ant" / "1.png", (2, 2, 2))
    write_image(tmp_path / "ant" / "2.png", (3, 3, 3))
    write_image(tmp_path / "moth" / "x.jpeg", (4, 4, 4))
    data = read(tmp_path, IMAGE, preprocess="none")
    assert data.classes == ("ant", "moth", "zebra")
    np.testing.assert_array_equal(data.labels, [0, 0, 1, 2])
    np.testing.assert_allclose(data.inputs["image"][:, 0, 0, 0], [2, 3, 4, 1], atol=1)  # jpeg: lossy


PREPROCESS_MODULE = '''
import numpy as np

def scale(batch):
    assert batch.dtype == np.uint8 and batch.ndim == 4
    return batch.astype(np.float32) * 2.0 + 1.0

def broken(batch):
    raise RuntimeError("no luck")

def not_array(batch):
    return batch.tolist()

def flat(batch):
    return batch.reshape(len(batch), -1).astype(np.float32)

CONSTANT = 3
'''


@pytest.fixture
def preprocess_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "mods").mkdir()
    path = tmp_path / "mods" / "calib_pre.py"
    path.write_text(PREPROCESS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    write_image(tmp_path / "imgs" / "a.png", RGB)
    write_image(tmp_path / "imgs" / "b.png", (0, 0, 0))
    return path


@pytest.mark.parametrize("form", ["module", "file"])
def test_preprocessing_function_by_module_or_file(preprocess_module: Path, form: str) -> None:
    spec = "calib_pre:scale" if form == "module" else f"{preprocess_module}:scale"
    data = read(preprocess_module.parents[1] / "imgs", IMAGE, preprocess=spec)
    np.testing.assert_allclose(data.inputs["image"][:, 0, 0, :], [[21, 201, 401], [1, 1, 1]])


@pytest.mark.parametrize("spec, message", [
    ("calib_pre:broken", r"preprocessing function calib_pre:broken failed on the 2 images .*RuntimeError: no luck"),
    ("calib_pre:not_array", r"returned list; expected a numpy array"),
    ("calib_pre:CONSTANT", r"calib_pre has no function 'CONSTANT'"),
    ("no_such_module_xyz:fn", r"cannot import no_such_module_xyz \(ModuleNotFoundError"),
    ("/nowhere/pre.py:fn", r"file /nowhere/pre\.py does not exist"),
])
def test_preprocessing_function_errors(preprocess_module: Path, spec: str, message: str) -> None:
    with pytest.raises(CalibrationError, match=message):
        read(preprocess_module.parents[1] / "imgs", IMAGE, preprocess=spec)


def test_preprocessing_function_output_is_checked_against_the_input(preprocess_module: Path) -> None:
    with pytest.raises(CalibrationError, match=r"input 'image' has shape \[2, 144\] \(samples of \[144\]\); "
                                               r"expected N samples of \[6, 8, 3\]"):
        read(preprocess_module.parents[1] / "imgs", IMAGE, preprocess="calib_pre:flat")


# --------------------------------------------------------------------------- errors


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match=rf"{tmp_path / 'nope.npz'}: calibration data not found; expected an "
                                               r"\.npz with one array per model input"):
        read(tmp_path / "nope.npz", TWO)


def test_unknown_formats(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("1,2\n")
    with pytest.raises(CalibrationError, match=r"unknown calibration data format '\.csv'"):
        read(tmp_path / "data.csv", TWO)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationError, match=r"empty: empty directory"):
        read(tmp_path / "empty", TWO)
    (tmp_path / "stray").mkdir()
    np.save(tmp_path / "stray" / "features.npy", np.zeros((3, 4)))
    (tmp_path / "stray" / "notes.txt").write_text("x")
    with pytest.raises(CalibrationError, match=r"unknown calibration data format: found notes\.txt"):
        read(tmp_path / "stray", TWO)
    write_image(tmp_path / "mixed" / "cls" / "a.png", RGB)
    write_image(tmp_path / "mixed" / "b.png", RGB)
    with pytest.raises(CalibrationError, match=r"found a mix of class subdirectories and images"):
        read(tmp_path / "mixed", IMAGE, preprocess="unit")


def test_corrupt_npz(tmp_path: Path) -> None:
    (tmp_path / "cal.npz").write_bytes(b"not a zip file at all")
    with pytest.raises(CalibrationError, match=r"cal\.npz: not a readable \.npz"):
        read(tmp_path / "cal.npz", TWO)


@pytest.mark.parametrize("arrays, message", [
    ({"features": np.zeros((3, 4))}, r"missing model input\(s\) ids; the model's inputs are features:float32\[-1, 4\], "
                                     r"ids:int32\[-1, 2\]"),
    ({**two_input_arrays(3), "mask": np.zeros((3, 2))}, r"extra array\(s\) mask that are not model inputs"),
    ({"features": np.zeros((3, 5)), "ids": np.zeros((3, 2), np.int32)},
     r"input 'features' has shape \[3, 5\] \(samples of \[5\]\); expected N samples of \[4\]"),
    ({"features": np.zeros((3, 4, 1)), "ids": np.zeros((3, 2), np.int32)}, r"input 'features' has shape \[3, 4, 1\]"),
    ({"features": np.zeros((3, 4)), "ids": np.zeros((3, 2), np.float32)},
     r"input 'ids' is float32; the model takes int32 and float32 does not convert"),
    ({"features": np.zeros((3, 4)), "ids": np.full((3, 2), 2**40)},
     r"input 'ids' holds values in \[1099511627776, 1099511627776\], outside int32's range"),
    ({"features": np.zeros((3, 4)), "ids": np.zeros((4, 2), np.int32)},
     r"inputs have different sample counts \(features: 3, ids: 4\)"),
    ({**two_input_arrays(3), "labels": np.arange(2)}, r"different sample counts \(features: 3, ids: 3, labels: 2\)"),
    ({"features": np.zeros((1, 4)), "ids": np.zeros((1, 2), np.int32)},
     r"1 sample\(s\); need at least 2 \(at least one to calibrate on and one held out"),
    ({"features": np.array([[0, 1, np.nan, 2]] * 3), "ids": np.zeros((3, 2), np.int32)},
     r"input 'features' holds 3 non-finite value\(s\)"),
    ({"features": np.array([[0, 1, 1e300, 2]] * 2), "ids": np.zeros((2, 2), np.int32)},
     r"input 'features' holds 2 non-finite value\(s\) \(NaN or inf\) as float32"),  # overflows when cast
])
def test_arrays_that_do_not_fit_the_model(tmp_path: Path, arrays: dict[str, np.ndarray], message: str) -> None:
    np.savez(tmp_path / "cal.npz", **arrays)
    with pytest.raises(CalibrationError, match=message):
        read(tmp_path / "cal.npz", TWO)


def test_unreadable_image(tmp_path: Path) -> None:
    write_image(tmp_path / "good.png", RGB)
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8 truncated nonsense")
    with pytest.raises(CalibrationError, match=rf"{tmp_path / 'bad.jpg'}: unreadable image"):
        read(tmp_path, IMAGE, preprocess="unit")


def test_images_need_preprocessing_and_a_single_nhwc_input(tmp_path: Path) -> None:
    write_image(tmp_path / "a.png", RGB)
    with pytest.raises(CalibrationError, match=r"image calibration data needs --preprocess: how the model expects"):
        read(tmp_path, IMAGE)
    with pytest.raises(CalibrationError, match=r"fits a model with one image input; this model has 2"):
        read(tmp_path, TWO, preprocess="unit")
    with pytest.raises(CalibrationError, match=r"needs an NHWC image input of shape \[-1, H, W, 1\|3\]"):
        read(tmp_path, SEQ, preprocess="unit")


def test_class_directory_with_stray_files(tmp_path: Path) -> None:
    write_image(tmp_path / "cat" / "a.png", RGB)
    (tmp_path / "cat" / "notes.txt").write_text("x")
    with pytest.raises(CalibrationError, match=r"cat: class directory holds notes\.txt; expected only image files"):
        read(tmp_path, IMAGE, preprocess="unit")


def test_preprocessing_is_for_images_only(tmp_path: Path) -> None:
    np.savez(tmp_path / "cal.npz", **two_input_arrays())
    with pytest.raises(CalibrationError, match=r"preprocessing \(unit\) applies to image directories only"):
        read(tmp_path / "cal.npz", TWO, preprocess="unit")


@pytest.mark.parametrize("options, message", [
    ({"method": "kl"}, r"calibration method 'kl': expected one of minmax, percentile, entropy"),
    ({"percentile": 99.0}, r"a percentile \(99\.0\) only applies to --calibration-method percentile, not minmax"),
    ({"method": "percentile", "percentile": 0.0}, r"percentile 0\.0: expected a number in \(0, 100\]"),
    ({"method": "percentile", "percentile": 101.0}, r"percentile 101\.0"),
    ({"holdout": 0.0}, r"holdout fraction 0\.0: expected a number between 0 and 1"),
    ({"holdout": 1.0}, r"holdout fraction 1\.0"),
    ({"keep_float": ("",)}, r"keep-float entries \[''\]"),
    ({"preprocess": "imagenet"}, r"preprocessing 'imagenet': expected one of none, unit, tf, caffe, torch or "
                                 r"MODULE:FUNCTION"),
    ({"source": ""}, r"no calibration data given"),
])
def test_bad_options_are_refused_at_construction(options: dict[str, object], message: str) -> None:
    kwargs = {"source": "cal.npz", **options}
    with pytest.raises(CalibrationError, match=message):
        CalibrationOptions(**kwargs)  # type: ignore[arg-type]
    assert issubclass(CalibrationError, LowerError)  # the CLI reports it as a one-line error


def test_percentile_defaults() -> None:
    assert CalibrationOptions("x", method="percentile").percentile_value == 99.999
    assert CalibrationOptions("x", method="percentile", percentile=99.9).percentile_value == 99.9
    assert CalibrationOptions("x").percentile_value is None


# --------------------------------------------------------------------------- split, digest


def numbered(n: int) -> CalibrationData:
    """Sample i holds the value i everywhere, so rows can be traced through the split."""
    return CalibrationData({"x": np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, axis=1)},
                           np.arange(n) * 10, "npz", "mem")


def test_split_is_deterministic_disjoint_and_complete() -> None:
    data = numbered(50)
    cal, held = split(data, 0.2, seed=3)
    again_cal, again_held = split(data, 0.2, seed=3)
    np.testing.assert_array_equal(cal.inputs["x"], again_cal.inputs["x"])
    np.testing.assert_array_equal(held.inputs["x"], again_held.inputs["x"])
    cal_ids, held_ids = cal.inputs["x"][:, 0].astype(int), held.inputs["x"][:, 0].astype(int)
    assert (cal.samples, held.samples) == (40, 10)
    assert sorted([*cal_ids, *held_ids]) == list(range(50))
    assert list(held_ids) == sorted(held_ids)  # kept in the data's order
    np.testing.assert_array_equal(held.labels, held_ids * 10)  # labels travel with their samples
    assert held_ids.tolist() != list(range(40, 50)) and held_ids.tolist() != list(range(10))  # shuffled
    _, other = split(data, 0.2, seed=4)
    assert other.inputs["x"][:, 0].tolist() != held_ids.tolist()  # the seed matters


@pytest.mark.parametrize("n, holdout, sizes", [(2, 0.2, (1, 1)), (10, 0.01, (9, 1)), (10, 0.99, (1, 9)), (7, 0.5, (3, 4))])
def test_split_keeps_at_least_one_sample_each_side(n: int, holdout: float, sizes: tuple[int, int]) -> None:
    cal, held = split(numbered(n), holdout)
    assert (cal.samples, held.samples) == sizes


def test_prepare_calibration_never_calibrates_on_held_out_samples(tmp_path: Path) -> None:
    np.savez(tmp_path / "cal.npz", x=numbered(20).inputs["x"])
    prepared = prepare_calibration(CalibrationOptions(str(tmp_path / "cal.npz"), holdout=0.25),
                                   [TensorSpec("x", "float32", (-1, 3))], seed=0)
    cal_ids = set(prepared.calibrate.inputs["x"][:, 0].tolist())
    held_ids = set(prepared.heldout.inputs["x"][:, 0].tolist())
    assert not cal_ids & held_ids and len(held_ids) == 5
    record = prepared.record()
    assert (record["samples"], record["heldout_samples"], record["kind"]) == (15, 5, "npz")
    assert record["source"] == str((tmp_path / "cal.npz").resolve())
    assert record["digest"] == data_digest(prepared.data.inputs)
    assert prepared.heldout_record() == {"samples": 5, "labels": False, "source": record["source"],
                                         "digest": data_digest(prepared.heldout.inputs)}


def test_digest_is_sha256_over_the_arrays() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    expected = hashlib.sha256(b"x\0<f4\0[2, 3]\0" + x.tobytes()).hexdigest()
    assert data_digest({"x": x}) == "sha256:" + expected
    assert data_digest({"x": x}) == data_digest({"x": x.copy(order="F")})  # layout does not matter
    changed = x.copy()
    changed[1, 2] += 1
    assert data_digest({"x": changed}) != data_digest({"x": x})
    assert data_digest({"x": x.astype(np.float64)}) != data_digest({"x": x})
    assert data_digest({"x": x.reshape(3, 2)}) != data_digest({"x": x})
    assert data_digest({"x": x}, np.array([0, 1])) != data_digest({"x": x})


# --------------------------------------------------------------------------- remote data, pipeline wiring


def test_fetch_local_paths_as_they_are(tmp_path: Path) -> None:
    assert fetch_calibration(str(tmp_path / "cal.npz"), tmp_path / "work") == tmp_path / "cal.npz"
    assert fetch_calibration(f"file://{tmp_path}/imgs", tmp_path / "work") == tmp_path / "imgs"


def test_fetch_s3_npz_object_and_prefix(bucket: str, tmp_path: Path) -> None:
    client = s3_client()
    np.savez(tmp_path / "cal.npz", **two_input_arrays())
    client.upload_file(str(tmp_path / "cal.npz"), bucket, "data/cal.npz")
    for name, array in two_input_arrays(4).items():
        np.save(tmp_path / f"{name}.npy", array)
        client.upload_file(str(tmp_path / f"{name}.npy"), bucket, f"npy/{name}.npy")

    local = fetch_calibration(f"s3://{bucket}/data/cal.npz", tmp_path / "w1")
    assert local.parent == tmp_path / "w1" / "calibration" and read(local, TWO).samples == 5
    local = fetch_calibration(f"s3://{bucket}/npy", tmp_path / "w2")
    assert read(local, TWO).kind == "npy" and read(local, TWO).samples == 4
    with pytest.raises(SourceError, match=rf"s3://{bucket}/data/missing\.npz: not found"):
        fetch_calibration(f"s3://{bucket}/data/missing.npz", tmp_path / "w3")

    options = fetch_options(CalibrationOptions(f"s3://{bucket}/data/cal.npz", method="entropy"), tmp_path / "w4")
    assert Path(options.source).is_file() and options.method == "entropy"
    assert options.described == f"s3://{bucket}/data/cal.npz"  # the manifest names the data, not a temp dir
    local = fetch_options(CalibrationOptions(f"file://{tmp_path}/cal.npz"), tmp_path / "w5")
    assert (local.source, local.described) == (str(tmp_path / "cal.npz"), str(tmp_path / "cal.npz"))


def test_gs_single_files_are_refused_with_the_alternative(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"a single calibration file is fetched from s3:// only"):
        fetch_calibration("gs://bkt/cal.npz", tmp_path)


def test_pipeline_wires_calibration_into_lower(tmp_path: Path) -> None:
    from kubetrt.pipeline.kfp_pipeline import compile_pipeline

    spec, _ = yaml.safe_load_all(compile_pipeline(tmp_path / "p.yaml").read_text())
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["calibration"]["defaultValue"] == "" and params["calibration_method"]["defaultValue"] == "minmax"
    lower = spec["root"]["dag"]["tasks"]["lower-op"]["inputs"]["parameters"]
    for name in ("calibration", "calibration_method", "calibration_preprocess"):
        assert lower[name] == {"componentInputParameter": name}


def test_kfp_lower_op_calibrates_from_the_pipeline_parameter(zoo, tmp_path: Path) -> None:
    """ingest -> lower under kfp.local with the pipeline's `calibration` parameter: the published
    package carries the INT8 model and the held-out data."""
    from kfp import dsl, local

    from kubetrt.pipeline.kfp_pipeline import ingest_op, lower_op
    from kubetrt.pipeline.store import open_store
    from kubetrt.runtime.package import HELDOUT, MODEL_INT8_ONNX, open_package

    @dsl.pipeline(name="lower-with-calibration")
    def lower_only(source: str, store: str, calibration: str, calibration_method: str) -> str:
        ingest = ingest_op(source=source, signature="serving_default", s3_endpoint="")
        return lower_op(savedmodel=ingest.outputs["savedmodel"], name="", default_name=ingest.outputs["name"],
                        signature="serving_default", version="1", store=store, s3_endpoint="",
                        calibration=calibration, calibration_method=calibration_method).outputs["Output"]

    np.savez(tmp_path / "cal.npz", image=np.random.default_rng(0).standard_normal((12, 32, 32, 3)).astype(np.float32))
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"),
               raise_on_error=True)
    run = lower_only(source=str(zoo.savedmodel("small_cnn")), store=str(tmp_path / "store"),
                     calibration=str(tmp_path / "cal.npz"), calibration_method="percentile")
    package = open_store(tmp_path / "store").fetch_package(str(run.output), tmp_path / "pkg")
    manifest = open_package(package)
    assert {MODEL_INT8_ONNX, HELDOUT} <= set(manifest.files)
    assert manifest.quantization["method"] == "percentile"
    assert manifest.quantization["calibration"]["samples"] + manifest.heldout["samples"] == 12
