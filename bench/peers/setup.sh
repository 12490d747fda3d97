#!/usr/bin/env bash
# Installs the peers bench/serving.py runs beside kubetrt, each in its own venv outside the
# repository (pinned versions, so that every run serves through the same code):
#   $PEERS/mlserver   Seldon MLServer 1.7.1 (Python 3.11)
#   $PEERS/kserve     KServe 0.21.0 ModelServer (Python 3.11)
#   $PEERS/pytriton   NVIDIA PyTriton 0.7.0: tritonserver's C++ front ends and dynamic batcher,
#                     the model a Python callable (Python 3.12: the wheel's Python backend stub
#                     is built for it and loads libpython3.12.so at run time)
# and the load generators: wrk and h2load (Debian's wrk and nghttp2-client, installed here with
# apt-get when missing), and ghz (gRPC the protobuf way, built with `go install` into $ROOT/bin).
#
#   bench/peers/setup.sh [mlserver kserve pytriton tools]     # default: all four
#
# Environment: KUBETRT_BENCH_CACHE (default ~/.cache/kubetrt-bench), PYTHON311, PYTHON312 (an
# interpreter built with --enable-shared; found through pyenv, PATH or uv otherwise).
set -euo pipefail

ROOT=${KUBETRT_BENCH_CACHE:-$HOME/.cache/kubetrt-bench}
PEERS=$ROOT/peers
mkdir -p "$PEERS" "$ROOT/bin"

ORT=onnxruntime==1.23.2      # the same onnxruntime in every peer
MLSERVER=mlserver==1.7.1
# uvloop 0.23 raises from asyncio.get_event_loop() outside a running loop, which MLServer 1.7's
# inference-pool workers call at start (they die and the server exits): the release before it
UVLOOP=uvloop==0.21.0
KSERVE=kserve==0.21.0
PYTRITON=nvidia-pytriton==0.7.0
GHZ=github.com/bojand/ghz/cmd/ghz@v0.120.0

log() { echo "peers/setup: $*" >&2; }

python311() {
  for c in "${PYTHON311:-}" python3.11 "$(pyenv prefix 3.11 2>/dev/null)/bin/python3.11"; do
    [[ -n "$c" ]] && command -v "$c" >/dev/null 2>&1 && { command -v "$c"; return; }
  done
  log "no Python 3.11 (set PYTHON311)"; return 1
}

# A Python 3.12 whose shared libpython3.12.so exists; prints "PYTHON LIBDIR".
python312() {
  local cands=("${PYTHON312:-}")
  if command -v pyenv >/dev/null 2>&1; then
    local v; v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.[0-9]+$' | sort -V | tail -1 || true)
    [[ -n "$v" ]] && cands+=("$(pyenv root)/versions/$v/bin/python3.12")
  fi
  cands+=(python3.12)
  if command -v uv >/dev/null 2>&1; then
    cands+=("$(uv python find 3.12 2>/dev/null || { uv python install 3.12 >&2 && uv python find 3.12; } || true)")
  fi
  for c in "${cands[@]}"; do
    [[ -n "$c" ]] && command -v "$c" >/dev/null 2>&1 || continue
    local libdir
    libdir=$("$c" -c 'import sysconfig as s, os; d = s.get_config_var("LIBDIR"); print(d if os.path.exists(os.path.join(d, "libpython3.12.so.1.0")) else "")' 2>/dev/null || true)
    [[ -n "$libdir" ]] && { echo "$(command -v "$c") $libdir"; return; }
    log "$c has no libpython3.12.so (not built with --enable-shared); skipped"
  done
  log "no Python 3.12 with libpython3.12.so: set PYTHON312, or install one (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install 3.12)"
  return 1
}

venv() {  # venv NAME PYTHON PACKAGE...
  local dir=$PEERS/$1 py=$2; shift 2
  rm -rf "$dir"
  "$py" -m venv "$dir"
  "$dir/bin/pip" install -q --upgrade pip
  "$dir/bin/pip" install -q "$@"
  "$dir/bin/pip" freeze > "$dir/freeze.txt"
  log "$(basename "$dir"): $("$dir/bin/python" -V) $(grep -iE '^(mlserver|kserve|nvidia-pytriton|onnxruntime|uvloop)==' "$dir/freeze.txt" | tr '\n' ' ')"
}

mlserver() { venv mlserver "$(python311)" "$MLSERVER" "$UVLOOP" "$ORT"; }
kserve() { venv kserve "$(python311)" "$KSERVE" "$ORT"; }
pytriton() {
  local found py libdir
  found=$(python312) || exit 1
  read -r py libdir <<< "$found"
  venv pytriton "$py" "$PYTRITON" "$ORT"
  echo "$libdir" > "$PEERS/pytriton/libpython-dir"   # bench/serving.py puts it on LD_LIBRARY_PATH
}
tools() {
  local missing=()
  command -v wrk >/dev/null 2>&1 || missing+=(wrk)
  command -v h2load >/dev/null 2>&1 || missing+=(nghttp2-client)
  [[ ${#missing[@]} -eq 0 ]] || { apt-get update -qq && apt-get install -y -qq "${missing[@]}"; }
  [[ -x $ROOT/bin/ghz ]] || (cd /tmp && GOBIN=$ROOT/bin go install "$GHZ")
  log "tools: $(command -v wrk), $(command -v h2load), $ROOT/bin/ghz ${GHZ##*@}"
}

targets=("$@"); [[ ${#targets[@]} -gt 0 ]] || targets=(tools mlserver kserve pytriton)
for t in "${targets[@]}"; do
  case "$t" in mlserver|kserve|pytriton|tools) "$t" ;; *) log "unknown target $t"; exit 2 ;; esac
done
