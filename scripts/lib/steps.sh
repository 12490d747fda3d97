# Progress lines and failure reports for the e2e scripts, sourced after `set -euo pipefail` with
# STEP_TAG set to the script's tag (e2e, cluster): `step` starts a timed step, `done_step` ends it,
# `die` stops the script, `run_logged LOG CMD...` keeps CMD's output in LOG and shows its tail on
# failure; a failing line is named on stderr.
START=$SECONDS
step_start=$SECONDS

say() { printf '[%s %4ds] %s\n' "$STEP_TAG" "$((SECONDS - START))" "$*" >&2; }
step() { step_start=$SECONDS; say "$*"; }
done_step() { say "  done in $((SECONDS - step_start))s${1:+ ($1)}"; }
die() { say "FAILED: $*"; exit 1; }
run_logged() {
  local log="$1"; shift
  if ! "$@" >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    die "$1 (full log: $log)"
  fi
}

trap 'say "FAILED: line $LINENO: $BASH_COMMAND"' ERR
