"""bench/runtime.py --isa avx2: the environment it gives kubetrt's workers really keeps every kernel
source to AVX2 (oneDNN's dispatch and the blocked layout that follows it, numba's code, NumPy's
dispatch), and the one it gives OpenVINO's keeps its kernels to AVX2, on whatever CPU the suite runs."""
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


def test_each_runtime_gets_its_own_cap() -> None:
    envs = machine.cap_envs("avx2", ("kubetrt", "baseline"))
    assert envs["kubetrt"] == envs["baseline"] == machine.isa_cap_env("avx2")
    assert envs["openvino"] == machine.onednn_cap_env("avx2")
    assert "onnxruntime" not in envs  # no switch: it runs at the CPU's own ISA
    assert all(env == {} for env in machine.cap_envs("native").values())
