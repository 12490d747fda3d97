#!/usr/bin/env bash
# Builds the control plane of go.mod (kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl of the pinned Kubernetes release, and etcd from the etcd server module that release
# requires) into CACHE/bin/<release>-<hash of go.mod, go.sum and etcd/main.go>, once: a later run
# with the same pins only prints that directory. GOCACHE and GOMODCACHE live under CACHE too.
#   build.sh CACHE    # prints the bin directory
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${1:?usage: build.sh CACHE}"
release=$(sed -n 's/^require k8s.io\/kubernetes \(v[0-9.]*\).*/\1/p' "$here/go.mod")
[ -n "$release" ] || { echo "build.sh: no k8s.io/kubernetes requirement in $here/go.mod" >&2; exit 1; }
stamp=$(cat "$here/go.mod" "$here/go.sum" "$here/etcd/main.go" | sha256sum | cut -c1-12)
bin="$cache/bin/$release-$stamp"
tools=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd)
complete=1
for t in "${tools[@]}"; do [ -x "$bin/$t" ] || complete=0; done
if [ "$complete" = 1 ]; then echo "$bin"; exit 0; fi

export GOCACHE="$cache/gocache" GOMODCACHE="$cache/gomod" GOFLAGS="-mod=mod -buildvcs=false"
minor=$(echo "$release" | cut -d. -f2)
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$release -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done
rm -rf "$bin.tmp" && mkdir -p "$bin.tmp"
cd "$here"
go build -trimpath -ldflags "$ldflags" -o "$bin.tmp/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl >&2
go build -trimpath -ldflags "-s -w" -o "$bin.tmp/etcd" ./etcd >&2
rm -rf "$bin" && mv "$bin.tmp" "$bin"
echo "$bin"
