# Kubeflow pipeline image: kubetrt[lower,pipeline] (TensorFlow, tf2onnx, onnxruntime's quantization
# tools, kfp, boto3). Every component of the compiled pipeline (pipeline/kfp_pipeline.py: ingest,
# lower with INT8 calibration, plan, host build/verify, deploy) runs in it: kfp starts
# `python3 -m kfp.dsl.executor_main` here, so kfp is installed and nothing is installed at run time.
# Its name is kfp_pipeline.DEFAULT_IMAGE (the `image` parameter's default): ghcr.io/kubetrt/pipeline:<version>.
# GPU targets' build and verify tasks need CuPy or TensorRT: build those FROM a CUDA/TensorRT base
# (--build-arg BASE=nvcr.io/nvidia/tensorrt:<tag>-py3 --build-arg EXTRAS=lower,pipeline,gpu).
# BASE needs python3 (3.10+) with venv; it also builds FROM a debootstrap'd Debian bookworm
# (scripts/e2e-images.sh: --build-arg BASE=localhost/kubetrt-base:bookworm).
# Runs as root, unlike the other images: Kubeflow's launcher writes input and output artifacts under
# /gcs, /minio or /s3 in the container's root filesystem.
# Build from the repo root: docker build -f docker/pipeline.Dockerfile -t ghcr.io/kubetrt/pipeline:0.1.0 .
ARG BASE=python:3.11.11-slim-bookworm
FROM ${BASE}
# kubetrt's dependencies from pyproject.toml alone, in two layers before any source is copied:
# req/base.txt (build requirements + base dependencies, the same in every kubetrt image, so images
# built on one machine share that layer) and req/<extra>.txt per extra (kubetrt[...] expanded).
# A source change then rebuilds only the last, seconds-long layer.
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml ./
RUN python -m venv /opt/kubetrt && /opt/kubetrt/bin/python -c 'import importlib, os, re, sys; \
toml = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "pip._vendor.tomli"); \
t = toml.load(open("pyproject.toml", "rb")); p = t["project"]; o = p.get("optional-dependencies", {}); \
sub = lambda r: [s for m in re.findall(r"^kubetrt\[([^]]*)\]", r.replace(" ", "")) for s in m.split(",")]; \
deps = lambda e: [d for r in o[e] for d in ([x for s in sub(r) for x in deps(s)] if sub(r) else [r])]; \
os.makedirs("req"); write = lambda name, rs: open(f"req/{name}.txt", "w").write("\n".join(rs) + "\n"); \
write("base", t["build-system"]["requires"] + p["dependencies"]); [write(e, deps(e)) for e in o]' \
 && /opt/kubetrt/bin/pip install -r req/base.txt
ARG EXTRAS=lower,pipeline
RUN [ -z "${EXTRAS}" ] || /opt/kubetrt/bin/pip install $(printf -- '-r req/%s.txt ' $(echo "${EXTRAS}" | tr , ' '))
COPY README.md ./
COPY kubetrt ./kubetrt
COPY telemetry ./telemetry
COPY cli ./cli
COPY runtime ./runtime
COPY serving ./serving
COPY pipeline ./pipeline
COPY operators ./operators
RUN /opt/kubetrt/bin/pip install --no-deps --no-build-isolation . && /opt/kubetrt/bin/pip check && rm -rf build
WORKDIR /
# TF_CPP_MIN_LOG_LEVEL: TensorFlow's C++ start-up notices (no GPU, CPU features) would bury the task's log.
ENV PATH=/opt/kubetrt/bin:$PATH PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
ENTRYPOINT ["kubetrt"]
CMD ["pipeline", "--help"]
