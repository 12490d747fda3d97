"""README's cluster walkthrough uses the commands and names of the shipped CPU example, which
tests/cluster/test_examples.py applies and queries as written: the two must not drift apart."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "manifests" / "examples"


def commands(text: str, prefix: str = "") -> str:
    """Shell text with comment markers, trailing comments, continuations and spacing taken out."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if prefix:
            if not line.startswith(prefix):
                continue
            line = line[len(prefix):].strip()
        out.append(re.sub(r"\s{2,}#.*$", "", line).rstrip("\\"))
    return re.sub(r"\s+", "", "".join(out))


def readme_step(n: int) -> str:
    text = (REPO / "README.md").read_text()
    return text[text.index(f"\n{n}. "):text.index(f"\n{n + 1}. ")]


def example_comment_block(path: Path, start: str, end: str) -> str:
    lines = [line for line in path.read_text().splitlines() if line.startswith("#")]
    first = next(i for i, line in enumerate(lines) if start in line)
    last = next(i for i in range(first, len(lines)) if end in lines[i])
    return "\n".join(lines[first:last + 1])


def test_the_infer_request_is_the_examples() -> None:
    example = example_comment_block(EXAMPLES / "modeldeployment-cpu.yaml", "python3 -c", "/infer")
    step = readme_step(5)
    readme = step[step.index("python3 -c"):step.index("/infer") + len("/infer")]
    assert commands(readme) == commands(example, "#")


def test_the_setup_commands_are_the_volumes() -> None:
    example = example_comment_block(EXAMPLES / "models-volume.yaml", "kubectl apply -f manifests/examples/models-volume.yaml",
                                    "kubectl apply -f manifests/examples/modeldeployment-cpu.yaml")
    step = readme_step(3)
    readme = step[step.index("kubectl apply -f manifests/examples/models-volume.yaml"):]
    readme = readme[:readme.index("modeldeployment-cpu.yaml") + len("modeldeployment-cpu.yaml")]
    assert commands(readme).replace("sudo", "") == commands(example, "#").replace("sudo", "")


def test_the_names_are_the_examples() -> None:
    (md,) = [d for d in yaml.safe_load_all((EXAMPLES / "modeldeployment-cpu.yaml").read_text()) if d]
    name = md["metadata"]["name"]
    assert md["spec"]["model"]["name"] == name
    step = readme_step(5)
    assert f"svc/{name} " in step and f"/v2/models/{name}" in step and f'get_model_metadata("{name}")' in step
