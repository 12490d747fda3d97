#!/usr/bin/env bash
# End-to-end test on a real Kubernetes control plane (README "On a cluster" is what it does):
#   the project's images (scripts/e2e-images.sh: podman, a debootstrapped base, serving/builder/
#   operator) -> kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and etcd of the
#   release pinned in scripts/cluster/go.mod, built once into the cache (scripts/cluster/build.sh)
#   -> helm (scripts/get-helm.sh) -> the control plane on loopback (scripts/cluster/control-plane.sh)
#   -> tests/cluster (pytest -m cluster): install with kubectl and helm, the CRDs' validation, the
#   operator under its own RBAC, the pipeline's ModelDeployment built, scheduled and served
#   (tests/cluster/node_agent.py runs the CPU node's pods with podman), rollouts and faults.
#
# Run as root on Debian bookworm. Idempotent: a re-run reuses the images and the binaries.
# Environment:
#   KUBETRT_CLUSTER_CACHE   binaries, Go caches, helm; default ~/.cache/kubetrt-cluster
#   KUBETRT_CLUSTER_STATE   the control plane's state (etcd data, certificates, logs);
#                           default $KUBETRT_CLUSTER_CACHE/state (wiped at each start)
#   KUBETRT_E2E_DIR         as for scripts/e2e-images.sh
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${KUBETRT_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubetrt-cluster}"
STATE="${KUBETRT_CLUSTER_STATE:-$CACHE/state}"
WORK="${KUBETRT_E2E_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kubetrt-e2e}"
STEP_TAG=cluster
source scripts/lib/steps.sh
[ "$(id -u)" = 0 ] || die "run as root (apt-get, debootstrap and rootful podman)"
command -v go >/dev/null || die "Go is needed to build the control plane (go.dev/doc/install)"
mkdir -p "$CACHE"

# ------------------------------------------------------------------ 1. images
bash scripts/e2e-images.sh
export CONTAINERS_CONF="$WORK/containers.conf"

# ------------------------------------------------------------------ 2. control plane binaries
release=$(sed -n 's/^require k8s.io\/kubernetes \(v[0-9.]*\).*/\1/p' scripts/cluster/go.mod)
step "control plane $release: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd (go build, cached)"
BIN=$(bash scripts/cluster/build.sh "$CACHE" 2>"$CACHE/build.log") || { tail -n 40 "$CACHE/build.log" >&2; die "go build (log: $CACHE/build.log)"; }
done_step "$BIN"

step "helm (scripts/get-helm.sh)"
if [ ! -x .venv/bin/python ]; then bash scripts/setup.sh; fi
HELM=$(PYTHON=.venv/bin/python bash scripts/get-helm.sh "$CACHE/helm" 2>"$CACHE/helm.log") || { cat "$CACHE/helm.log" >&2; die "get-helm.sh"; }
done_step "$("$HELM" version --short)"

# ------------------------------------------------------------------ 3. the control plane
cleanup() {
  podman ps -aq --filter label=io.kubetrt.cluster 2>/dev/null | xargs -r podman rm -f -t 0 >/dev/null 2>&1 || true
  podman pod ls -q --filter label=io.kubetrt.cluster 2>/dev/null | xargs -r podman pod rm -f >/dev/null 2>&1 || true
  rm -rf /dev/shm/kubetrt-cluster-*  # the node agent's in-memory emptyDirs
  bash scripts/cluster/control-plane.sh stop "$STATE" || true
}
trap cleanup EXIT
start_control_plane() {
  step "starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler on 127.0.0.1 ($1)"
  bash scripts/cluster/control-plane.sh start "$BIN" "$STATE" || die "control plane (logs: $STATE/logs)"
  done_step "kubeconfig $STATE/kubeconfig"
}

# ------------------------------------------------------------------ 4. the tests
export KUBECONFIG="$STATE/kubeconfig" KUBETRT_CLUSTER_BIN="$BIN" KUBETRT_CLUSTER_HELM="$HELM" \
  KUBETRT_CLUSTER_LOGS="$STATE/logs" KUBETRT_E2E_TAG=e2e PATH="$BIN:$PATH"
status=0
# Two clean starts: the plain manifests on the first, the chart and the flow on the second (a CRD
# deleted right after its creation stays Terminating for minutes on a real API server).
start_control_plane "for the README's install commands and kubectl apply -f manifests/"
# test_install_docs.py first: the README's one-line kubectl install needs a cluster without CRDs.
step "running tests/cluster/test_install_docs.py, test_manifests.py (pytest -m cluster)"
timeout 600 .venv/bin/python -m pytest -m cluster tests/cluster/test_install_docs.py tests/cluster/test_manifests.py \
  -q -s -p no:cacheprovider "$@" || status=$?
done_step
[ "$status" != 5 ] || status=0  # pytest's "no tests collected": arguments such as -k chose none of these
if [ "$status" = 0 ]; then
  start_control_plane "again, clean, for helm install and the flow"
  step "running tests/cluster (pytest -m cluster)"
  timeout 1800 .venv/bin/python -m pytest -m cluster tests/cluster --ignore tests/cluster/test_manifests.py \
    --ignore tests/cluster/test_install_docs.py \
    -q -s -p no:cacheprovider "$@" || status=$?
  done_step
fi
say "total $((SECONDS - START))s"
exit "$status"
