#!/usr/bin/env bash
# The project's test command: set up (idempotent), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
