"""bench/runtime.py --isa avx2: the environment it gives kubetrt's workers really keeps every kernel
source to AVX2 (oneDNN's dispatch and the blocked layout that follows it, numba's code, NumPy's
dispatch), and the ones it gives OpenVINO's and onnxruntime's keep their kernels to AVX2, on
whatever CPU the suite runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import file_modules

REPO = Path(__file__).resolve().parents[1]
machine = file_modules.load("kubetrt_bench_machine", REPO / "bench" / "_machine.py")

PROBE = """
import json, numba, numpy as np
from numpy._core import _multiarray_umath as dispatch
from kubetrt.runtime.kernels import onednn

@numba.njit(fastmath=True)
def dot(a, b):
    s = 0.0
    for i in range(a.size):
        s += a[i] * b[i]
    return s

x = np.ones(1024, np.float32)
dot(x, x)
asm = next(iter(dot.inspect_asm().values()))
print(json.dumps({"onednn": onednn.isa_name() if onednn.AVAILABLE else None, "block": onednn.BLOCK,
                  "zmm": "zmm" in asm, "ymm": "ymm" in asm,
                  "numpy_avx512": [k for k, v in dispatch.__cpu_features__.items()
                                   if v and (k == "X86_V4" or k.startswith("AVX512_")) and k in dispatch.__cpu_dispatch__]}))
"""


def probe(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_avx2_cap_keeps_onednn_numba_and_numpy_to_avx2() -> None:
    got = probe(machine.isa_cap_env("avx2"))
    if got["onednn"] is not None:
        assert got["onednn"] == "avx2"
        assert got["block"] == 8  # the blocked layout follows the capped dispatch
    assert got["zmm"] is False and got["ymm"] is True  # 256-bit vectors, no 512-bit register
    assert got["numpy_avx512"] == []


def test_native_is_no_cap() -> None:
    assert machine.isa_cap_env("native") == {}


def test_an_unknown_cap_is_named() -> None:
    with pytest.raises(ValueError, match="'sse2'.*native, avx2"):
        machine.isa_cap_env("sse2")


OPENVINO_PROBE = """
import json, sys, openvino as ov
sys.path.insert(0, sys.argv[1])
from _machine import openvino_isa

core = ov.Core()
print(json.dumps(openvino_isa(core.compile_model(core.read_model(sys.argv[2]), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}))))
"""


@pytest.fixture(scope="module")
def conv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3x3 convolution and ReLU, as a file OpenVINO reads."""
    sys.path.insert(0, str(REPO / "tests" / "runtime"))
    from onnx_cases import make_model, node

    rng = np.random.default_rng(0)
    model = make_model([node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), node("Relu", ["c"], ["y"])],
                       {"x": np.zeros((1, 16, 28, 28), np.float32)}, ["y"], {"w": rng.random((32, 16, 3, 3), np.float32)})
    path = tmp_path_factory.mktemp("openvino") / "conv.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def openvino_isa_under(env: dict[str, str], model: Path) -> str:
    pytest.importorskip("openvino")
    out = subprocess.run([sys.executable, "-c", OPENVINO_PROBE, str(REPO / "bench"), str(model)], env={**os.environ, **env},
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_avx2_cap_keeps_openvinos_kernels_to_avx2(conv_model: Path) -> None:
    assert openvino_isa_under(machine.onednn_cap_env("avx2"), conv_model) == "avx2"
    if "avx512f" in machine._cpuinfo()[1]:  # and it is the cap that does it: uncapped, the wider kernels
        assert openvino_isa_under({}, conv_model) == "avx512"


def test_the_kubetrt_cap_holds_the_openvino_one() -> None:
    assert machine.onednn_cap_env("avx2").items() <= machine.isa_cap_env("avx2").items()
    assert machine.onednn_cap_env("native") == {}


ONNXRUNTIME_PROBE = """
import json, os, sys, tempfile
import numpy as np, onnx, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

# 40 channels: onnxruntime's blocked (NCHWc) layout pads them to its block, 8 floats on AVX2 and
# 16 on AVX-512, in the weights of the graph it optimized
w = numpy_helper.from_array(np.ones((40, 40, 3, 3), np.float32), "w")
graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "conv",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 40, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 40, 16, 16])], [w])
options = ort.SessionOptions()
options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
options.log_severity_level = 3
options.optimized_model_filepath = os.path.join(tempfile.mkdtemp(), "optimized.onnx")
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
x = np.ones((1, 40, 16, 16), np.float32)
y = session.run(None, {"x": x})[0]
optimized = onnx.load(options.optimized_model_filepath)
print(json.dumps({"package": ort.__file__, "weights": [list(t.dims) for t in optimized.graph.initializer],
                  "centre": float(y[0, 0, 8, 8])}))
"""


@pytest.fixture(scope="module")
def capped_onnxruntime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bench cache holding onnxruntime's AVX2 copy, made once for the module's tests."""
    pytest.importorskip("onnxruntime")
    cache = tmp_path_factory.mktemp("bench-cache")
    machine.onnxruntime_cap_env("avx2", cache)
    return cache


def onnxruntime_probe(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", ONNXRUNTIME_PROBE], env={**os.environ, **env}, capture_output=True,
                         text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.xdist_group("onnxruntime_cap")
def test_the_avx2_cap_keeps_onnxruntimes_kernels_to_avx2(capped_onnxruntime: Path) -> None:
    capped = onnxruntime_probe(machine.onnxruntime_cap_env("avx2", capped_onnxruntime))
    assert Path(str(capped["package"])).is_relative_to(capped_onnxruntime)  # the copy, not the package installed
    assert capped["weights"] == [[40, 40, 3, 3]]  # AVX2's blocks of 8: 40 channels need no padding
    assert capped["centre"] == 40 * 9  # and the copy computes: a 3x3x40 window of ones
    if "avx512f" in machine._cpuinfo()[1]:  # and it is the cap that does it: uncapped, AVX-512's blocks of 16
        assert onnxruntime_probe({})["weights"] == [[48, 48, 3, 3]]


@pytest.mark.xdist_group("onnxruntime_cap")
def test_each_runtime_gets_its_own_cap(capped_onnxruntime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBETRT_BENCH_CACHE", str(capped_onnxruntime))
    runtimes = ("kubetrt", "baseline", "openvino", "onnxruntime", "onnxruntime-int8", "tensorflow")
    envs = machine.cap_envs("avx2", runtimes, ("kubetrt", "baseline"))
    assert envs["kubetrt"] == envs["baseline"] == machine.isa_cap_env("avx2")
    assert envs["openvino"] == machine.onednn_cap_env("avx2")
    assert envs["onnxruntime"] == envs["onnxruntime-int8"] == machine.onnxruntime_cap_env("avx2", capped_onnxruntime)
    assert "tensorflow" not in envs  # no switch: it runs at the CPU's own ISA
    assert all(env == {} for env in machine.cap_envs("native", runtimes).values())


def test_onnxruntime_is_copied_only_for_a_bench_that_runs_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBETRT_BENCH_CACHE", str(tmp_path))
    envs = machine.cap_envs("avx2", ("kubetrt", "openvino"))
    assert sorted(envs) == ["kubetrt", "openvino"] and not list(tmp_path.iterdir())


def test_the_xcr0_rewrite_replaces_each_xgetbv_and_names_a_wrong_site() -> None:
    xgetbv, avx_only = b"\x0f\x01\xd0", b"\x8d\x41\x07"  # lea eax, [rcx + 7]
    code = b"\x31\xc9" + xgetbv + b"\x90" * 4 + xgetbv + b"\x89\xc0"
    assert machine.xcr0_capped(code, [2, 9]) == b"\x31\xc9" + avx_only + b"\x90" * 4 + avx_only + b"\x89\xc0"
    with pytest.raises(ValueError, match="0x1: expected xgetbv"):
        machine.xcr0_capped(code, [1])
