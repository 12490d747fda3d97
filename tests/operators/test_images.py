"""The images the operator names per kind of target, checked from their Dockerfiles.

The GPU images build FROM a CUDA or TensorRT base no registry here serves, so they are read, not
built: the extras they install exist in pyproject.toml and bring CuPy, their dependency layers are
the CPU images' own (so a change to one reaches the other), they copy every package folder and
run the `kubetrt` console script with a subcommand it has, and the operator's default images are
the ones their headers say to tag.
"""
from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from kubetrt.cli.main import build_parser
from kubetrt.operators.objects import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
GPU_IMAGES = {"serving-gpu": "serving", "builder-gpu": "builder"}  # GPU Dockerfile -> its CPU counterpart


def dockerfile(name: str) -> str:
    return (DOCKER / f"{name}.Dockerfile").read_text()


def arg_default(text: str, name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S*)$", text, re.M)
    assert m, f"no ARG {name}=... default"
    return m.group(1)


def dependency_layers(text: str) -> str:
    """From the pip settings to the extras' ARG: the layers every kubetrt image shares."""
    block = text[text.index("ENV PIP_NO_CACHE_DIR"):text.index("ARG EXTRAS")]
    return block.replace("python3 -m venv --system-site-packages", "python -m venv")


def copied(text: str) -> list[str]:
    return re.findall(r"^COPY (\S+) ", text, re.M)


@pytest.mark.parametrize("name", sorted(GPU_IMAGES))
def test_gpu_image_installs_existing_extras_with_cupy(name: str) -> None:
    extras = arg_default(dockerfile(name), "EXTRAS").split(",")
    declared = PYPROJECT["project"]["optional-dependencies"]
    assert "gpu" in extras, extras
    assert all(e in declared for e in extras), f"{name}: extras {extras} not all in pyproject.toml {sorted(declared)}"
    assert any(d.startswith("cupy") for d in declared["gpu"]), declared["gpu"]
    cpu_extras = arg_default(dockerfile(GPU_IMAGES[name]), "EXTRAS").split(",")
    assert set(cpu_extras) - {"onednn", "mkl"} <= set(extras), "the GPU image serves what the CPU image serves"


@pytest.mark.parametrize("name", sorted(GPU_IMAGES))
def test_gpu_image_shares_the_cpu_images_layers_and_sources(name: str) -> None:
    gpu, cpu = dockerfile(name), dockerfile(GPU_IMAGES[name])
    assert dependency_layers(gpu) == dependency_layers(cpu)
    assert copied(gpu) == copied(cpu)
    package_dirs = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs <= {c.rstrip("/") for c in copied(gpu)}, "every package folder is copied"
    assert "--system-site-packages" in gpu, "TensorRT's bindings in the base image must be importable"
    assert arg_default(gpu, "BASE").startswith("nvcr.io/nvidia/cuda:12."), "cupy-cuda12x needs a CUDA 12 base"


@pytest.mark.parametrize("name", sorted(GPU_IMAGES))
def test_gpu_image_runs_the_kubetrt_cli(name: str) -> None:
    text = dockerfile(name)
    assert PYPROJECT["project"]["scripts"]["kubetrt"] == "kubetrt.cli:main"
    assert re.search(r'^ENTRYPOINT \["kubetrt"\]$', text, re.M)
    cmd = re.search(r"^CMD \[(.*)\]$", text, re.M)
    assert cmd, "no CMD"
    subcommand = cmd.group(1).split(",")[0].strip().strip('"')
    assert subcommand == {"serving": "serve", "builder": "build"}[GPU_IMAGES[name]]
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([subcommand, "--help"])
    assert done.value.code == 0
    # The modules the image imports at build time exist (cupy comes from the gpu extra).
    smoke = re.findall(r"python -c 'import ([\w., ]*)'$", text, re.M)
    assert smoke, "the image imports what it runs at build time"
    for module in (m.strip() for m in smoke[-1].split(",")):
        if module != "cupy":
            assert importlib.util.find_spec(module) is not None, module


def test_operator_defaults_are_the_images_the_dockerfiles_tag() -> None:
    config = OperatorConfig()
    for name, image in (("serving", config.serving_image), ("builder", config.builder_image),
                        ("serving-gpu", config.serving_image_gpu), ("builder-gpu", config.builder_image_gpu)):
        assert f"-t {image} " in dockerfile(name), (name, image)
