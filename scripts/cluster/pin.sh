#!/usr/bin/env bash
# Pins the control plane's Kubernetes release: writes go.mod (and go.sum) here so that
# k8s.io/kubernetes@VERSION builds as a dependency. The module's own go.mod replaces every
# k8s.io/<staging module> with ./staging/..., which a dependent module cannot see; this go.mod
# replaces each of them with the same release's v0.N.M instead (the list read from that go.mod).
#   bash scripts/cluster/pin.sh v1.34.4
set -euo pipefail
cd "$(dirname "$0")"
version=${1:?usage: pin.sh vMAJOR.MINOR.PATCH}
staging_version="v0.${version#v1.}"
gomod=$(go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p')
[[ -f $gomod ]] || { echo "pin.sh: no go.mod for k8s.io/kubernetes@$version" >&2; exit 1; }
go_line=$(grep -m1 '^go ' "$gomod")
{
  echo "// The control plane the cluster tests run: kube-apiserver, kube-controller-manager,"
  echo "// kube-scheduler and kubectl of one Kubernetes release. Written by pin.sh; do not edit."
  echo "module kubetrt.io/controlplane"
  echo
  echo "$go_line"
  echo
  echo "require k8s.io/kubernetes $version"
  echo
  echo "replace ("
  sed -n 's|^\s*\(k8s.io/[a-z0-9-]*\) => \./staging/src/.*$|\1|p' "$gomod" | sort -u | while read -r m; do
    printf '\t%s => %s %s\n' "$m" "$m" "$staging_version"
  done
  echo ")"
} > go.mod
rm -f go.sum
for tool in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  go get -tool "k8s.io/kubernetes/cmd/$tool@$version"
done
go mod tidy
echo "pinned k8s.io/kubernetes $version (staging modules $staging_version)"
