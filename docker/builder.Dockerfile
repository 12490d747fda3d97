# Builder image: kubetrt[lower,pipeline]; runs `kubetrt build --package ... --target ... --store ...` in
# EngineBuild Jobs on nodes of the target GPU. For TensorRT targets build FROM a pinned NVIDIA TensorRT
# base (--build-arg BASE=nvcr.io/nvidia/tensorrt:<tag>-py3): TensorRT is not on PyPI proper.
# Build from the repo root: docker build -f docker/builder.Dockerfile -t ghcr.io/kubetrt/builder:0.1.0 .
ARG BASE=python:3.11.11-slim-bookworm
FROM ${BASE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kubetrt ./kubetrt
COPY runtime ./runtime
COPY serving ./serving
COPY pipeline ./pipeline
COPY operators ./operators
RUN python -m venv /opt/kubetrt && /opt/kubetrt/bin/pip install ".[lower,pipeline]"

FROM ${BASE}
COPY --from=build /opt/kubetrt /opt/kubetrt
ENV PATH=/opt/kubetrt/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 65532:65532
ENTRYPOINT ["kubetrt"]
CMD ["build", "--help"]
