"""Convolutions and constant-weight matmuls through oneDNN when the `onednn` extra is installed;
the im2col/GEMM kernels otherwise.

Why: im2col + GEMM + a NumPy/numba epilogue writes every convolution's input several times over
and cannot fuse below a Python call per tile. oneDNN's kernels read NHWC directly, keep the
weights in the blocked layout they want (reordered once here, per shape), and apply bias, the
residual sum and the activation in registers. It is the library TensorFlow's own CPU kernels
use. The binding is plain ctypes over the stable C API (v3), enum values are looked
up by name through the library's own *2str functions, so no header is needed at run time.
KUBETRT_CONV=gemm turns it off.

Threads: oneDNN runs its OpenMP team inside each call (cheap hand-offs; a hop through the runtime's
Python pool costs more than most convolutions save by splitting), so these calls are not split
further by the runtime. The team, and when a call runs on a team of one, are omp.py's.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np

from . import activations, jit, omp
from .activations import Act, Eltwise
from .buffers import aligned
from .native import load_first
from .omp import TeamChoice, TeamOf

_F32 = np.dtype(np.float32)
_MAX_DIMS = 12
_Dims = ctypes.c_int64 * _MAX_DIMS
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS, _ARG_BIAS, _ARG_SCRATCHPAD = 1, 17, 33, 41, 80
_ARG_FROM, _ARG_TO = _ARG_SRC, _ARG_DST
_ARG_ATTR_SCALES = 4096  # | the argument it scales
MIN_DENSE_MACS = 1 << 16  # below this a oneDNN matmul call costs more than NumPy's
_QUERY_IMPL_INFO_STR, _QUERY_SCRATCHPAD_MD, _QUERY_EXEC_ARG_MD = 8, 136, 255
_PLAIN, _BLOCKED, _NCHW_TO_BLOCKED = range(3)  # a convolution's source -> destination layouts
BLOCKED_ENV = "KUBETRT_BLOCKED_MIN_BATCH"
NEVER = 1 << 62  # a BLOCKED_MIN_BATCH no batch reaches


def blocked_min_batch(env: Any) -> int:
    """The smallest batch whose activations take the blocked layout: BLOCKED_ENV, else none (why:
    the comment at BLOCK below); 0 keeps every batch NHWC."""
    text = env.get(BLOCKED_ENV, "").strip()
    if not text:
        return NEVER
    if not text.isdigit():
        raise ValueError(f"{BLOCKED_ENV}={text!r}: expected a batch size (0 keeps every batch NHWC)")
    return int(text) or NEVER


def blocked_shape(nhwc: tuple[int, ...]) -> tuple[int, ...]:
    n, h, w, c = nhwc
    return (n, c // BLOCK, h, w, BLOCK)


def unblocked_shape(blocked: tuple[int, ...]) -> tuple[int, int, int, int]:
    n, cb, h, w, b = blocked
    return (n, h, w, cb * b)


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


def _load() -> ctypes.CDLL | None:
    if os.environ.get("KUBETRT_CONV", "auto").lower() == "gemm":
        return None
    lib = load_first(("libdnnl.so.3",))
    if lib is None:
        return None
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    pp = ctypes.POINTER(ctypes.c_void_p)
    signatures: dict[str, tuple[list[Any], Any]] = {
        "dnnl_engine_create": ([pp, i, ctypes.c_size_t], i),
        "dnnl_stream_create": ([pp, p, ctypes.c_uint], i),
        "dnnl_stream_wait": ([p], i),
        "dnnl_stream_destroy": ([p], i),
        "dnnl_memory_desc_create_with_tag": ([pp, i, _Dims, i, i], i),
        "dnnl_memory_desc_clone": ([pp, p], i),
        "dnnl_memory_desc_destroy": ([p], i),
        "dnnl_memory_desc_get_size": ([p], ctypes.c_size_t),
        "dnnl_memory_desc_equal": ([p, p], i),
        "dnnl_memory_create": ([pp, p, p, p], i),
        "dnnl_memory_destroy": ([p], i),
        "dnnl_memory_set_data_handle": ([p, p], i),
        "dnnl_primitive_attr_create": ([pp], i),
        "dnnl_primitive_attr_destroy": ([p], i),
        "dnnl_primitive_attr_set_scratchpad_mode": ([p, i], i),
        "dnnl_primitive_attr_set_post_ops": ([p, p], i),
        "dnnl_primitive_attr_set_scales_mask": ([p, i, i], i),
        "dnnl_get_effective_cpu_isa": ([], i),
        "dnnl_post_ops_create": ([pp], i),
        "dnnl_post_ops_destroy": ([p], i),
        "dnnl_post_ops_append_sum": ([p, f, ctypes.c_int32, i], i),
        "dnnl_post_ops_append_eltwise": ([p, i, f, f], i),
        "dnnl_convolution_forward_primitive_desc_create": ([pp, p, i, i, p, p, p, p, _Dims, _Dims, _Dims, _Dims, p], i),
        "dnnl_matmul_primitive_desc_create": ([pp, p, p, p, p, p, p], i),
        "dnnl_inner_product_forward_primitive_desc_create": ([pp, p, i, p, p, p, p, p], i),
        "dnnl_primitive_desc_query": ([p, i, i, p], i),
        "dnnl_primitive_desc_next_impl": ([p], i),
        "dnnl_pooling_forward_primitive_desc_create": ([pp, p, i, i, p, p, _Dims, _Dims, _Dims, _Dims, _Dims, p], i),
        "dnnl_reorder_primitive_desc_create": ([pp, p, p, p, p, p], i),
        "dnnl_primitive_desc_query_md": ([p, i, i], p),
        "dnnl_primitive_desc_destroy": ([p], i),
        "dnnl_primitive_create": ([pp, p], i),
        "dnnl_primitive_execute": ([p, p, i, ctypes.POINTER(_ExecArg)], i),
        "dnnl_primitive_destroy": ([p], i),
    }
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    for name in ("dnnl_status2str", "dnnl_fmt_tag2str", "dnnl_alg_kind2str", "dnnl_prop_kind2str", "dnnl_dt2str",
                 "dnnl_engine_kind2str", "dnnl_scratchpad_mode2str"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [i], ctypes.c_char_p
    return lib


_lib = _load()
AVAILABLE = _lib is not None


def _way(choice: TeamChoice) -> tuple[bool, TeamChoice | None]:
    """This call's way: whether it runs single-threaded, and the choice to time it for (None where
    the choice leaves a short team call untimed)."""
    if choice.untimed():
        return False, None
    return choice.pick(), choice


def _execute(prim: "_Primitive", src: np.ndarray, dst: np.ndarray, consts: list[int], serial: bool, choice: TeamChoice | None) -> None:
    """Run a source-to-destination primitive (a single-threaded one under a team of one), timed for
    `choice` (None: a call the choice left untimed)."""
    if choice is None:
        prim.execute_io(src, dst, consts)
        return
    start = time.perf_counter()
    if serial:
        with TeamOf(1):
            prim.execute_io(src, dst, consts)
    else:
        prim.execute_io(src, dst, consts)
    choice.record(serial, time.perf_counter() - start)


_ISA_VNNI = (0x8, 0x40)  # dnnl_cpu_isa_t bits of avx2_vnni(_2) and avx512_core_vnni and their successors
_ISA = _lib.dnnl_get_effective_cpu_isa() if _lib is not None else 0
# Integer dot products without int16 intermediates (VNNI): no saturation for any int8 operands.
EXACT_INT8 = any(_ISA & bit for bit in _ISA_VNNI)
BF16 = bool(_ISA & 0x80) or _ISA == 0x1F  # avx512_core_bf16 and its successors, or avx2_vnni_2
_ISA_AVX512 = 0x20  # dnnl_cpu_isa_t bit of avx512_core, set in all its successors
BLOCK_ENV = "KUBETRT_CHANNEL_BLOCK"


def channel_block(env: Any, isa: int) -> int:
    """Channels per block of the blocked activation layout: BLOCK_ENV, else the vector width of the
    instruction set oneDNN runs (16 floats on AVX-512, 8 on AVX2), the one its direct and depthwise
    kernels for that set are written for: given blocks of 8 on AVX-512, it runs its AVX2 kernels."""
    text = env.get(BLOCK_ENV, "").strip()
    if not text:
        return 16 if isa & _ISA_AVX512 else 8
    if text not in ("8", "16"):
        raise ValueError(f"{BLOCK_ENV}={text!r}: expected 8 or 16 channels per block")
    return int(text)


# The blocked activation layout (nChw16c or nChw8c): channels in blocks of BLOCK innermost, as (N,
# C/BLOCK, H, W, BLOCK) arrays, taken from BLOCKED_MIN_BATCH images up (KUBETRT_BLOCKED_MIN_BATCH;
# none by default). On AVX-512 its kernels are even with oneDNN's NHWC ones (brgconv, brdgmm) and
# the reorders into and out of a region are pure cost; on AVX2 its kernels led the NHWC ones at a
# served batch until Winograd's form, which only NHWC tensors take, reached the 3x3 layers.
BLOCK = channel_block(os.environ, _ISA)
BLOCKED_MIN_BATCH = blocked_min_batch(os.environ)
_ISA_NAMES = {0x7: "avx2", 0xF: "avx2_vnni", 0x1F: "avx2_vnni_2", 0x27: "avx512_core", 0x67: "avx512_core_vnni",
              0xE7: "avx512_core_bf16", 0x1EF: "avx10_1_512", 0xFEF: "avx512_core_amx", 0x1FEF: "avx512_core_amx_fp16"}


def isa_name() -> str:
    """The instruction set oneDNN dispatches to on this CPU, as oneDNN names it."""
    return _ISA_NAMES.get(_ISA, hex(_ISA))


def _enum(kind: str, name: str, limit: int = 1024) -> int:
    """An enum value by its name, as this build of the library spells it (values move between versions)."""
    to_str = getattr(_lib, f"dnnl_{kind}2str")
    for v in range(limit):
        if to_str(v) == name.encode():
            return v
    raise RuntimeError(f"oneDNN: no {kind} named {name!r} in this build")


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"oneDNN {what} failed: {_lib.dnnl_status2str(status).decode()}")  # type: ignore[union-attr]


class _Library:
    """Engine, enum values and one stream per thread (streams are not shared across threads)."""

    def __init__(self) -> None:
        self.f32 = _enum("dt", "f32")
        self.dtypes = {np.dtype(t): _enum("dt", n) for t, n in ((np.float32, "f32"), (np.int8, "s8"), (np.uint8, "u8"))}
        self.tag_any, self.tag_a, self.tag_ab, self.tag_ba = (_enum("fmt_tag", t) for t in ("any", "a", "ab", "ba"))
        self.tag_abcd, self.tag_acdb, self.tag_abcde = _enum("fmt_tag", "abcd"), _enum("fmt_tag", "acdb"), _enum("fmt_tag", "abcde")
        self.tag_cdba = _enum("fmt_tag", "cdba")  # OIHW dims stored HWIO: a 1x1 convolution's weights as a (C, O) matrix
        self.tag_blocked = _enum("fmt_tag", f"aBcd{BLOCK}b")  # NCHW with channels in blocks of BLOCK innermost
        self.inference = _enum("prop_kind", "forward_inference")
        self.conv_direct = _enum("alg_kind", "convolution_direct")
        self.scratchpad_user = _enum("scratchpad_mode", "user")
        self.engine = ctypes.c_void_p()
        check(_lib.dnnl_engine_create(ctypes.byref(self.engine), _enum("engine_kind", "cpu"), 0), "engine_create")  # type: ignore[union-attr]
        self._local = threading.local()
        self._alg_kinds: dict[str, int] = {}

    def alg_kind(self, name: str) -> int:
        """An eltwise algorithm by its name (e.g. eltwise_relu), looked up once."""
        if name not in self._alg_kinds:
            self._alg_kinds[name] = _enum("alg_kind", name)
        return self._alg_kinds[name]

    def stream(self) -> "Stream":
        """This thread's stream."""
        s = getattr(self._local, "stream", None)
        if s is None:
            s = self._local.stream = Stream()
        return s


_state: _Library | None = None
_state_lock = threading.Lock()


def _library() -> _Library:
    global _state
    if _state is not None:
        return _state
    with _state_lock:
        if _state is None:
            _state = _Library()
        return _state


def _md(dims: tuple[int, ...], dtype: int, tag: int) -> ctypes.c_void_p:
    md = ctypes.c_void_p()
    check(_lib.dnnl_memory_desc_create_with_tag(ctypes.byref(md), len(dims), _Dims(*dims), dtype, tag), "memory_desc_create")  # type: ignore[union-attr]
    return md


def _memory(md: Any, data: int) -> ctypes.c_void_p:
    mem = ctypes.c_void_p()
    check(_lib.dnnl_memory_create(ctypes.byref(mem), md, _library().engine, ctypes.c_void_p(data)), "memory_create")  # type: ignore[union-attr]
    return mem


class Stream:
    """A oneDNN stream: each thread runs its primitives on its own (streams are not shared across
    threads), and so does each of a chain's arenas (primitive_chain.py)."""

    def __init__(self) -> None:
        self.handle = ctypes.c_void_p()
        check(_lib.dnnl_stream_create(ctypes.byref(self.handle), _library().engine, 1), "stream_create")  # type: ignore[union-attr]

    def __del__(self) -> None:
        if _lib is not None and getattr(self, "handle", None):
            _lib.dnnl_stream_destroy(self.handle)


class Arguments:
    """A primitive's arguments bound to memory objects at `ptrs` (in the order of its slots), and
    its packed argument list: what one runner of it (a thread, a chain's arena) keeps. `scratch`
    is the runner's user scratchpad, never shared between concurrent calls."""

    def __init__(self, prim: "_Primitive", ptrs: list[int], scratch: np.ndarray | None, stream: Stream) -> None:
        slots = prim.slots + ([(_ARG_SCRATCHPAD, prim.scratch_md)] if scratch is not None else [])
        self.scratch = scratch
        self.mems = [_memory(md, ptr) for (_, md), ptr in zip(slots, ptrs + ([scratch.ctypes.data] if scratch is not None else []))]
        self.ptrs = list(ptrs)
        self.stream = stream
        self.packed = (_ExecArg * len(slots))(*[_ExecArg(a, m.value) for (a, _), m in zip(slots, self.mems)])
        # what _execute_io needs besides the two arrays, when slots 0 and 1 are source and destination:
        # one array, as a jitted call's dispatch costs per argument
        self.io = np.array([*C_FUNCTIONS, prim.handle.value or 0, stream.handle.value or 0, len(slots), ctypes.addressof(self.packed),
                            self.mems[0].value or 0, self.mems[1].value or 0], dtype=np.int64)

    def __del__(self) -> None:
        if _lib is not None:
            for m in self.mems:
                _lib.dnnl_memory_destroy(m)


if jit.AVAILABLE and _lib is not None:

    @jit.njit(cache=True, nogil=True)
    def _execute_io(io, src, dst):
        # One compiled call for what costs five Python-level ctypes calls: point the bound source
        # and destination memories at this call's arrays, execute, wait. io: the three functions,
        # then primitive, stream, argument count, packed arguments, source and destination memories.
        status = jit.c_call2(io[0], io[7], src.ctypes.data)
        if status == 0:
            status = jit.c_call2(io[0], io[8], dst.ctypes.data)
        if status == 0:
            status = jit.c_call4(io[1], io[3], io[4], io[5], io[6])
        if status == 0:
            status = jit.c_call1(io[2], io[4])
        return status

    # the library's entry points jitted callers take by address: set a memory's data pointer, execute, wait
    C_FUNCTIONS = tuple(ctypes.cast(getattr(_lib, name), ctypes.c_void_p).value or 0 for name in (
        "dnnl_memory_set_data_handle", "dnnl_primitive_execute", "dnnl_stream_wait"))
else:
    _execute_io = None
    C_FUNCTIONS = ()


class _Primitive:
    """A primitive and its argument slots; each thread binds its own memory objects once and then
    only swaps the data pointers that changed before executing: no per-call memory objects."""

    def __init__(self, pd: ctypes.c_void_p, args: list[int], own: list[tuple[int, Any]] | None = None) -> None:
        lib = _lib
        self.pd = pd
        self._own_mds = [md for _, md in own or []]  # descriptors this primitive made itself (scales)
        self.handle = ctypes.c_void_p()
        check(lib.dnnl_primitive_create(ctypes.byref(self.handle), pd), "primitive_create")  # type: ignore[union-attr]
        self.slots = [(a, lib.dnnl_primitive_desc_query_md(pd, _QUERY_EXEC_ARG_MD, a)) for a in args] + list(own or [])  # type: ignore[union-attr]
        self.scratch_md = lib.dnnl_primitive_desc_query_md(pd, _QUERY_SCRATCHPAD_MD, 0)  # type: ignore[union-attr]
        self.scratch_bytes = int(lib.dnnl_memory_desc_get_size(self.scratch_md)) if self.scratch_md else 0  # type: ignore[union-attr]
        self._local = threading.local()

    def md(self, arg: int) -> Any:
        return _lib.dnnl_primitive_desc_query_md(self.pd, _QUERY_EXEC_ARG_MD, arg)  # type: ignore[union-attr]

    @property
    def implementation(self) -> str:
        """The kernel oneDNN chose, as it names it (e.g. brgemm:avx2)."""
        return implementation_of(self.pd)

    def execute(self, ptrs: list[int]) -> None:
        """Run on this thread's stream with `ptrs` in the order of the slots given at creation."""
        lib = _lib
        bound: Arguments | None = getattr(self._local, "bound", None)
        if bound is None:
            stream = _library().stream()
            bound = self._local.bound = Arguments(self, ptrs, aligned(self.scratch_bytes) if self.scratch_bytes else None, stream)
        else:
            for i, ptr in enumerate(ptrs):
                if i < 2 or bound.ptrs[i] != ptr:  # execute_io moves slots 0 and 1 without updating ptrs
                    check(lib.dnnl_memory_set_data_handle(bound.mems[i], ptr), "memory_set_data_handle")  # type: ignore[union-attr]
                    bound.ptrs[i] = ptr
        check(lib.dnnl_primitive_execute(self.handle, bound.stream.handle, len(bound.packed), bound.packed), "primitive_execute")  # type: ignore[union-attr]
        check(lib.dnnl_stream_wait(bound.stream.handle), "stream_wait")  # type: ignore[union-attr]

    def execute_io(self, src: np.ndarray, dst: np.ndarray, consts: list[int]) -> None:
        """execute([src, dst, *consts]) where slots 0 and 1 are the source and destination and
        `consts` never change for this primitive: the per-call path."""
        bound: Arguments | None = getattr(self._local, "bound", None)
        if bound is None or _execute_io is None:
            self.execute([src.ctypes.data, dst.ctypes.data, *consts])
            return
        check(_execute_io(bound.io, src, dst), "primitive_execute")

    def __del__(self) -> None:
        if _lib is not None:
            self.__dict__.pop("_local", None)  # this primitive's per-thread memories go first
            _lib.dnnl_primitive_destroy(self.handle)
            _lib.dnnl_primitive_desc_destroy(self.pd)
            for md in self._own_mds:
                _lib.dnnl_memory_desc_destroy(md)


def activation_post_op(act: Act | None) -> Eltwise | None | bool:
    """The eltwise post-op (alg_kind name, alpha, beta) of a fused node's activation, from the
    activation table; None for no activation, False where oneDNN does not fuse it."""
    parsed = activations.parse(act)
    if parsed is None:
        return None
    entry, params = parsed
    post = None if entry.onednn is None else entry.onednn(params)
    return False if post is None else post


@dataclass(frozen=True)
class Quantized:
    """The integer side of a quantized convolution or matmul (explicit Q/DQ, symmetric: no zero
    points): int8/uint8 source, int8 weights with one scale per output channel, and a float32
    result or one requantized to int8/uint8 in the same call. A residual summed in place has
    the destination's width and its own scale."""

    src: np.dtype
    src_scale: float
    w_scales: np.ndarray
    dst: np.dtype = _F32
    dst_scale: float | None = None
    residual: np.dtype | None = None
    residual_scale: float = 1.0


class _FusedOp:
    """What Conv2D and Dense share: a primitive per input shape (created on first use), weights
    reordered once into each layout a primitive prefers, bias/residual-sum/activation post-ops,
    scales when quantized, and the call that writes the result into a fresh buffer or the dying
    residual's."""

    kind = "op"
    w_scale_mask = 1  # the weights' output-channel dim as a oneDNN mask bit

    def __init__(self, w: np.ndarray, w_dims: tuple[int, ...], w_tag: int, bias: np.ndarray | None,
                 activation: Eltwise | None, residual: bool, name: str, quant: Quantized | None = None) -> None:
        self.name = name
        self.quant = quant
        self.w = np.ascontiguousarray(w, dtype=np.int8 if quant is not None else np.float32)
        self.w_dims, self.w_tag = w_dims, w_tag
        self.bias = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        self.activation, self.residual = activation, residual
        self.src_dtype = np.dtype(quant.src) if quant is not None else _F32
        self.dst_dtype = np.dtype(quant.dst) if quant is not None else _F32
        self._scales: list[tuple[int, np.ndarray]] = [] if quant is None else [
            (_ARG_SRC, np.array([quant.src_scale], np.float32)),
            (_ARG_WEIGHTS, np.ascontiguousarray(quant.w_scales, dtype=np.float32).reshape(-1)),
        ] + ([] if quant.dst_scale is None else [(_ARG_DST, np.array([quant.dst_scale], np.float32))])
        self._shapes: dict[tuple[int, ...], tuple[_Primitive, list[int], np.ndarray]] = {}  # primitive, constant pointers, weights
        self._sites: dict[tuple[int, ...], Site] = {}
        self._weights: list[tuple[Any, np.ndarray]] = []  # (memory desc clone, reordered weights)
        self._lock = threading.Lock()

    def _dt(self, dtype: np.dtype) -> int:
        return _library().dtypes[np.dtype(dtype)]

    def _descriptor(self, key: tuple[int, ...], attr: ctypes.c_void_p) -> ctypes.c_void_p:
        raise NotImplementedError

    def _reordered(self, want_md: Any) -> np.ndarray:
        for md, buf in self._weights:
            if _lib.dnnl_memory_desc_equal(md, want_md):  # type: ignore[union-attr]
                return buf
        lib, st = _lib, _library()
        user_md = _md(self.w_dims, self._dt(self.w.dtype), self.w_tag)
        pd = ctypes.c_void_p()
        try:
            if lib.dnnl_memory_desc_equal(user_md, want_md):  # type: ignore[union-attr]
                buf = self.w  # the primitive reads the weights as they are: no second copy
            else:
                buf = aligned(int(lib.dnnl_memory_desc_get_size(want_md)))  # type: ignore[union-attr]
                check(lib.dnnl_reorder_primitive_desc_create(ctypes.byref(pd), user_md, st.engine, want_md, st.engine, None), "reorder")  # type: ignore[union-attr]
                _Primitive(pd, [_ARG_FROM, _ARG_TO]).execute([self.w.ctypes.data, buf.ctypes.data])
        finally:
            lib.dnnl_memory_desc_destroy(user_md)  # type: ignore[union-attr]
        kept = ctypes.c_void_p()
        check(lib.dnnl_memory_desc_clone(ctypes.byref(kept), want_md), "memory_desc_clone")  # type: ignore[union-attr]
        self._weights.append((kept, buf))
        return buf

    def _attributes(self, attr: ctypes.c_void_p, post: ctypes.c_void_p) -> None:
        lib, st = _lib, _library()
        check(lib.dnnl_primitive_attr_set_scratchpad_mode(attr, st.scratchpad_user), "scratchpad_mode")  # type: ignore[union-attr]
        for arg, values in self._scales:
            mask = 0 if arg != _ARG_WEIGHTS or values.size == 1 else self.w_scale_mask
            check(lib.dnnl_primitive_attr_set_scales_mask(attr, arg, mask), "scales_mask")  # type: ignore[union-attr]
        if self.residual:
            q = self.quant
            dt, scale = (self.dst_dtype, 1.0) if q is None or q.residual is None else (np.dtype(q.residual), q.residual_scale)
            check(lib.dnnl_post_ops_append_sum(post, scale, 0, self._dt(dt)), "post_ops sum")  # type: ignore[union-attr]
        if self.activation is not None:
            kind, alpha, beta = self.activation
            check(lib.dnnl_post_ops_append_eltwise(post, st.alg_kind(kind), alpha, beta), "post_ops eltwise")  # type: ignore[union-attr]
        check(lib.dnnl_primitive_attr_set_post_ops(attr, post), "set_post_ops")  # type: ignore[union-attr]

    def _primitive(self, key: tuple[int, ...], serial: bool = False) -> tuple[_Primitive, list[int], np.ndarray]:
        """The primitive for this input shape, made for a team of one where `serial`."""
        cached = key + (serial,)
        return self._shapes.get(cached) or _made_once(self._shapes, self._lock, cached, lambda: self._make(key, serial))

    def _make(self, key: tuple[int, ...], serial: bool) -> tuple[_Primitive, list[int], np.ndarray]:
        lib = _lib
        attr, post = ctypes.c_void_p(), ctypes.c_void_p()
        check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr_create")  # type: ignore[union-attr]
        check(lib.dnnl_post_ops_create(ctypes.byref(post)), "post_ops_create")  # type: ignore[union-attr]
        try:
            self._attributes(attr, post)
            with TeamOf(1 if serial else omp.TEAM):
                pd = self._descriptor(key, attr)
        finally:
            lib.dnnl_post_ops_destroy(post)  # type: ignore[union-attr]
            lib.dnnl_primitive_attr_destroy(attr)  # type: ignore[union-attr]
        scale_slots = [(_ARG_ATTR_SCALES | arg, _md((values.size,), _library().f32, _library().tag_a)) for arg, values in self._scales]
        with TeamOf(1 if serial else omp.TEAM):
            prim = _Primitive(pd, [_ARG_SRC, _ARG_DST, _ARG_WEIGHTS] + ([_ARG_BIAS] if self.bias is not None else []), scale_slots)
        weights = self._reordered(prim.md(_ARG_WEIGHTS))
        consts = [weights.ctypes.data] + ([self.bias.ctypes.data] if self.bias is not None else [])
        consts += [values.ctypes.data for _, values in self._scales]
        return (prim, consts, weights)

    def rows_of(self, key: tuple[int, ...]) -> "Rows | None":
        """Its rows' geometry for this input shape key where it may run in bands: None here, as a
        dense layer's rows are not an image's (Conv2D says otherwise)."""
        return None

    def implementation(self, key: tuple[int, ...]) -> str:
        """The kernel oneDNN runs for this input shape key (made now if it is not yet)."""
        return self._primitive(key)[0].implementation

    def _run(self, key: tuple[int, ...], x: np.ndarray, shape: tuple[int, ...], residual: np.ndarray | None, overwrite_residual: bool) -> np.ndarray:
        return _site(self, key, shape)(x, residual, overwrite_residual)

    def __del__(self) -> None:
        if _lib is not None:
            for md, _ in getattr(self, "_weights", ()):  # absent when construction failed
                _lib.dnnl_memory_desc_destroy(md)


def _site(op: Any, key: tuple[int, ...], shape: tuple[int, ...]) -> "Site":
    """op's call site for one input shape (`key`, the result's `shape`), made on its first call."""
    found: Site | None = op._sites.get(key)
    if found is None:
        found = op._sites.setdefault(key, Site(op, key, shape))
    return found


class Site:
    """One input shape of a fused op or a pooling, resolved once: its TeamChoice, its primitives (made on first
    use, per team size) and the result's shape. A kernel that keeps the site of each shape it sees
    calls it with no key, no lookups and no shape work: a plan's step costs the library call."""

    __slots__ = ("op", "key", "shape", "choice", "made")

    def __init__(self, op: Any, key: tuple[int, ...], shape: tuple[int, ...]) -> None:
        self.op, self.key, self.shape = op, key, shape
        self.choice = TeamChoice()
        self.made: list[tuple[_Primitive, list[int], np.ndarray | None] | None] = [None, None]  # for the team, for one thread

    @property
    def src_dtype(self) -> np.dtype:
        return np.dtype(self.op.src_dtype)

    @property
    def dst_dtype(self) -> np.dtype:
        return np.dtype(self.op.dst_dtype)

    def primitive(self, serial: bool) -> tuple[_Primitive, list[int], np.ndarray | None]:
        """The primitive for the team (or, `serial`, for one thread), its constant arguments'
        addresses and what keeps them alive; made on first use."""
        made = self.made[serial]
        if made is None:
            made = self.made[serial] = self.op._primitive(self.key, serial)
        return made

    def rows(self) -> Rows | None:
        """Its rows' geometry where it may run in bands (one float32 NHWC image), else None."""
        return self.op.rows_of(self.key)

    def band(self, ih: int, oh: int, pad_top: int, pad_bottom: int) -> tuple[_Primitive, list[int], np.ndarray | None]:
        """The one-thread primitive for a band of its rows: `oh` result rows from `ih` input rows,
        padded as the band's place in the image says."""
        return self.op._primitive(self.op.band_key(self.key, ih, oh, pad_top, pad_bottom), True)

    def __call__(self, x: np.ndarray, residual: np.ndarray | None = None, overwrite_residual: bool = False) -> np.ndarray:
        op = self.op
        if x.dtype != op.src_dtype:
            raise ValueError(f"{op.kind} {op.name}: expected a {op.src_dtype} input, got {x.dtype}")
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        serial, timed_for = _way(self.choice)
        made = self.made[serial] or self.primitive(serial)
        shape = self.shape
        if op.residual:
            if residual is None:
                raise ValueError(f"{op.kind} {op.name}: built with a residual sum, but no residual was passed")
            if residual.shape != shape or residual.dtype.itemsize != op.dst_dtype.itemsize:
                raise ValueError(f"{op.kind} {op.name}: residual {residual.dtype}{list(residual.shape)} does not fit "
                                 f"the output {op.dst_dtype}{list(shape)}")
            if overwrite_residual and residual.flags.writeable and residual.flags.c_contiguous and residual.dtype == op.dst_dtype:
                out = residual
            else:
                out = np.empty(shape, dtype=op.dst_dtype)
                np.copyto(out.view(residual.dtype), residual)
        else:
            out = np.empty(shape, dtype=op.dst_dtype)
        _execute(made[0], x, out, made[1], serial, timed_for)
        return out


def implementation_of(pd: ctypes.c_void_p) -> str:
    """The kernel a primitive descriptor stands at, as oneDNN names it (e.g. brgemm:avx2)."""
    name = ctypes.c_char_p()
    check(_lib.dnnl_primitive_desc_query(pd, _QUERY_IMPL_INFO_STR, 0, ctypes.byref(name)), "query impl_info_str")  # type: ignore[union-attr]
    return (name.value or b"").decode()


# oneDNN's first choice -> the kernel taken instead where oneDNN offers it for the same float32
# convolution. Depthwise: the direct kernel beat the batch-reduce one on every float32 shape of
# MobileNetV2 and EfficientNetB0 timed, NHWC at batch 1 and 32, ReLU and swish alike.
PREFERRED_OVER = {"brdgmm_dw:": "jit_dw:"}


def _preferred(made: Callable[[], ctypes.c_void_p]) -> ctypes.c_void_p:
    """made()'s descriptor, moved on to the implementation PREFERRED_OVER names where its first
    choice has one and a later implementation is it; otherwise as made."""
    pd = made()
    first = implementation_of(pd)
    want = next((w for f, w in PREFERRED_OVER.items() if first.startswith(f)), None)
    if want is None:
        return pd
    while _lib.dnnl_primitive_desc_next_impl(pd) == 0:  # type: ignore[union-attr]
        if implementation_of(pd).startswith(want):
            return pd
    _lib.dnnl_primitive_desc_destroy(pd)  # type: ignore[union-attr]  # walked past the end: start again
    return made()


def _descriptor_with(mds: list[ctypes.c_void_p | None], create: Any) -> ctypes.c_void_p:
    """create(pd_out, *mds) with the memory descriptors destroyed afterwards, success or not."""
    try:
        pd = ctypes.c_void_p()
        create(ctypes.byref(pd), *mds)
        return pd
    finally:
        for md in mds:
            if md is not None:
                _lib.dnnl_memory_desc_destroy(md)  # type: ignore[union-attr]


_T = TypeVar("_T")


def _made_once(cache: dict[tuple[Any, ...], _T], lock: threading.Lock, key: tuple[Any, ...], make: Callable[[], _T]) -> _T:
    """cache[key], made by `make` on first use: calls from several threads make it once. Callers
    look the key up themselves first, so a hit costs no call."""
    found = cache.get(key)
    if found is None:
        with lock:
            found = cache.get(key)
            if found is None:
                found = cache[key] = make()
    return found


@dataclass(frozen=True)
class Rows:
    """How one image's result rows (NHWC) depend on its input rows: what cutting a site into bands
    of rows, each run by one thread, needs (kernels/bands.py). `work`: multiply-adds (or reads, for
    a pooling) per result row, to weigh what the bands' overlap costs. `sums_into`: the result is
    summed onto what its destination holds (a residual), so no two bands may write one row.
    `activation`: the fused activation's oneDNN name, "" for none."""

    h: int
    oh: int
    kernel: int
    stride: int
    dilation: int
    pad_top: int
    in_row_bytes: int
    out_row_bytes: int
    work: int
    sums_into: bool = False
    activation: str = ""


class Conv2D(_FusedOp):
    """A 2-D convolution (NHWC or NCHW activations, ONNX OIHW weights), grouped or not: float32,
    or int8/uint8 x int8 with `quant`."""

    kind = "Conv"

    def __init__(self, w: np.ndarray, bias: np.ndarray | None, group: int, strides: list[int], dil: list[int],
                 activation: Eltwise | None, residual: bool, layout: str = "nhwc", name: str = "conv",
                 quant: Quantized | None = None, hwio_weights: bool = False) -> None:
        """hwio_weights: the primitives read weights stored HWIO (cdba) rather than in a layout of
        oneDNN's choosing, for a caller that writes them per call (gate_fold.py)."""
        st = _library()
        o, cg, kh, kw = w.shape
        dims, tag = ((o, cg, kh, kw), st.tag_abcd) if group == 1 else ((group, o // group, cg, kh, kw), st.tag_abcde)
        if hwio_weights and group != 1:
            raise ValueError(f"Conv {name}: HWIO weights are for ungrouped convolutions, got {group} groups")
        self.w_scale_mask = 1 if group == 1 else 3  # (O, ...) or (G, O/G, ...)
        super().__init__(w, dims, tag, bias, activation, residual, name, quant)
        self.nhwc = layout == "nhwc"
        self.group, self.strides, self.dil = group, list(strides), list(dil)
        self.weights_tag = st.tag_cdba if hwio_weights else st.tag_any

    def _descriptor(self, key: tuple[int, ...], attr: ctypes.c_void_p) -> ctypes.c_void_p:
        lib, st = _lib, _library()
        n, h, wd, oh, ow, pt, pl, pb, pr, layout = key
        o, cg = self.w.shape[:2]
        plain = st.tag_acdb if self.nhwc else st.tag_abcd
        src_tag, dst_tag = {_PLAIN: (plain, plain), _BLOCKED: (st.tag_blocked, st.tag_blocked), _NCHW_TO_BLOCKED: (st.tag_abcd, st.tag_blocked)}[layout]

        def mds() -> list[ctypes.c_void_p | None]:  # fresh each time: _descriptor_with destroys them
            return [_md((n, cg * self.group, h, wd), self._dt(self.src_dtype), src_tag), _md(self.w_dims, self._dt(self.w.dtype), self.weights_tag),
                    _md((o,), st.f32, st.tag_a) if self.bias is not None else None, _md((n, o, oh, ow), self._dt(self.dst_dtype), dst_tag)]

        def create(pd: Any, src: Any, w: Any, b: Any, dst: Any) -> None:
            check(lib.dnnl_convolution_forward_primitive_desc_create(  # type: ignore[union-attr]
                pd, st.engine, st.inference, st.conv_direct, src, w, b, dst, _Dims(*self.strides),
                _Dims(*[d - 1 for d in self.dil]), _Dims(pt, pl), _Dims(pb, pr), attr), "convolution")
        if self.quant is not None:  # the preferences were measured in float32
            return _descriptor_with(mds(), create)
        return _preferred(lambda: _descriptor_with(mds(), create))

    def rows_of(self, key: tuple[int, ...]) -> Rows | None:
        n, h, wd, oh, ow, pt, _, _, _, layout = key
        if n != 1 or layout != _PLAIN or not self.nhwc or self.quant is not None:  # bands are tested in float32
            return None
        o, cg, kh, kw = self.w.shape
        return Rows(h, oh, kh, self.strides[0], self.dil[0], pt, wd * cg * self.group * self.src_dtype.itemsize,
                    ow * o * self.dst_dtype.itemsize, ow * o * cg * kh * kw, self.residual,
                    "" if self.activation is None else self.activation[0])

    @staticmethod
    def band_key(key: tuple[int, ...], ih: int, oh: int, pad_top: int, pad_bottom: int) -> tuple[int, ...]:
        n, _, wd, _, ow, _, pl, _, pr, layout = key
        return (n, ih, wd, oh, ow, pad_top, pl, pad_bottom, pr, layout)

    def __call__(self, x: np.ndarray, oh: int, ow: int, pads_begin: list[int], pads_end: list[int],
                 residual: np.ndarray | None = None, overwrite_residual: bool = False, blocked_out: bool = False) -> np.ndarray:
        """y = act(conv(x) + bias [+ residual]) in this convolution's layout, or in the blocked one
        (see `blocked_shape`) when x is blocked, or with blocked_out, from an NHWC x of fewer
        channels than a block (an image's three): oneDNN's first-convolution kernels read those as
        NCHW and write blocks (given NHWC they fall back to reference code), so x is transposed
        first, a third of the traffic of reordering the result. With overwrite_residual the sum lands in the residual's
        own buffer (the executor says when it is dying)."""
        if x.dtype != self.src_dtype:
            raise ValueError(f"Conv {self.name}: expected a 4-D {self.src_dtype} input, got {x.dtype} of shape {x.shape}")
        return self.bind(x.shape, oh, ow, pads_begin, pads_end, blocked_out)(x, residual, overwrite_residual)

    def bind(self, x_shape: tuple[int, ...], oh: int, ow: int, pads_begin: list[int], pads_end: list[int],
             blocked_out: bool = False) -> Callable[..., np.ndarray]:
        """This convolution for inputs of one shape, as `call(x, residual=None, overwrite_residual=False)`:
        what a kernel keeps per shape it sees (see Site)."""
        blocked = self.nhwc and len(x_shape) == 5 and x_shape[-1] == BLOCK
        if len(x_shape) != 4 and not blocked:
            raise ValueError(f"Conv {self.name}: expected a 4-D {self.src_dtype} input, got shape {tuple(x_shape)}")
        n, h, wd, c = unblocked_shape(x_shape) if blocked else x_shape if self.nhwc else (x_shape[0], x_shape[2], x_shape[3], x_shape[1])
        o, cg = self.w.shape[:2]
        if c != cg * self.group:
            raise ValueError(f"Conv {self.name}: input has {c} channels, weights expect {cg * self.group}")
        transpose = blocked_out and self.nhwc and not blocked
        if (blocked or transpose) and o % BLOCK:
            raise ValueError(f"Conv {self.name}: a blocked result needs output channels in blocks of {BLOCK}, got {o}")
        if transpose and (self.residual or self.quant is not None):
            raise ValueError(f"Conv {self.name}: blocked_out is for float32 convolutions without a residual")
        shape = blocked_shape((n, oh, ow, o)) if blocked or transpose else (n, oh, ow, o) if self.nhwc else (n, o, oh, ow)
        layout = _BLOCKED if blocked else _NCHW_TO_BLOCKED if transpose else _PLAIN
        site = _site(self, (n, h, wd, oh, ow, pads_begin[0], pads_begin[1], pads_end[0], pads_end[1], layout), shape)
        if not transpose:
            return site

        def from_nhwc(x: np.ndarray, residual: None = None, overwrite_residual: bool = False) -> np.ndarray:
            return site(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
        return from_nhwc


class Dense(_FusedOp):
    """y = act(a @ w + bias [+ residual]) for a (..., K) and constant w (K, N): float32, or
    int8/uint8 x int8 with `quant`.

    Float32 runs as an inner product, not a matmul: for a constant weight matrix the inner product
    has brgemm kernels on AVX2 (weights packed once for them) where this library's matmul has only
    its generic GEMM, which is far slower at the row counts a served batch has. The weights are
    described as (N, K) in `ba` order, which is (K, N) row-major: the caller's array as it is."""

    kind = "MatMul"
    w_scale_mask = 2  # N, the second dim of (K, N)

    def __init__(self, w: np.ndarray, bias: np.ndarray | None, activation: Eltwise | None,
                 residual: bool, name: str = "matmul", quant: Quantized | None = None) -> None:
        st = _library()
        self.inner_product = quant is None
        k, n = w.shape
        dims, tag = ((n, k), st.tag_ba) if self.inner_product else ((k, n), st.tag_ab)
        super().__init__(w, dims, tag, bias, activation, residual, name, quant)
        self.k, self.n = k, n

    def _descriptor(self, key: tuple[int, ...], attr: ctypes.c_void_p) -> ctypes.c_void_p:
        lib, st = _lib, _library()
        (m,) = key
        k, n = self.k, self.n
        w_md = _md(self.w_dims, self._dt(self.w.dtype), st.tag_any)
        src_md, dst_md = _md((m, k), self._dt(self.src_dtype), st.tag_ab), _md((m, n), self._dt(self.dst_dtype), st.tag_ab)
        if self.inner_product:
            bias_md = _md((n,), st.f32, st.tag_a) if self.bias is not None else None

            def create(pd: Any, src: Any, w: Any, b: Any, dst: Any) -> None:
                check(lib.dnnl_inner_product_forward_primitive_desc_create(pd, st.engine, st.inference, src, w, b, dst, attr),  # type: ignore[union-attr]
                       "inner_product")
        else:
            bias_md = _md((1, n), st.f32, st.tag_ab) if self.bias is not None else None

            def create(pd: Any, src: Any, w: Any, b: Any, dst: Any) -> None:
                check(lib.dnnl_matmul_primitive_desc_create(pd, st.engine, src, w, b, dst, attr), "matmul")  # type: ignore[union-attr]
        return _descriptor_with([src_md, w_md, bias_md, dst_md], create)

    def site(self, rows: int) -> "Site":
        """The call site for `rows` rows of input: what a chain calls."""
        return _site(self, (rows,), (rows, self.n))

    def __call__(self, a: np.ndarray, residual: np.ndarray | None = None, overwrite_residual: bool = False) -> np.ndarray:
        k, n = self.k, self.n
        if a.dtype != self.src_dtype or a.ndim < 1 or a.shape[-1] != k:
            raise ValueError(f"MatMul {self.name}: expected a {self.src_dtype} input of shape [..., {k}], got {a.dtype} of shape {a.shape}")
        rows = np.ascontiguousarray(a).reshape(-1, k)
        return self._run((rows.shape[0],), rows, a.shape[:-1] + (n,), residual, overwrite_residual)


class BatchedMatmul(_FusedOp):
    """c[t] = a[t] @ w[t] for t in a batch of constant float32 matrices w (T, K, N): Winograd's 36
    products in one call (kernels/winograd.py). No bias or post-ops: the caller's transform adds them."""

    kind = "BatchedMatMul"

    def __init__(self, w: np.ndarray, name: str = "batched_matmul") -> None:
        super().__init__(w, tuple(w.shape), _enum("fmt_tag", "abc"), None, None, False, name)

    def _descriptor(self, key: tuple[int, ...], attr: ctypes.c_void_p) -> ctypes.c_void_p:
        lib, st = _lib, _library()
        (m,) = key
        t, k, n = self.w.shape
        abc = self.w_tag
        # the weights as they are: its kernels read them as fast as reordered (measured), and the
        # 36 transformed matrices, four times the layer's weights, are then held once
        mds = [_md((t, m, k), st.f32, abc), _md((t, k, n), st.f32, abc), None, _md((t, m, n), st.f32, abc)]

        def create(pd: Any, src: Any, w: Any, b: Any, dst: Any) -> None:
            check(lib.dnnl_matmul_primitive_desc_create(pd, st.engine, src, w, b, dst, attr), "matmul")  # type: ignore[union-attr]
        return _descriptor_with(mds, create)

    def primitive_for(self, rows: int) -> tuple[_Primitive, list[int], np.ndarray]:
        """The one-thread primitive for `rows` rows of each matrix (a team member's call)."""
        return self._primitive((rows,), True)


class Pool2D:
    """Max or average pooling of NHWC float32 (`algorithm`: pooling_max, pooling_avg_exclude_padding
    or pooling_avg_include_padding): oneDNN's kernels read the channels innermost in one pass."""

    kind, src_dtype, dst_dtype, residual = "Pool", _F32, _F32, False  # what a Site reads of its op

    def __init__(self, algorithm: str, kernel: tuple[int, ...], strides: list[int], dil: list[int], name: str = "pool") -> None:
        self.alg = _library().alg_kind(algorithm)
        self.kernel, self.strides, self.dil, self.name = list(kernel), list(strides), list(dil), name
        self._shapes: dict[tuple[int, ...], tuple[_Primitive, list[int], None]] = {}
        self._lock = threading.Lock()
        self._sites: dict[tuple[int, ...], Site] = {}

    def _primitive(self, key: tuple[int, ...], serial: bool) -> tuple[_Primitive, list[int], None]:
        cached = key + (serial,)
        return self._shapes.get(cached) or _made_once(self._shapes, self._lock, cached, lambda: (self._make(key, serial), [], None))

    def _make(self, key: tuple[int, ...], serial: bool) -> _Primitive:
        lib, st = _lib, _library()
        n, h, wd, c, oh, ow, pt, pl, pb, pr, blocked = key
        tag = st.tag_blocked if blocked else st.tag_acdb
        kernel = self.kernel if self.kernel else [h, wd]
        attr = ctypes.c_void_p()
        check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr_create")  # type: ignore[union-attr]
        try:
            check(lib.dnnl_primitive_attr_set_scratchpad_mode(attr, st.scratchpad_user), "scratchpad_mode")  # type: ignore[union-attr]

            def create(pd: Any, src: Any, dst: Any) -> None:
                check(lib.dnnl_pooling_forward_primitive_desc_create(  # type: ignore[union-attr]
                    pd, st.engine, st.inference, self.alg, src, dst, _Dims(*self.strides), _Dims(*kernel),
                    _Dims(*[d - 1 for d in self.dil]), _Dims(pt, pl), _Dims(pb, pr), attr), "pooling")
            with TeamOf(1 if serial else omp.TEAM):
                pd = _descriptor_with([_md((n, c, h, wd), st.f32, tag), _md((n, c, oh, ow), st.f32, tag)], create)
        finally:
            lib.dnnl_primitive_attr_destroy(attr)  # type: ignore[union-attr]
        with TeamOf(1 if serial else omp.TEAM):
            return _Primitive(pd, [_ARG_SRC, _ARG_DST])

    def rows_of(self, key: tuple[int, ...]) -> Rows | None:
        n, h, wd, c, oh, ow, pt, _, _, _, blocked = key
        if n != 1 or blocked or not self.kernel:
            return None
        kh, kw = self.kernel
        return Rows(h, oh, kh, self.strides[0], self.dil[0], pt, wd * c * 4, ow * c * 4, ow * c * kh * kw)

    @staticmethod
    def band_key(key: tuple[int, ...], ih: int, oh: int, pad_top: int, pad_bottom: int) -> tuple[int, ...]:
        n, _, wd, c, _, ow, _, pl, _, pr, blocked = key
        return (n, ih, wd, c, oh, ow, pad_top, pl, pad_bottom, pr, blocked)

    def __call__(self, x: np.ndarray, oh: int, ow: int, pads_begin: list[int], pads_end: list[int]) -> np.ndarray:
        """Pool an NHWC float32 tensor to (N, oh, ow, C), or a blocked one to its blocked result; an
        empty kernel pools each whole plane."""
        if x.dtype != _F32:
            raise ValueError(f"Pool {self.name}: expected a 4-D float32 NHWC input, got {x.dtype} of shape {x.shape}")
        return self.bind(x.shape, oh, ow, pads_begin, pads_end)(x)

    def bind(self, x_shape: tuple[int, ...], oh: int, ow: int, pads_begin: list[int], pads_end: list[int]) -> "Site":
        """This pooling for inputs of one shape: what a kernel keeps per shape it sees."""
        blocked = len(x_shape) == 5 and x_shape[-1] == BLOCK
        if len(x_shape) != 4 and not blocked:
            raise ValueError(f"Pool {self.name}: expected a 4-D float32 NHWC input, got shape {tuple(x_shape)}")
        n, h, wd, c = unblocked_shape(x_shape) if blocked else x_shape
        key = (n, h, wd, c, oh, ow, pads_begin[0], pads_begin[1], pads_end[0], pads_end[1], blocked)
        return _site(self, key, blocked_shape((n, oh, ow, c)) if blocked else (n, oh, ow, c))


class Reorder:
    """NHWC float32 <-> the blocked layout, one multithreaded pass (oneDNN's reorder)."""

    def __init__(self, to_blocked: bool) -> None:
        self.to_blocked = to_blocked
        self._shapes: dict[tuple[int, ...], _Primitive] = {}
        self._choices: dict[tuple[int, ...], TeamChoice] = {}
        self._lock = threading.Lock()

    def _primitive(self, key: tuple[int, ...], serial: bool) -> _Primitive:
        cached = key + (serial,)
        return self._shapes.get(cached) or _made_once(self._shapes, self._lock, cached, lambda: self._make(key, serial))

    def _make(self, key: tuple[int, ...], serial: bool) -> _Primitive:
        lib, st = _lib, _library()
        n, h, w, c = key
        src, dst = (st.tag_acdb, st.tag_blocked) if self.to_blocked else (st.tag_blocked, st.tag_acdb)
        with TeamOf(1 if serial else omp.TEAM):
            pd = _descriptor_with([_md((n, c, h, w), st.f32, src), _md((n, c, h, w), st.f32, dst)], lambda pd, s, d: check(
                lib.dnnl_reorder_primitive_desc_create(pd, s, st.engine, d, st.engine, None), "reorder"))  # type: ignore[union-attr]
            return _Primitive(pd, [_ARG_FROM, _ARG_TO])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.dtype != _F32 or x.ndim != (4 if self.to_blocked else 5) or x.shape[-1 if self.to_blocked else 4] % BLOCK:
            want = f"NHWC with channels in blocks of {BLOCK}" if self.to_blocked else f"blocked (N, C/{BLOCK}, H, W, {BLOCK})"
            raise ValueError(f"reorder: expected a float32 {want} tensor, got {x.dtype} of shape {list(x.shape)}")
        nhwc = x.shape if self.to_blocked else unblocked_shape(x.shape)
        out = np.empty(blocked_shape(nhwc) if self.to_blocked else nhwc, dtype=_F32)
        serial, timed_for = _way(omp.choice_for(self._choices, nhwc))
        _execute(self._primitive(tuple(nhwc), serial), np.ascontiguousarray(x), out, [], serial, timed_for)
        return out


def conv_applies(spec: Any, w: np.ndarray | None) -> bool:
    """Whether a (Fused)Conv node runs here: the library is loaded, weights and bias are constant
    float32, and oneDNN fuses its activation."""
    act = activation_post_op(spec.attrs.get("activation"))
    bias = spec.const(2) if spec.has(2) else None
    return AVAILABLE and w is not None and w.ndim == 4 and w.dtype == _F32 and act is not False and not (spec.has(2) and bias is None)


def conv_for_node(spec: Any, w: np.ndarray | None, layout: str) -> Conv2D | None:
    """The oneDNN convolution for a (Fused)Conv node, or None where it does not apply (conv_applies)."""
    if not conv_applies(spec, w):
        return None
    act = activation_post_op(spec.attrs.get("activation"))
    bias = spec.const(2) if spec.has(2) else None
    strides = list(spec.attr("strides") or [1, 1])
    dil = list(spec.attr("dilations") or [1, 1])
    return Conv2D(w, bias, spec.attr("group", 1), strides, dil, act, residual=spec.has(3), layout=layout, name=spec.name)  # type: ignore[arg-type]


def dense_for_node(spec: Any, w: np.ndarray | None) -> Dense | None:
    """The oneDNN matmul for a FusedMatMul node with constant 2-D float32 weights and bias, or None."""
    act = activation_post_op(spec.attrs.get("activation"))
    bias = spec.const(2) if spec.has(2) else None
    if not AVAILABLE or w is None or w.ndim != 2 or w.dtype != _F32 or act is False or (spec.has(2) and (bias is None or bias.ndim != 1)):
        return None
    return Dense(w, bias, act, residual=spec.has(3), name=spec.name)  # type: ignore[arg-type]
