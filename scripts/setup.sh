#!/usr/bin/env bash
# Create .venv and install kubetrt with every CPU extra and the test tools, from this repo's files.
# Idempotent: re-running after a pyproject.toml change reinstalls; otherwise it returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.kubetrt-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing kubetrt[dev] into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
if [ -f scripts/get-helm.sh ]; then
  bash scripts/get-helm.sh >/dev/null
fi
