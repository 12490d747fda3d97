# Operator image: kubetrt[operator] (kopf + kubernetes client); runs `kopf run ... -m kubetrt.operators.handlers`.
# Build from the repo root: docker build -f docker/operator.Dockerfile -t ghcr.io/kubetrt/operator:0.1.0 .
FROM python:3.11.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kubetrt ./kubetrt
COPY runtime ./runtime
COPY serving ./serving
COPY pipeline ./pipeline
COPY operators ./operators
RUN python -m venv /opt/kubetrt && /opt/kubetrt/bin/pip install ".[operator]"

FROM python:3.11.11-slim-bookworm
COPY --from=build /opt/kubetrt /opt/kubetrt
ENV PATH=/opt/kubetrt/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["kopf"]
CMD ["run", "--all-namespaces", "--peering=kubetrt", "--log-format=json", "-m", "kubetrt.operators.handlers"]
