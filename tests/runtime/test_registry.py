"""One kernel registry across devices: an op has one shape function and its operand roles,
whichever device runs it; each device adds kernels for ops the host defines."""
from __future__ import annotations

import numpy as np
import pytest

from kubetrt.runtime import UnsupportedOpError
from kubetrt.runtime.kernels import cuda
from kubetrt.runtime.kernels.registry import KernelSpec, lookup, op_def, register_device, supported_ops


def test_cuda_kernels_share_the_ops_shape_functions() -> None:
    cuda_ops = supported_ops("cuda")
    assert {"Conv", "FusedMatMul", "Relu", "Reshape", "Softmax"} <= set(cuda_ops)
    assert set(cuda_ops) <= set(supported_ops())
    for op in cuda_ops:
        assert lookup(op, "cuda").shape_fn is lookup(op).shape_fn, op


def test_device_kernels_need_an_op_the_host_defines() -> None:
    with pytest.raises(ValueError, match="NoSuchOp: no such op is defined"):
        register_device("NoSuchOp", "cuda")
    with pytest.raises(ValueError, match="host kernels define their ops"):
        register_device("Relu", "host")
    assert "NoSuchOp" not in supported_ops("cuda")


def test_an_op_without_a_cuda_kernel_is_an_unsupported_op_error() -> None:
    with pytest.raises(UnsupportedOpError, match=r"node 'k': op TopK has no kernel on device cuda; supported: .*Relu"):
        lookup("TopK", "cuda", node="k")


def test_operand_roles_are_the_ops_own() -> None:
    assert op_def("Reshape").params == frozenset({1}) and not op_def("Reshape").shape_only
    assert op_def("Shape").shape_only and op_def("Size").shape_only
    assert op_def("Relu").params == frozenset()
    with pytest.raises(UnsupportedOpError, match="op NoSuchOp is not defined"):
        op_def("NoSuchOp")


def test_cuda_kernels_take_their_device_context_from_the_spec() -> None:
    x = np.array([[-1.0, 2.0]], np.float32)
    spec = KernelSpec("Relu", "r", {}, [None], [x.shape], [x.dtype], present=[True])
    with pytest.raises(TypeError, match="Relu r: a cuda kernel needs spec.ctx to be a DeviceContext, got NoneType"):
        lookup("Relu", "cuda").factory(spec)
    spec.ctx = cuda.DeviceContext(xp=np)
    (y,) = lookup("Relu", "cuda").factory(spec)(x)
    np.testing.assert_array_equal(y, [[0.0, 2.0]])
