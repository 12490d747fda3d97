#!/usr/bin/env bash
# Build one of the Go tools the gRPC endpoint's tests drive it with, pinned, idempotently, into a
# cache dir (default: <repo>/.cache/bin); prints the binary's path.
#   h2spec   the HTTP/2 conformance checker (tests/serving/test_grpc_http2.py)
#   grpcurl  the gRPC command-line client, which finds the services by server reflection
#            (tests/serving/test_grpc_reflection.py)
# Usage: scripts/get-go-tool.sh TOOL [DEST_DIR]
set -euo pipefail

case "${1:-}" in
  h2spec) module="github.com/summerwind/h2spec/cmd/h2spec" version="v2.2.1+incompatible" ;;
  grpcurl) module="github.com/fullstorydev/grpcurl/cmd/grpcurl" version="v1.9.3" ;;
  *) echo "get-go-tool: expected a tool name, h2spec or grpcurl; got '${1:-}'" >&2; exit 2 ;;
esac
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest_dir="${2:-${repo_root}/.cache/bin}"
bin="${dest_dir}/$1"
stamp="${bin}.version"

if [[ -x "${bin}" && "$(cat "${stamp}" 2>/dev/null)" == "${version}" ]]; then
  echo "${bin}"
  exit 0
fi
command -v go >/dev/null || { echo "get-go-tool: go is not installed" >&2; exit 1; }
mkdir -p "${dest_dir}"
GOBIN="${dest_dir}" go install "${module}@${version}" >&2
echo "${version}" > "${stamp}"
echo "${bin}"
