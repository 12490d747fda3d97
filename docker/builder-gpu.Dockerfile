# GPU builder image: kubetrt[s3,gpu] (the builder's dependencies plus CuPy) on a CUDA base; runs
# `kubetrt build --package ... --target tensorrt@<product>:... --store ...` in the EngineBuild Jobs of
# GPU targets (KUBETRT_BUILDER_IMAGE_GPU, or a target's image.builder), on a node of that GPU.
# BASE: a CUDA 12 runtime image builds cuda engines; tensorrt engines need a pinned NVIDIA TensorRT
# image, e.g. --build-arg BASE=nvcr.io/nvidia/tensorrt:25.01-py3 (the venv sees its TensorRT bindings).
# Runs as 65532:65532 with a read-only root filesystem (/tmp an emptyDir).
# Build from the repo root: docker build -f docker/builder-gpu.Dockerfile -t ghcr.io/kubetrt/builder-gpu:0.1.0 .
ARG BASE=nvcr.io/nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE}
# CUDA bases carry no Python: python3 with venv from apt where the base lacks it (NVIDIA's TensorRT
# images have it, with TensorRT's bindings in the system site-packages the venv below can see).
RUN python3 -c 'import venv, ensurepip' 2>/dev/null || (apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    ca-certificates libgomp1 && rm -rf /var/lib/apt/lists/*)
# The dependency layers as in docker/builder.Dockerfile (tests/operators/test_images.py keeps them equal).
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml ./
RUN python3 -m venv --system-site-packages /opt/kubetrt && /opt/kubetrt/bin/python -c 'import importlib, os, re, sys; \
toml = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "pip._vendor.tomli"); \
t = toml.load(open("pyproject.toml", "rb")); p = t["project"]; o = p.get("optional-dependencies", {}); \
sub = lambda r: [s for m in re.findall(r"^kubetrt\[([^]]*)\]", r.replace(" ", "")) for s in m.split(",")]; \
deps = lambda e: [d for r in o[e] for d in ([x for s in sub(r) for x in deps(s)] if sub(r) else [r])]; \
os.makedirs("req"); write = lambda name, rs: open(f"req/{name}.txt", "w").write("\n".join(rs) + "\n"); \
write("base", t["build-system"]["requires"] + p["dependencies"]); [write(e, deps(e)) for e in o]' \
 && /opt/kubetrt/bin/pip install -r req/base.txt
ARG EXTRAS=s3,gpu
RUN [ -z "${EXTRAS}" ] || /opt/kubetrt/bin/pip install $(printf -- '-r req/%s.txt ' $(echo "${EXTRAS}" | tr , ' '))
COPY README.md ./
COPY kubetrt ./kubetrt
COPY telemetry ./telemetry
COPY cli ./cli
COPY runtime ./runtime
COPY serving ./serving
COPY pipeline ./pipeline
COPY operators ./operators
RUN /opt/kubetrt/bin/pip install --no-deps --no-build-isolation . && rm -rf build
WORKDIR /
# No `pip check`: it would judge the base image's own packages too; what the image runs must import
# (from /, where the source tree's folders cannot shadow the installed package).
RUN /opt/kubetrt/bin/python -c 'import cupy, kubetrt.runtime.devices, kubetrt.cli.main'
ENV PATH=/opt/kubetrt/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 65532:65532
ENTRYPOINT ["kubetrt"]
CMD ["build", "--help"]
