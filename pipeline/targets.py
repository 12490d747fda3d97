"""Scheduling a target's build in the Kubeflow pipeline: where its build and verify tasks run.

Targets themselves are parsed and written by runtime/target.py only.
"""
from __future__ import annotations

from typing import Any

from kubetrt.operators.names import GPU_PRODUCT_LABEL
from kubetrt.runtime.target import parse_target


def plan_target(spec: str) -> dict[str, Any]:
    """How to schedule a build for `spec`: {"spec", "kind": "gpu"|"host", "node_selector": {...}}.

    The Kubeflow pipeline feeds node_selector to kfp-kubernetes (add_node_selector_json), so a
    GPU build lands on a node whose GPU Feature Discovery label matches the target.
    """
    t = parse_target(spec)
    if not t.is_gpu:
        return {"spec": t.spec(), "kind": "host", "node_selector": {}}
    return {"spec": t.spec(), "kind": "gpu", "node_selector": {GPU_PRODUCT_LABEL: t.gpu_product}}
