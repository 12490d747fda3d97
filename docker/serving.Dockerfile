# Serving image: kubetrt[serve] only (numpy + onnx + FastAPI; no TensorFlow).
# x86 CPU serving builds add oneDNN's convolutions (about 55 MB; needs the libgomp1 installed below)
# and oneMKL's GEMM (about 900 MB): --build-arg EXTRAS=serve,onednn or EXTRAS=serve,onednn,mkl
# GPU targets use a CUDA/TensorRT base via --build-arg BASE=nvcr.io/nvidia/tensorrt:<tag>-py3 (pinned).
# Build from the repo root: docker build -f docker/serving.Dockerfile -t ghcr.io/kubetrt/serving:0.1.0 .
ARG BASE=python:3.11.11-slim-bookworm
FROM ${BASE} AS build
ARG EXTRAS=serve
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kubetrt ./kubetrt
COPY runtime ./runtime
COPY serving ./serving
COPY pipeline ./pipeline
COPY operators ./operators
RUN python -m venv /opt/kubetrt && /opt/kubetrt/bin/pip install ".[${EXTRAS}]"

FROM ${BASE}
# GNU OpenMP runtime for the onednn extra's libdnnl (about 300 KB; harmless without it)
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/kubetrt /opt/kubetrt
ENV PATH=/opt/kubetrt/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["kubetrt"]
CMD ["serve", "--help"]
