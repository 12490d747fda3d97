#!/usr/bin/env bash
# Build h2spec (the HTTP/2 conformance checker) with Go, idempotently, into a cache dir (default:
# <repo>/.cache/bin); prints the binary's path. The gRPC endpoint's own HTTP/2 server is tested
# against it (tests/serving/test_grpc_http2.py).
# Usage: scripts/get-h2spec.sh [DEST_DIR]
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest_dir="${1:-${repo_root}/.cache/bin}"
version="v2.2.1+incompatible"
bin="${dest_dir}/h2spec"
stamp="${bin}.version"

if [[ -x "${bin}" && "$(cat "${stamp}" 2>/dev/null)" == "${version}" ]]; then
  echo "${bin}"
  exit 0
fi
command -v go >/dev/null || { echo "get-h2spec: go is not installed" >&2; exit 1; }
mkdir -p "${dest_dir}"
GOBIN="${dest_dir}" go install "github.com/summerwind/h2spec/cmd/h2spec@${version}" >&2
echo "${version}" > "${stamp}"
echo "${bin}"
