"""Targets and engine keys.

A target spec is what a user asks for (GPU product, backend, precision, batch profile); a resolved
target adds what only the build node knows (compute capability, backend library version). The key
of a resolved target names everything an engine depends on, so an engine is never loaded where its
key differs from the node's.

A target is written two ways, both defined here and nowhere else: the spec string users and the
operator's build Job pass (`parse_target`, `Target.spec`), and the JSON object engine.json and
reports carry (`Target.to_json`, `Target.from_json`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Mapping

BACKENDS = ("host", "cuda", "tensorrt")
PRECISIONS = ("fp32", "fp16", "int8")
CPU_PRODUCT = "cpu"


class TargetError(ValueError):
    """A target spec is malformed, or an engine does not fit this node."""


@dataclass(frozen=True)
class BatchProfile:
    min: int = 1
    opt: int = 8
    max: int = 32

    def __post_init__(self) -> None:
        if not (1 <= self.min <= self.opt <= self.max):
            raise TargetError(
                f"batch profile {self.min}/{self.opt}/{self.max}: expected 1 <= min <= opt <= max"
            )

    def __str__(self) -> str:
        return f"{self.min}/{self.opt}/{self.max}"


@dataclass(frozen=True)
class Target:
    backend: str = "host"
    gpu_product: str = CPU_PRODUCT  # nvidia.com/gpu.product label value, or "cpu"
    precision: str = "fp32"
    profile: BatchProfile = BatchProfile()
    compute_capability: str | None = None  # "9.0"; resolved on the build node
    backend_version: str | None = None  # e.g. numpy / cupy / TensorRT version; resolved on the node

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise TargetError(f"backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.precision not in PRECISIONS:
            raise TargetError(f"precision {self.precision!r}: expected one of {', '.join(PRECISIONS)}")
        if self.backend == "host" and self.gpu_product != CPU_PRODUCT:
            raise TargetError(f"backend host runs on the CPU, but gpu product {self.gpu_product!r} was given")
        if self.backend != "host" and self.gpu_product == CPU_PRODUCT:
            raise TargetError(f"backend {self.backend} needs a GPU product (the GPU Feature Discovery product label value)")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.gpu_product):
            raise TargetError(f"gpu product {self.gpu_product!r}: expected a GPU Feature Discovery label value")

    @property
    def is_gpu(self) -> bool:
        return self.backend != "host"

    @property
    def resolved(self) -> bool:
        return self.backend_version is not None and (not self.is_gpu or self.compute_capability is not None)

    def resolve(self, compute_capability: str | None, backend_version: str) -> "Target":
        return replace(self, compute_capability=compute_capability, backend_version=backend_version)

    def spec(self) -> str:
        """The user-facing spec string, parseable by `parse_target`."""
        product = "" if self.gpu_product == CPU_PRODUCT else f"@{self.gpu_product}"
        return f"{self.backend}{product}:{self.precision}:{self.profile}"

    def key(self) -> str:
        if not self.resolved:
            raise TargetError(f"target {self.spec()} is not resolved on a node yet: it has no engine key")
        cc = f"sm{self.compute_capability.replace('.', '')}" if self.compute_capability else "anycc"
        raw = (
            f"{self.backend}_{self.gpu_product}_{cc}_{self.backend_version}_{self.precision}"
            f"_b{self.profile.min}-{self.profile.opt}-{self.profile.max}"
        )
        return re.sub(r"[^A-Za-z0-9._-]", "-", raw).lower()

    def to_json(self) -> dict[str, object]:
        """The form engine.json and reports carry; `Target.from_json` reads it back."""
        return {
            "backend": self.backend,
            "gpu_product": self.gpu_product,
            "precision": self.precision,
            "profile": {"min": self.profile.min, "opt": self.profile.opt, "max": self.profile.max},
            "compute_capability": self.compute_capability,
            "backend_version": self.backend_version,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> "Target":
        """Inverse of `to_json`; an absent optional field takes the dataclass default."""
        if "backend" not in d:
            raise TargetError(f"target JSON {dict(d)!r}: expected a 'backend' field")
        profile = d.get("profile") or {}
        if not isinstance(profile, Mapping):
            raise TargetError(f"target JSON profile {profile!r}: expected an object with min, opt and max")
        return cls(
            backend=str(d["backend"]),
            gpu_product=str(d.get("gpu_product", CPU_PRODUCT)),
            precision=str(d.get("precision", "fp32")),
            profile=BatchProfile(**{k: _json_int(profile[k], k) for k in ("min", "opt", "max") if k in profile}),
            compute_capability=_json_optional_str(d.get("compute_capability")),
            backend_version=_json_optional_str(d.get("backend_version")),
        )


def _json_int(value: object, field: str) -> int:
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return int(value)
        except ValueError:
            pass
    raise TargetError(f"target JSON profile {field} {value!r}: expected an integer")


def _json_optional_str(value: object) -> str | None:
    return None if value is None else str(value)


_SPEC = re.compile(
    r"^(?P<backend>[a-z]+)(?:@(?P<product>[^:]+))?(?::(?P<precision>[a-z0-9]+))?(?::(?P<profile>[0-9/]+))?$"
)


def parse_target(spec: str) -> Target:
    """`host`, `host:fp32:1/8/32`, `tensorrt@NVIDIA-H100-80GB-HBM3:fp16:1/8/64`, `cuda@Tesla-T4:fp16`."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise TargetError(
            f"target spec {spec!r}: expected BACKEND[@GPU_PRODUCT][:PRECISION][:MIN/OPT/MAX], "
            "e.g. host or tensorrt@NVIDIA-H100-80GB-HBM3:fp16:1/8/64"
        )
    profile = BatchProfile()
    if m["profile"]:
        parts = m["profile"].split("/")
        if len(parts) != 3 or not all(parts):
            raise TargetError(f"target spec {spec!r}: batch profile must be MIN/OPT/MAX, got {m['profile']!r}")
        profile = BatchProfile(*(int(x) for x in parts))
    backend = m["backend"]
    default_precision = "fp32" if backend == "host" else "fp16"
    return Target(
        backend=backend,
        gpu_product=m["product"] or CPU_PRODUCT,
        precision=m["precision"] or default_precision,
        profile=profile,
    )
