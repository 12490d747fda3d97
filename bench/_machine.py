"""Where a number was measured: the CPU model, its vector ISA and the one oneDNN dispatches to.

Every bench prints this with its results, since the same cell can flip between an AVX2 and an
AVX-512 machine of the same cloud family."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

# /proc/cpuinfo flag -> the name a reader looks for, widest last within each family
_ISA_FLAGS = (("avx2", "AVX2"), ("avx_vnni", "AVX-VNNI"), ("avx512f", "AVX-512"), ("avx512_vnni", "VNNI"),
              ("avx512_bf16", "BF16"), ("amx_tile", "AMX"))


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """The first processor's model name and flags (all processors of a VM report the same)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields.get("model name") or platform.processor() or "unknown CPU", frozenset(fields.get("flags", "").split())


def cpu_model() -> str:
    return _cpuinfo()[0]


def isa_features() -> str:
    """The vector extensions this CPU has that change which kernels run: 'AVX2 AVX-512 VNNI'."""
    flags = _cpuinfo()[1]
    return " ".join(name for flag, name in _ISA_FLAGS if flag in flags) or "no AVX2"


def onednn_isa() -> str:
    try:
        from kubetrt.runtime.kernels import onednn

        return onednn.isa_name() if onednn.AVAILABLE else "oneDNN not installed"
    except Exception as err:  # noqa: BLE001 - the line says why the ISA is unknown
        return f"unknown ({type(err).__name__})"


def cpu_line() -> str:
    """The header line: model, cores, the CPU's extensions and oneDNN's dispatch."""
    return f"CPU: {cpu_model()}, {os.cpu_count()} cores, {isa_features()}; oneDNN ISA {onednn_isa()}"


def cpu_tag(note: str = "") -> str:
    """The short form each result line carries: '[AMD EPYC | avx512_core_bf16]', with `note` as one
    more field where given ('kubetrt at avx2')."""
    return f"[{cpu_model()} | {onednn_isa()}{f' | {note}' if note else ''}]"


def device_line(device: str) -> str:
    """What a device runtime reports about this node: 'cuda: NVIDIA-H100-80GB-HBM3, cc 9.0, cupy...'."""
    try:
        from kubetrt.runtime.devices import node_identity

        ident = node_identity(device)
        return f"{device}: {ident.gpu_product}, cc {ident.compute_capability}, {ident.backend_version}"
    except Exception as err:  # noqa: BLE001 - the line says why the device is unknown
        return f"{device}: unknown ({type(err).__name__}: {err})"


def bench_cache() -> Path:
    """Where the benches keep what they install and build once (the peers' venvs, load generators,
    capped runtimes); bench/peers/setup.sh reads the same variable with the same default."""
    return Path(os.environ.get("KUBETRT_BENCH_CACHE") or Path.home() / ".cache" / "kubetrt-bench")


ISA_CAPS = ("native", "avx2")

_WIDER_THAN_AVX2 = ("avx512", "amx", "avx10")  # LLVM feature names of the vector sets above AVX2


def isa_cap_env(cap: str) -> dict[str, str]:
    """The environment that keeps kubetrt's kernels to `cap` on a CPU with more: oneDNN's dispatch,
    numba's code generation (the runtime's own kernels), oneMKL's and NumPy's. With it an AVX-512
    machine runs the code an AVX2 one would (on AMD Zen 4 at the same FMA width), so the AVX2
    kernels can be measured where no AVX2-only machine is at hand. Empty for 'native'."""
    if cap == "native":
        return {}
    onednn = onednn_cap_env(cap)  # checks the cap's name
    import llvmlite.binding as llvm
    from numpy._core import _multiarray_umath as numpy_dispatch

    features = ",".join(("-" + f[1:]) if f[0] == "+" and f[1:].startswith(_WIDER_THAN_AVX2) else f
                        for f in llvm.get_host_cpu_features().flatten().split(","))
    wider = [name for name in numpy_dispatch.__cpu_dispatch__ if name == "X86_V4" or name.startswith("AVX512")]
    return {**onednn, "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "NUMBA_CPU_NAME": "znver2" if "AMD" in cpu_model() else "haswell", "NUMBA_CPU_FEATURES": features,
            "NPY_DISABLE_CPU_FEATURES": " ".join(wider)}


def onednn_cap_env(cap: str) -> dict[str, str]:
    """The environment that keeps oneDNN's dispatch to `cap`: kubetrt's, and OpenVINO's whole CPU
    plugin, whose primitives and own JIT kernels dispatch through the oneDNN it carries, which reads
    the same variable. With it OpenVINO runs the code an AVX2 machine would. Empty for 'native'."""
    if cap == "native":
        return {}
    if cap != "avx2":
        raise ValueError(f"ISA cap {cap!r}: expected one of {', '.join(ISA_CAPS)}")
    return {"ONEDNN_MAX_CPU_ISA": "AVX2"}


# onnxruntime has no switch: its MLAS and cpuinfo read CPUID and XCR0 themselves. XCR0 (xgetbv)
# says which register state the OS saves; without the opmask and ZMM bits no AVX-512 kernel may
# run, whatever CPUID says, so a copy of the package whose code reads XCR0 as x87|SSE|AVX takes the
# AVX2 paths an AVX2 machine takes (AVX2 with FMA, no VNNI). Each `xgetbv` (3 bytes) becomes
# `lea eax, [rcx + 7]` (3 bytes): ECX holds the register's index, 0 for XCR0, so EAX = 7.
_XGETBV = b"\x0f\x01\xd0"
_XCR0_AVX = b"\x8d\x41\x07"
ISA_CAP_MARK = "ISA_CAP"  # in a capped package's folder: the cap it was made for


def xgetbv_sites(disassembly: str, headers: str) -> list[int]:
    """File offsets of the xgetbv instructions `objdump -d --no-show-raw-insn` found, mapped
    through the section table `objdump -h` printed (VMA -> file offset)."""
    sections = [(int(vma, 16), int(size, 16), int(off, 16)) for size, vma, off in
                re.findall(r"^\s*\d+\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)\s+[0-9a-f]+\s+([0-9a-f]+)", headers, re.M)]
    sites = []
    for addr in (int(a, 16) for a in re.findall(r"^\s*([0-9a-f]+):\s+xgetbv\s*$", disassembly, re.M)):
        vma, _, off = next(s for s in sections if s[0] <= addr < s[0] + s[1])
        sites.append(addr - vma + off)
    return sites


def xcr0_capped(code: bytes, sites: list[int], xcr0: bytes = _XCR0_AVX) -> bytes:
    """`code` with the xgetbv at each of `sites` reading XCR0 as x87|SSE|AVX (`xcr0`: the
    instruction that stands in); ValueError naming a site that holds no xgetbv."""
    out = bytearray(code)
    for at in sites:
        if code[at:at + 3] != _XGETBV:
            raise ValueError(f"offset {at:#x}: expected xgetbv (0f 01 d0), found {code[at:at + 3].hex(' ')}")
        out[at:at + 3] = xcr0
    return bytes(out)


def _objdump(flags: list[str], path: Path) -> str:
    try:
        return subprocess.run(["objdump", *flags, str(path)], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        raise RuntimeError("capping onnxruntime needs objdump (Debian's binutils) to find its xgetbv instructions") from None


def onnxruntime_cap_env(cap: str, cache: Path | None = None) -> dict[str, str]:
    """The environment that keeps onnxruntime to `cap`: PYTHONPATH led by a copy of the installed
    package whose shared objects read XCR0 as an OS without AVX-512 state would report it (made
    once per version under the bench cache, written aside and renamed into place). Empty for
    'native'."""
    onednn_cap_env(cap)  # checks the cap's name
    if cap == "native":
        return {}
    import importlib.util

    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("onnxruntime is not installed: nothing to cap")
    package = Path(next(iter(spec.submodule_search_locations)))
    from importlib.metadata import version

    root = (cache or bench_cache()) / "isa-caps" / f"onnxruntime-{version('onnxruntime')}-{cap}"
    if not (root / "onnxruntime" / ISA_CAP_MARK).is_file():
        root.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}-"))
        try:
            copy = shutil.copytree(package, work / "onnxruntime", ignore=shutil.ignore_patterns("__pycache__"))
            capped = 0
            for lib in sorted(copy.rglob("*.so*")):
                sites = xgetbv_sites(_objdump(["-d", "--no-show-raw-insn"], lib), _objdump(["-h"], lib))
                if sites:
                    lib.write_bytes(xcr0_capped(lib.read_bytes(), sites))
                    capped += len(sites)
            if not capped:
                raise RuntimeError(f"found no xgetbv in {package}'s shared objects: nothing there reads XCR0 to cap")
            (copy / ISA_CAP_MARK).write_text(cap)
            shutil.rmtree(root, ignore_errors=True)
            work.rename(root)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return {"PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}


ONNXRUNTIME_RUNTIMES = ("onnxruntime", "onnxruntime-int8")


def cap_envs(cap: str, runtimes: Iterable[str], kubetrt: tuple[str, ...] = ("kubetrt",)) -> dict[str, dict[str, str]]:
    """For each of the `runtimes` a bench runs (`kubetrt`: the names its kubetrt workers go by), the
    environment that keeps it to `cap`: kubetrt's whole (isa_cap_env), OpenVINO's oneDNN
    (onednn_cap_env), onnxruntime's XCR0 (onnxruntime_cap_env, whose copy is made only where
    onnxruntime runs); TensorFlow has none."""
    mine = isa_cap_env(cap)  # also checks the cap's name
    ort: dict[str, str] | None = None  # one copy serves onnxruntime and its int8 twin
    envs: dict[str, dict[str, str]] = {}
    for name in runtimes:
        if name in kubetrt:
            envs[name] = mine
        elif name == "openvino":
            envs[name] = onednn_cap_env(cap)
        elif name in ONNXRUNTIME_RUNTIMES:
            ort = ort if ort is not None else onnxruntime_cap_env(cap)
            envs[name] = ort
    return envs


def openvino_isa(compiled: Any) -> str:
    """The vector ISA of a compiled OpenVINO model's kernels, read from the implementation names of
    its runtime graph (brgconv_avx512_1x1_f32, jit_avx2_f32, ...): the one most of them use, and
    the others with their counts ('avx2 + avx512 x1': a kernel that ignores the cap); 'none' where
    every kernel is reference or plain C++."""
    names = [op.get_rt_info()["primitiveType"].astype(str) for op in compiled.get_runtime_model().get_ops()]
    counts = Counter(next((isa for isa in ("amx", "avx512", "avx2") if f"_{isa}" in name), "") for name in names)
    counts.pop("", None)
    if not counts:
        return "none"
    (main, _), *others = counts.most_common()
    return " + ".join([main, *(f"{isa} x{n}" for isa, n in others)])
