#!/usr/bin/env bash
# A Kubernetes control plane on loopback, from the binaries build.sh made: etcd, kube-apiserver,
# kube-controller-manager and kube-scheduler, with a CA, the API server's serving certificate, an
# admin client certificate and the ServiceAccount signing key generated here.
#   control-plane.sh start BIN_DIR STATE_DIR   # starts all four, waits for /readyz, writes STATE_DIR/kubeconfig
#   control-plane.sh stop STATE_DIR            # stops what start started (by the pids it recorded)
# STATE_DIR is wiped by start: etcd's data, certificates, logs (STATE_DIR/logs/*.log, with the
# API server's audit log of ServiceAccounts' writes, audit.log) and pids.
# Ports (loopback only): KUBETRT_CLUSTER_API_PORT (6443), etcd 2379/2380, controller manager 10257,
# scheduler 10259.
set -euo pipefail

API_PORT="${KUBETRT_CLUSTER_API_PORT:-6443}"
# Pods reach the API server at 10.0.2.2, the host's loopback as a pod's user-mode network
# (slirp4netns) presents it; tests/cluster/node_agent.py sets KUBERNETES_SERVICE_HOST to it.
POD_VIEW_OF_HOST="10.0.2.2"

stop() {
  local state="$1" pid
  for name in kube-scheduler kube-controller-manager kube-apiserver etcd; do
    [ -f "$state/$name.pid" ] || continue
    pid=$(cat "$state/$name.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$state/$name.pid"
  done
}

certs() {  # the CA, the API server's serving certificate, the admin's client certificate, SA keys
  local pki="$1"
  mkdir -p "$pki"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3 -subj "/CN=kubetrt-test-ca" \
    -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
    -keyout "$pki/apiserver.key" -out "$pki/apiserver.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,IP:%s,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth\n' \
    "$POD_VIEW_OF_HOST" >"$pki/apiserver.ext"
  openssl x509 -req -in "$pki/apiserver.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3 -extfile "$pki/apiserver.ext" -out "$pki/apiserver.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=kubetrt-test-admin" \
    -keyout "$pki/admin.key" -out "$pki/admin.csr" 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' >"$pki/admin.ext"
  openssl x509 -req -in "$pki/admin.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3 -extfile "$pki/admin.ext" -out "$pki/admin.crt" 2>/dev/null
  openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
}

kubeconfig() {
  local pki="$1" out="$2"
  cat >"$out" <<KC
apiVersion: v1
kind: Config
clusters:
- name: kubetrt-test
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $pki/ca.crt
users:
- name: admin
  user:
    client-certificate: $pki/admin.crt
    client-key: $pki/admin.key
contexts:
- name: kubetrt-test
  context: {cluster: kubetrt-test, user: admin, namespace: default}
current-context: kubetrt-test
KC
}

launch() {  # NAME LOGDIR STATE CMD...: background process, its pid recorded
  local name="$1" logs="$2" state="$3"; shift 3
  "$@" >"$logs/$name.log" 2>&1 &
  echo $! >"$state/$name.pid"
}

wait_for() {  # WHAT SECONDS CMD...
  local what="$1" seconds="$2"; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then
      echo "control-plane.sh: $what not up after ${seconds}s" >&2
      return 1
    fi
    sleep 0.3
  done
}

alive() {  # STATE NAME: the process start recorded still runs
  kill -0 "$(cat "$1/$2.pid")" 2>/dev/null
}

start() {
  local bin="$1" state="$2"
  stop "$state" 2>/dev/null || true
  rm -rf "$state" && mkdir -p "$state/logs"
  local pki="$state/pki" logs="$state/logs"
  certs "$pki"
  kubeconfig "$pki" "$state/kubeconfig"
  # Who wrote what: every write by a ServiceAccount, with the pod its bound token belongs to
  # (tests/cluster tells operator replicas apart by it).
  cat >"$state/audit-policy.yaml" <<'POLICY'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived", "ResponseStarted"]
rules:
- level: Metadata
  userGroups: ["system:serviceaccounts"]
  verbs: ["create", "update", "patch", "delete", "deletecollection"]
- level: None
POLICY

  launch etcd "$logs" "$state" "$bin/etcd" --name kubetrt-test --data-dir "$state/etcd" \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster kubetrt-test=http://127.0.0.1:2380 --log-level warn \
    --quota-backend-bytes 1073741824 --unsafe-no-fsync
  wait_for "etcd (log: $logs/etcd.log)" 30 curl -fsS http://127.0.0.1:2379/health

  launch kube-apiserver "$logs" "$state" "$bin/kube-apiserver" \
    --etcd-servers http://127.0.0.1:2379 \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-cluster-ip-range 10.0.0.0/24 --endpoint-reconciler-type none \
    --authorization-mode RBAC --profiling=false \
    --audit-policy-file "$state/audit-policy.yaml" --audit-log-path "$logs/audit.log"
  wait_for "kube-apiserver (log: $logs/kube-apiserver.log)" 120 \
    curl -fsS --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" \
    "https://127.0.0.1:$API_PORT/readyz"
  alive "$state" etcd || { echo "control-plane.sh: etcd exited (log: $logs/etcd.log)" >&2; return 1; }

  launch kube-controller-manager "$logs" "$state" "$bin/kube-controller-manager" \
    --kubeconfig "$state/kubeconfig" --bind-address 127.0.0.1 --secure-port 10257 --leader-elect=false \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
    --use-service-account-credentials=true --cluster-signing-cert-file "$pki/ca.crt" \
    --cluster-signing-key-file "$pki/ca.key" --profiling=false
  launch kube-scheduler "$logs" "$state" "$bin/kube-scheduler" \
    --kubeconfig "$state/kubeconfig" --bind-address 127.0.0.1 --secure-port 10259 --leader-elect=false \
    --profiling=false
  wait_for "kube-controller-manager (log: $logs/kube-controller-manager.log)" 60 \
    curl -fsSk https://127.0.0.1:10257/healthz
  wait_for "kube-scheduler (log: $logs/kube-scheduler.log)" 60 curl -fsSk https://127.0.0.1:10259/healthz
  # The namespace's ServiceAccount and the kube-root-ca.crt ConfigMap are the controller manager's work.
  wait_for "the default ServiceAccount (controller manager log: $logs/kube-controller-manager.log)" 60 \
    "$bin/kubectl" --kubeconfig "$state/kubeconfig" get serviceaccount default -n default
}

case "${1:-}" in
  start) start "${2:?BIN_DIR}" "${3:?STATE_DIR}" ;;
  stop) stop "${2:?STATE_DIR}" ;;
  *) echo "usage: control-plane.sh start BIN_DIR STATE_DIR | stop STATE_DIR" >&2; exit 2 ;;
esac
