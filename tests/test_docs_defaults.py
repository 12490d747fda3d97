"""The defaults the docs state are the code's: ARCHITECTURE.md's defaults table, row by row, against
the CRD schema, the CLI's parser and the serving Service the operator generates; and the defaults
README.md states in its prose. The CRD and CLI readers are tests/operators/test_defaults.py's, so
the docs are held to the same two sides that test holds to each other."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest

import file_modules
from kubetrt.operators import crds, names
from kubetrt.operators.objects import service
from kubetrt.runtime.target import parse_target

REPO = Path(__file__).resolve().parents[1]
defaults = file_modules.load("kubetrt_tests_operator_defaults", REPO / "tests" / "operators" / "test_defaults.py")
crd_default: Callable[[str], Any] = defaults.crd_default
cli_default: Callable[[tuple[str, ...], str], Any] = defaults.cli_default


def _rows() -> list[list[str]]:
    text = (REPO / "ARCHITECTURE.md").read_text()
    section = text[text.index("\n## Defaults\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| setting") and not line.startswith("| ---")]
    assert rows, "ARCHITECTURE.md has no defaults table"
    return rows


def _code(cell: str) -> str:
    m = re.search(r"`([^`]+)`", cell)
    assert m, f"no `code` in {cell!r}"
    return m.group(1)


def _service_port(name: str) -> int:
    md = {"apiVersion": names.API_VERSION, "kind": names.KIND_MODEL_DEPLOYMENT,
          "metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": {}}
    ports = {p["name"]: p["port"] for p in service(md)["spec"]["ports"]}
    return int(ports[name])


def model_deployment_default(cell: str) -> Any:
    """The default of the ModelDeployment side a table cell names."""
    if "Service" in cell:
        return _service_port(_code(cell))
    path = _code(cell)
    assert path.startswith("spec."), cell
    path = path[len("spec."):]
    if path == "targets[].precision":
        assert ("cpu: true" in cell) != ("gpuProduct" in cell), cell
        return crds.default_precision("cpu: true" in cell)
    if path == "optimization.batchProfile":
        return "/".join(str(crd_default(f"{path}.{k}")) for k in ("min", "opt", "max"))
    return crd_default(path)


def cli_side_default(cell: str) -> Any:
    """The default of the CLI side a table cell names: a flag's, or what a target spec leaves out."""
    words = _code(cell).split()
    if "--target" in words:
        spec = words[words.index("--target") + 1]
        if spec.endswith(":MIN/OPT/MAX"):
            profile = parse_target(spec.split(":")[0]).profile
            return f"{profile.min}/{profile.opt}/{profile.max}"
        return parse_target(spec.replace("@GPU", "@Tesla-T4")).precision
    assert words[0] == "kubetrt" and words[-1].startswith("--"), cell
    return cli_default(tuple(words[1:-1]), words[-1])


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r[0])
def test_architecture_defaults_table(row: list[str]) -> None:
    setting, md_cell, cli_cell, documented = row
    stated = _code(documented)
    assert str(model_deployment_default(md_cell)) == stated, f"{setting}: {md_cell} vs the docs' {stated}"
    assert str(cli_side_default(cli_cell)) == stated, f"{setting}: {cli_cell} vs the docs' {stated}"


def test_table_covers_the_settings_users_ask_about() -> None:
    named = " ".join(r[1] + r[2] for r in _rows())
    for needle in ("batching.maxBatchSize", "maxQueueDelayMicroseconds", "calibration.method", "cpu: true",
                   "--port", "--grpc-port"):
        assert needle in named, needle


def test_readme_prose_defaults() -> None:
    readme = (REPO / "README.md").read_text()
    flat = " ".join(readme.split())
    grpc = re.search(r"`--grpc-port` \(default (\d+)", flat)
    assert grpc and int(grpc.group(1)) == cli_default(("serve",), "--grpc-port") == _service_port("grpc")
    delay = re.search(r"`--max-queue-delay-us` [^.]*?(\d+) by default", flat)
    assert delay and int(delay.group(1)) == cli_default(("serve",), "--max-queue-delay-us") \
        == crd_default("batching.maxQueueDelayMicroseconds")
    # "On a cluster": the endpoint and the port-forward name the Service's REST port, which is serve's.
    http = _service_port("http")
    assert http == cli_default(("serve",), "--port")
    endpoint = re.search(r"http://NAME\.NAMESPACE\.svc\.cluster\.local:(\d+)", flat)
    assert endpoint and int(endpoint.group(1)) == http
    forwards = re.findall(r"kubectl port-forward svc/[a-z0-9-]+ (\d+):(\d+)", flat)
    assert forwards and all(int(remote) == http for _, remote in forwards)
