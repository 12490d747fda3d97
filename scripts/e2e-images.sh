#!/usr/bin/env bash
# The project's images, built with podman and no registry (scripts/e2e-containers.sh and
# scripts/e2e-cluster.sh run it first; DESIGN.md "Test environment" has the recipe):
#   podman (+ runc, debootstrap, catatonit, slirp4netns) from Debian -> a Debian bookworm base image
#   made by debootstrap -> localhost/kubetrt/{serving,builder,operator,pipeline}:e2e (pipeline: the
#   Kubeflow components' image, TensorFlow included). Also writes the
#   containers.conf the callers pass as CONTAINERS_CONF ($KUBETRT_E2E_DIR/containers.conf).
#
# Run as root on Debian bookworm. Idempotent: installed packages, the base image and image layers
# are reused. Environment:
#   KUBETRT_E2E_DIR   work dir (containers.conf, logs, build context); default ~/.cache/kubetrt-e2e
#   KUBETRT_E2E_REBUILD=1   rebuild the base image and the images without layer cache
#   KUBETRT_E2E_GPU_IMAGES=1   also build docker/{serving,builder}-gpu.Dockerfile on the local base:
#                           they install (CuPy included) and import there; their CUDA bases need a registry
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
WORK="${KUBETRT_E2E_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kubetrt-e2e}"
BASE_IMAGE="localhost/kubetrt-base:bookworm"
TAG="e2e"
INCLUDE="python3,python3-venv,python3-pip,python-is-python3,libgomp1,ca-certificates"
STEP_TAG=e2e
source scripts/lib/steps.sh
[ "$(id -u)" = 0 ] || die "run as root (apt-get, debootstrap and rootful podman)"
mkdir -p "$WORK"

# ------------------------------------------------------------------ 1. packages
missing=()
for tool in podman:podman runc:runc debootstrap:debootstrap /usr/libexec/podman/catatonit:catatonit slirp4netns:slirp4netns; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || [ -x "${tool%%:*}" ] || missing+=("${tool##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  step "installing ${missing[*]} (apt)"
  # No recommends (they pull in systemd via dbus-user-session); catatonit is the one podman's
  # pod infra (pause) image needs.
  export DEBIAN_FRONTEND=noninteractive
  run_logged "$WORK/apt.log" timeout 300 apt-get update -q
  run_logged "$WORK/apt.log" timeout 300 apt-get install -y -q --no-install-recommends "${missing[@]}"
  done_step
fi

# ------------------------------------------------------------------ 2. podman configuration
# runc, not crun (crun fails here: no setrlimit, hybrid cgroups); cgroupfs, not systemd.
export CONTAINERS_CONF="$WORK/containers.conf"
cat >"$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
EOF

# ------------------------------------------------------------------ 3. base image (debootstrap)
# The Debian mirror apt already uses on this machine (deb822 .sources first, then one-line lists).
debian_mirror() {
  local f uri
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -r "$f" ] || continue
    uri=$(awk 'BEGIN { RS = ""; FS = "\n" }
      { u = ""; ok = 0
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/) { v = $i; sub(/^URIs:[ \t]*/, "", v); split(v, a, /[ \t]+/); u = a[1] }
          if ($i ~ /^Suites:/ && $i ~ /[ \t]bookworm([ \t]|$)/) ok = 1
          if ($i ~ /^Enabled:[ \t]*[Nn]o/) { ok = 0; break }
        }
        if (u != "" && ok) { print u; exit } }' "$f")
    if [ -n "$uri" ]; then echo "$uri"; return; fi
  done
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
    | sed -E 's/\[[^]]*\]//' | awk '$1 == "deb" && $3 == "bookworm" { print $2; exit }' || true
}

base_id="$(printf '%s\n' "$INCLUDE" "minbase" | sha256sum | cut -c1-16)"
have_base="$(podman image inspect --format '{{index .Labels "io.kubetrt.base"}}' "$BASE_IMAGE" 2>/dev/null || true)"
if [ "$have_base" != "$base_id" ] || [ "${KUBETRT_E2E_REBUILD:-0}" = 1 ]; then
  mirror="$(debian_mirror)"
  step "debootstrap bookworm (minbase + python3, libgomp1) from ${mirror:-the default Debian mirror}"
  rootfs="$WORK/rootfs"
  rm -rf "$rootfs"
  run_logged "$WORK/debootstrap.log" timeout 600 \
    debootstrap --variant=minbase --include="$INCLUDE" bookworm "$rootfs" ${mirror:+"$mirror"}
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
  run_logged "$WORK/import.log" bash -c 'tar -C "$1" -c . | podman import \
      --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
      --change "ENV LANG=C.UTF-8" --change "CMD [\"/bin/bash\"]" \
      --change "LABEL io.kubetrt.base=$2" - "$3"' _ "$rootfs" "$base_id" "$BASE_IMAGE"
  rm -rf "$rootfs"
  done_step "$BASE_IMAGE"
fi

# ------------------------------------------------------------------ 4. images
# A clean build context: only what the Dockerfiles COPY (no .venv, caches or numba's __pycache__,
# which would otherwise defeat the layer cache on every run).
ctx="$WORK/context"
rm -rf "$ctx" && mkdir -p "$ctx"
# What to copy is read from the Dockerfiles' own COPY lines, so a new package folder needs no edit here.
mapfile -t copied < <(sed -n 's/^COPY \([^ ]*\) .*/\1/p' "$REPO"/docker/*.Dockerfile | sort -u)
tar -C "$REPO" --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' \
  -c docker "${copied[@]}" | tar -C "$ctx" -x

# pip inside the build reaches the package index the way pip on this machine does: with its CA
# bundle, /etc/pip.conf and its PIP_* environment, written as a user-level pip.conf (which overrides
# /etc/pip.conf, as the environment would); local paths named there (a cert, find-links) are
# mounted at the same place.
build_opts=(--network host --build-arg "BASE=$BASE_IMAGE" -v /etc/ssl/certs:/etc/ssl/certs:ro)
[ -f /etc/pip.conf ] && build_opts+=(-v /etc/pip.conf:/etc/pip.conf:ro)
pip_env_conf="$WORK/pip-env.conf"
pip_env_lines=0
echo "[global]" >"$pip_env_conf"
while IFS='=' read -r name value; do
  key="$(echo "${name#PIP_}" | tr 'A-Z_' 'a-z-')"
  [ "$key" != config-file ] && [ -n "${value// /}" ] || continue
  printf '%s = %s\n' "$key" "$value" >>"$pip_env_conf"
  pip_env_lines=$((pip_env_lines + 1))
  for word in $value; do
    case "$word" in
      /etc/ssl/certs/*|/etc/pip.conf) ;;
      /*) [ -e "$word" ] && build_opts+=(-v "$word:$word:ro") ;;
    esac
  done
done < <(env | grep -E '^PIP_[A-Z0-9_]+=' || true)
[ "$pip_env_lines" -gt 0 ] && build_opts+=(-v "$pip_env_conf:/root/.config/pip/pip.conf:ro")
build_image() {  # NAME [OPTIONS]: docker/NAME.Dockerfile -> localhost/kubetrt/NAME:$TAG, log in $WORK
  local name="$1"; shift
  timeout 900 podman build "${build_opts[@]}" "$@" -f "$ctx/docker/$name.Dockerfile" \
    -t "localhost/kubetrt/$name:$TAG" "$ctx" >"$WORK/build-$name.log" 2>&1
}
build_failed() {
  tail -n 60 "$WORK/build-$1.log" >&2
  die "podman build $1 (full log: $WORK/build-$1.log)"
}
# Serving first: it makes the dependency layer the others share (same instructions, same
# parent), which they then build on in parallel.
step "building image serving (podman build)"
fresh=(); [ "${KUBETRT_E2E_REBUILD:-0}" = 1 ] && fresh=(--no-cache)
build_image serving "${fresh[@]}" || build_failed serving
done_step
step "building images builder, operator, pipeline (podman build, in parallel)"
build_image builder & b=$!
build_image operator & o=$!
build_image pipeline & p=$!
wait "$b" || build_failed builder
wait "$o" || build_failed operator
wait "$p" || build_failed pipeline
sizes="$(podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep "kubetrt/.*:$TAG" | sed 's|localhost/kubetrt/||' | tr '\n' ' ')"
done_step "$sizes"
if [ "${KUBETRT_E2E_GPU_IMAGES:-0}" = 1 ]; then
  step "building images serving-gpu, builder-gpu on $BASE_IMAGE instead of a CUDA base (podman build)"
  build_image serving-gpu || build_failed serving-gpu
  build_image builder-gpu || build_failed builder-gpu
  done_step "$(podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -- "-gpu:$TAG" | sed 's|localhost/kubetrt/||' | tr '\n' ' ')"
fi
