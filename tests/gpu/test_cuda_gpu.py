"""The cuda runtime on a real GPU (CuPy streams, CUDA Graph capture, ElementwiseKernel epilogues).
Skipped where CuPy or a GPU is absent: this is the GPU boundary that the NumPy stand-in tests
cannot cover. bench/gpu_check.py runs the same comparison on GPU machines without pytest."""
from __future__ import annotations

import re

import pytest
from helpers import check_all_batches, load
from kubetrt.runtime.devices.cuda import CudaRuntime


@pytest.mark.parametrize("name", ["small_cnn", "mlp", "transformer", "two_in_two_out"])
@pytest.mark.parametrize("precision,tol", [("fp32", 1e-3), ("fp16", 1e-2)])
def test_cuda_gpu_graph_replay_matches_golden(gpu: CudaRuntime, zoo, name: str, precision: str, tol: float) -> None:
    graph, golden = load(zoo.package(name))
    exe = gpu.prepare(graph, {"precision": precision, "cuda_graphs": True, "contexts": 1})
    assert exe.cuda_graphs, exe.plan.sync_reasons
    check_all_batches(exe.run, graph, golden, tol)
    check_all_batches(exe.run, graph, golden, tol)  # second round replays the captured graphs
    assert exe.stats["captures"] == len(golden) and exe.stats["replays"] == 2 * len(golden)


def test_cuda_gpu_identity_is_a_gfd_label(gpu: CudaRuntime) -> None:
    ident = gpu.identity()
    assert " " not in ident.gpu_product and ident.backend_version.startswith("cupy")
    assert re.fullmatch(r"\d+\.\d+", ident.compute_capability or "")  # e.g. "9.0"
