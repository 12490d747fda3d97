"""operators/names.py: one dns_label for every derived name, accepted by the CRD schema; stdlib only."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubetrt.operators import crds, names
from kubetrt.operators.names import DNS_LABEL_MAX, DNS_LABEL_PATTERN, TARGET_NAME_MAX, dns_label

from operator_testlib import md_body

ODD = ["My Model", "ResNet50_v1.5", "9lives", "--edge--", "Ünïcode naïve", "a..b", "  spaced  out ",
       "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb", "x" * 200, "0" * 70, "UPPER/lower:mixed@1"]


def valid(label: str, max_len: int = DNS_LABEL_MAX) -> bool:
    return bool(re.fullmatch(DNS_LABEL_PATTERN, label)) and len(label) <= max_len


@pytest.mark.parametrize("text", ODD)
@pytest.mark.parametrize("max_len", [TARGET_NAME_MAX, DNS_LABEL_MAX])
def test_odd_inputs_give_valid_labels(text: str, max_len: int) -> None:
    assert valid(dns_label(text, max_len=max_len), max_len)
    assert valid(dns_label(text, "target", max_len=max_len), max_len)


def test_labels_are_readable_and_stable() -> None:
    assert dns_label("NVIDIA-H100-80GB-HBM3") == "nvidia-h100-80gb-hbm3"
    assert dns_label("resnet", "h100") == "resnet-h100"
    assert dns_label("My Model!") == "my-model"
    assert dns_label("9lives") == "x-9lives"
    assert dns_label("model.v2") == "model-v2"
    # Pinned: the operator names live objects with it, so a new release must give the same names.
    assert dns_label("m" * 80, "target") == "m" * 54 + "-ddbef252"
    assert dns_label("m" * 80, "target") == dns_label("m" * 80, "target")


def test_long_names_stay_unique() -> None:
    base = "a-very-long-model-deployment-name-that-needs-shortening"
    labels = {dns_label(base, f"target-{i}") for i in range(500)}
    assert len(labels) == 500 and all(valid(label) for label in labels)
    # Inputs that clean to the same text still differ by their hash.
    assert dns_label("a_" * 40, max_len=TARGET_NAME_MAX) != dns_label("a." * 40, max_len=TARGET_NAME_MAX)
    assert len(dns_label("z" * 100, max_len=TARGET_NAME_MAX)) == TARGET_NAME_MAX


@pytest.mark.parametrize("parts", [(), ("",), ("---",), ("!!!", "..."), ("ÜÖ",)])
def test_nothing_usable_raises_naming_the_input(parts: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(parts))):
        dns_label(*parts)


@pytest.mark.parametrize("max_len", [0, 5, DNS_LABEL_MAX + 1])
def test_max_len_out_of_range_raises(max_len: int) -> None:
    with pytest.raises(ValueError, match="max_len"):
        dns_label("model", max_len=max_len)


@given(st.lists(st.text(max_size=80), min_size=1, max_size=3), st.integers(10, DNS_LABEL_MAX))
def test_any_input_gives_a_valid_label_or_value_error(parts: list[str], max_len: int) -> None:
    usable = re.search(r"[a-z0-9]", "".join(p.lower() for p in parts))
    try:
        label = dns_label(*parts, max_len=max_len)
    except ValueError:
        assert not usable
    else:
        assert usable and valid(label, max_len)


def test_crd_schema_accepts_what_dns_label_produces() -> None:
    schema = crds.object_schema(crds.model_deployment_crd())
    target_schema = schema["properties"]["spec"]["properties"]["targets"]["items"]["properties"]["name"]
    assert target_schema["pattern"] == DNS_LABEL_PATTERN and target_schema["maxLength"] == TARGET_NAME_MAX
    validator = jsonschema.Draft7Validator(schema)
    for text in ODD:
        body = md_body()
        body["spec"]["model"]["name"] = dns_label(text)
        body["spec"]["targets"][0]["name"] = dns_label(text, max_len=TARGET_NAME_MAX)
        validator.validate(body)


def test_names_imports_the_standard_library_only() -> None:
    tree = ast.parse(Path(names.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    code = "import sys, kubetrt.operators.names; print(sorted({'kopf', 'kubernetes', 'yaml'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_crds_and_pipeline_spell_the_api_through_names() -> None:
    from kubetrt.pipeline import deploy

    crd = crds.model_deployment_crd()
    assert crd["metadata"]["name"] == f"{names.PLURAL_MODEL_DEPLOYMENTS}.{names.GROUP}"
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (names.GROUP, names.KIND_MODEL_DEPLOYMENT)
    record = {"key": "k", "spec": "cuda@Tesla-T4:fp16:1/8/32", "gpu_product": "Tesla-T4", "backend": "cuda",
              "precision": "fp16", "model_digest": "sha256:" + "0" * 64, "uri": "file:///s/d/k"}
    md = deploy.model_deployment("My Model", "1", "/s/d/package", [record])
    assert (md["apiVersion"], md["kind"]) == (names.API_VERSION, names.KIND_MODEL_DEPLOYMENT)
    assert md["metadata"]["name"] == dns_label("My Model") and md["spec"]["targets"][0]["name"] == "tesla-t4"
    assert set(md["metadata"]["annotations"]) == {names.ANN_VERIFIED_ENGINES, names.ANN_MODEL_DIGEST}


def _spelled_names() -> tuple[tuple[str, ...], set[str]]:
    """What code must not spell itself: prefixes of kubetrt's and shared label keys, and the exact
    values names.py gives kinds, plurals and the operator's environment variables."""
    exact = {v for k, v in vars(names).items()
             if k.startswith(("KIND_", "PLURAL_", "ENV_")) and isinstance(v, str)}
    return ("kubetrt.io", "nvidia.com/", "app.kubernetes.io/"), exact


def test_kubernetes_names_are_spelled_only_in_names_py() -> None:
    """A second spelling of an API group, kind, label key or GPU label drifts; code imports names.py."""
    repo = Path(__file__).resolve().parents[2]
    prefixes, exact = _spelled_names()
    assert {"ModelDeployment", "enginebuilds", "KUBETRT_SERVING_IMAGE"} <= exact
    found = []
    for folder in ("kubetrt", "runtime", "serving", "pipeline", "operators", "cli", "telemetry"):
        for path in (repo / folder).rglob("*.py"):
            if path.name == "names.py" and path.parent.name == "operators":
                continue
            tree = ast.parse(path.read_text())
            docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
            for node in ast.walk(tree):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                        and (node.value in exact or any(s in node.value for s in prefixes))):
                    found.append(f"{path.relative_to(repo)}:{node.lineno}: {node.value!r}")
    assert not found, "spelled outside operators/names.py:\n" + "\n".join(found)


def test_operator_modules_do_not_load_the_runtime_to_name_a_target() -> None:
    """The operator builds target specs with kubetrt.runtime.target; that must not pull in NumPy,
    ONNX or Numba (the runtime's heavy exports load on first use)."""
    code = ("import sys, kubetrt.operators.handlers, kubetrt.operators.install, kubetrt.pipeline.deploy; "
            "print(sorted({'numpy', 'onnx', 'numba'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
    code = "from kubetrt.runtime import Model, TensorSpec, load_model, ops; print(callable(load_model), ops.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "True kubetrt.runtime.ops"
