#!/usr/bin/env bash
# End-to-end test with real images, no cluster (README "On a cluster" lists the same steps):
#   podman (+ runc, debootstrap) from Debian -> a Debian bookworm base image made by debootstrap
#   (no registry) -> the serving, builder and operator images -> tests/containers (pytest -m
#   containers): the pipeline lowers a model, the operator's own EngineBuild Job and serving
#   Deployment are played with podman, and the served model is queried over HTTP.
#
# Run as root on Debian bookworm (CI: a fresh machine). Idempotent: installed packages, the base
# image and image layers are reused, so a re-run goes straight to the tests. Environment:
#   KUBETRT_E2E_DIR   work dir (containers.conf, logs, build context); default ~/.cache/kubetrt-e2e
#   KUBETRT_E2E_REBUILD=1   rebuild the base image and the images without layer cache
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${KUBETRT_E2E_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kubetrt-e2e}"
TAG="e2e"
STEP_TAG=e2e
source scripts/lib/steps.sh
[ "$(id -u)" = 0 ] || die "run as root (apt-get, debootstrap and rootful podman)"
mkdir -p "$WORK"

# ------------------------------------------------------------------ 1-4. packages, podman, images
bash scripts/e2e-images.sh
export CONTAINERS_CONF="$WORK/containers.conf"

# ------------------------------------------------------------------ 5. the end-to-end tests
if [ ! -x .venv/bin/python ]; then
  step "setting up .venv (scripts/setup.sh)"
  bash scripts/setup.sh
  done_step
fi

cleanup() {
  # Pods and containers the tests left behind (they clean up themselves; this covers a kill).
  podman pod ls -q --filter label=io.kubetrt.e2e 2>/dev/null | xargs -r podman pod rm -f -t 0 >/dev/null 2>&1 || true
  podman ps -aq --filter label=io.kubetrt.e2e 2>/dev/null | xargs -r podman rm -f -t 0 >/dev/null 2>&1 || true
  rm -rf /dev/shm/kubetrt-e2e-*  # in-memory emptyDirs of played pods (tests/containers/podman_pods.py kube_play)
}
trap cleanup EXIT

step "running tests/containers (pytest -m containers)"
export KUBETRT_E2E_TAG="$TAG"
status=0
timeout 900 .venv/bin/python -m pytest -m containers tests/containers -q -s -p no:cacheprovider "$@" || status=$?
done_step
say "total $((SECONDS - START))s"
exit "$status"
