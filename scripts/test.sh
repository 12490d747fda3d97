#!/usr/bin/env bash
# The project's test command: set up (idempotent), run the whole suite, then the end-to-end test
# with real images (scripts/e2e-containers.sh: podman, as root) and the same images on a real
# Kubernetes control plane (scripts/e2e-cluster.sh: Go builds it once into a cache). Arguments go
# to the first pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One worker per core, except tests/e2e: its in-process control plane runs serving pods on the
# host's fixed ports, so it runs alone afterwards.
.venv/bin/python -m pytest -q -n auto --dist loadgroup --ignore=tests/e2e "$@"
.venv/bin/python -m pytest -q tests/e2e "$@" || [ $? = 5 ]  # 5: the arguments selected nothing there
bash scripts/e2e-containers.sh
bash scripts/e2e-cluster.sh
