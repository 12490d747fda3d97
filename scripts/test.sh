#!/usr/bin/env bash
# The project's test command: set up (idempotent), run the whole suite, then the end-to-end test
# with real images (scripts/e2e-containers.sh: podman, as root) and the same images on a real
# Kubernetes control plane (scripts/e2e-cluster.sh: Go builds it once into a cache). Arguments go
# to the first pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -n auto --dist loadgroup "$@"  # one worker per core; a module that needs a fixed host port is one group
bash scripts/e2e-containers.sh
bash scripts/e2e-cluster.sh
