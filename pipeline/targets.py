"""Target arguments and scheduling: the pipeline's view of runtime.target.

Two spellings reach `kubetrt build --target`: the spec string users write
(`tensorrt@NVIDIA-H100-80GB-HBM3:fp16:1/8/64`, parsed by runtime.target.parse_target) and the
key=value form the operator's EngineBuild Job passes
(`name=h100,backend=tensorrt,gpu-product=NVIDIA-H100-80GB-HBM3,precision=fp16,batch=1:8:64`).
Both become the same Target.
"""
from __future__ import annotations

from typing import Any

from kubetrt.operators.names import GPU_PRODUCT_LABEL, GPU_RESOURCE  # noqa: F401  (targets.GPU_* stay importable)
from kubetrt.runtime.target import CPU_PRODUCT, BatchProfile, Target, TargetError, parse_target

_KV_KEYS = {"name", "backend", "gpu-product", "cpu", "precision", "batch", "max-batch"}


def parse_target_arg(text: str) -> Target:
    """A spec string or the operator's key=value list -> Target; TargetError says what was expected."""
    if "=" not in text:
        return parse_target(text)
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep and k == "cpu":
            k, v = "cpu", "true"
        elif not sep or k not in _KV_KEYS:
            raise TargetError(
                f"target {text!r}: bad field {part!r}; expected comma-separated "
                f"{', '.join(sorted(_KV_KEYS))} (KEY=VALUE), or a spec like host or tensorrt@GPU:fp16:1/8/32"
            )
        fields[k] = v
    product = fields.get("gpu-product", CPU_PRODUCT)
    backend = fields.get("backend") or ("host" if product == CPU_PRODUCT else "tensorrt")
    profile = BatchProfile()
    if "batch" in fields:
        try:
            profile = BatchProfile(*(int(x) for x in fields["batch"].replace("/", ":").split(":")))
        except (TypeError, ValueError) as e:
            raise TargetError(f"target {text!r}: batch must be MIN:OPT:MAX ({e})") from e
    precision = fields.get("precision") or ("fp32" if backend == "host" else "fp16")
    return Target(backend=backend, gpu_product=product, precision=precision, profile=profile)


def plan_target(spec: str) -> dict[str, Any]:
    """How to schedule a build for `spec`: {"spec", "kind": "gpu"|"host", "node_selector": {...}}.

    The Kubeflow pipeline feeds node_selector to kfp-kubernetes (add_node_selector_json), so a
    GPU build lands on a node whose GPU Feature Discovery label matches the target.
    """
    t = parse_target_arg(spec)
    if not t.is_gpu:
        return {"spec": t.spec(), "kind": "host", "node_selector": {}}
    return {"spec": t.spec(), "kind": "gpu", "node_selector": {GPU_PRODUCT_LABEL: t.gpu_product}}
