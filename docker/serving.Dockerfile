# Serving image: kubetrt[serve,s3,onednn] (numpy + onnx + numba + FastAPI, protobuf and hpack: OIP REST on 8080, gRPC on 8081; boto3 for s3:// packages and
# engine stores, oneDNN's x86 CPU kernels; no TensorFlow, no GPU libraries).
# oneMKL's GEMM (about 900 MB) is opt-in: --build-arg EXTRAS=serve,s3,onednn,mkl
# GPU targets use a CUDA/TensorRT base via --build-arg BASE=nvcr.io/nvidia/tensorrt:<tag>-py3 (pinned).
# BASE needs python3 (3.10+) with venv; it also builds FROM a debootstrap'd Debian bookworm
# (scripts/e2e-containers.sh: --build-arg BASE=localhost/kubetrt-base:bookworm).
# Runs as 65532:65532 with a read-only root filesystem.
# Build from the repo root: docker build -f docker/serving.Dockerfile -t ghcr.io/kubetrt/serving:0.1.0 .
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
ARG EXTRAS=serve,s3,onednn
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
# GNU OpenMP runtime (about 300 KB) for the onednn extra's libdnnl and the packed dense kernel: from apt only if the base lacks it.
RUN ldconfig -p | grep -q 'libgomp\.so\.1' \
 || (apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*)
ENV PATH=/opt/kubetrt/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["kubetrt"]
CMD ["serve", "--help"]
