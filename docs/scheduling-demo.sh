#!/usr/bin/env bash
# Scheduling consistency with the real kube-scheduler: a driver reports a bogus 39 where the node can attach 27.
# With the guard the stored count stays 27 and the scheduler binds 27 of 30 volume pods; without it, all 30.
#
#   bash docs/scheduling-demo.sh            (from a checkout with .venv installed; needs kubectl and ../shared/k8s)
#
# Output of a run: docs/scheduling-demo.md. Everything runs on loopback and is stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
K8S=${K8S_DIR:-../shared/k8s}
DIR=$(mktemp -d /tmp/csinode-guard-demo.XXXXXX)
GUARD_PID=
cleanup() {
  [[ -n $GUARD_PID ]] && kill -TERM -- "-$GUARD_PID" 2>/dev/null || true
  bash "$K8S/cluster.sh" stop "$DIR" >/dev/null
  rm -rf "$DIR"
}
trap cleanup EXIT
say() { printf '\n## %s\n' "$*"; }

say "a real control plane (etcd, kube-apiserver, kube-scheduler)"
bash "$K8S/cluster.sh" start "$DIR" | head -1
source "$DIR/env"
k() { kubectl --kubeconfig "$KUBECONFIG" "$@"; }

say "the guard: csinode-guard serve on 127.0.0.1, registered with csinode-guard register --url"
mkdir -p "$DIR/guard"
bash "$K8S/cluster.sh" serving-cert "$DIR" guard >/dev/null
cp "$DIR/pki/guard.crt" "$DIR/guard/tls.crt"; cp "$DIR/pki/guard.key" "$DIR/guard/tls.key"; cp "$CA_CRT" "$DIR/guard/ca.crt"
PORT=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
setsid .venv/bin/csinode-guard serve --host 127.0.0.1 --port "$PORT" --metrics-port 0 --cert-dir "$DIR/guard" \
  --kubeconfig "$KUBECONFIG" --audit-log "$DIR/guard/decisions.log" >"$DIR/guard/serve.log" 2>&1 &
GUARD_PID=$!
until curl -sf --cacert "$CA_CRT" "https://127.0.0.1:$PORT/readyz" >/dev/null; do sleep 0.2; done
KUBECONFIG=$KUBECONFIG .venv/bin/csinode-guard register --url "https://127.0.0.1:$PORT" --cert-dir "$DIR/guard" | tail -2
sleep 2   # the apiserver's webhook configuration informer

node() { # NAME: a Node with its CSINode by kubelet's own code, EBS driver at the real 27, then the bogus 39
  k create -f - >/dev/null <<EOF
{"apiVersion":"v1","kind":"Node","metadata":{"name":"$1","labels":{"kubernetes.io/hostname":"$1"}},
 "status":{"capacity":{"cpu":"8","memory":"32Gi","pods":"110"},"allocatable":{"cpu":"8","memory":"32Gi","pods":"110"},
 "nodeInfo":{"architecture":"amd64","bootID":"b","containerRuntimeVersion":"c","kernelVersion":"k",
 "kubeProxyVersion":"","kubeletVersion":"v1.36.2","machineID":"m","operatingSystem":"linux","osImage":"o","systemUUID":"s"}}}
EOF
  k patch node "$1" --type=merge -p '{"spec":{"taints":null}}' >/dev/null
  local kc; kc=$(bash "$K8S/cluster.sh" node-kubeconfig "$DIR" "$1")
  "$KUBELET_CSINODE" --kubeconfig "$kc" --node "$1" install --driver ebs.csi.aws.com --node-id "i-$1" --max-volumes 27
  "$KUBELET_CSINODE" --kubeconfig "$kc" --node "$1" update --driver ebs.csi.aws.com --max-volumes 39 2>&1 \
    | sed 's/^ *I[0-9]* [0-9:.]* *[0-9]* warnings.go:[0-9]*\] //'
  echo "stored: $(k get csinode "$1" -o jsonpath='{.spec.drivers[0].allocatable.count}')"
}
pods() { # NODE: 30 pods, each with its own pre-bound CSI PV/PVC of ebs.csi.aws.com, pinned to NODE
  local i out=""
  for i in $(seq -w 1 30); do
    out+="{\"apiVersion\":\"v1\",\"kind\":\"PersistentVolume\",\"metadata\":{\"name\":\"$1-$i\"},\"spec\":{\"capacity\":{\"storage\":\"1Gi\"},\"accessModes\":[\"ReadWriteOnce\"],\"storageClassName\":\"\",\"csi\":{\"driver\":\"ebs.csi.aws.com\",\"volumeHandle\":\"vol-$1-$i\"},\"claimRef\":{\"namespace\":\"demo\",\"name\":\"$1-$i\"}}},"
    out+="{\"apiVersion\":\"v1\",\"kind\":\"PersistentVolumeClaim\",\"metadata\":{\"name\":\"$1-$i\",\"namespace\":\"demo\",\"annotations\":{\"pv.kubernetes.io/bind-completed\":\"yes\"}},\"spec\":{\"accessModes\":[\"ReadWriteOnce\"],\"storageClassName\":\"\",\"volumeName\":\"$1-$i\",\"resources\":{\"requests\":{\"storage\":\"1Gi\"}}}},"
    out+="{\"apiVersion\":\"v1\",\"kind\":\"Pod\",\"metadata\":{\"name\":\"$1-$i\",\"namespace\":\"demo\"},\"spec\":{\"nodeSelector\":{\"kubernetes.io/hostname\":\"$1\"},\"containers\":[{\"name\":\"app\",\"image\":\"registry.k8s.io/pause:3.10\"}],\"volumes\":[{\"name\":\"data\",\"persistentVolumeClaim\":{\"claimName\":\"$1-$i\"}}]}},"
  done
  k create -f - >/dev/null <<<"{\"apiVersion\":\"v1\",\"kind\":\"List\",\"items\":[${out%,}]}"
}
placed() { # NODE: how many of its pods the scheduler bound
  k get pods -n demo -o jsonpath="{range .items[?(@.spec.nodeName=='$1')]}{.metadata.name}{'\n'}{end}" | grep -c . || true
}

say "node-guarded: the guard is registered"
node node-guarded
say "node-unguarded: after csinode-guard unregister"
KUBECONFIG=$KUBECONFIG .venv/bin/csinode-guard unregister
sleep 2
node node-unguarded

say "30 volume pods for each node; the real kube-scheduler places them"
k create namespace demo >/dev/null
pods node-guarded; pods node-unguarded
sleep 5
echo "node-guarded:   $(placed node-guarded) of 30 pods bound"
echo "node-unguarded: $(placed node-unguarded) of 30 pods bound"
k get pods -n demo -o jsonpath='{range .items[?(@.status.conditions[0].reason=="Unschedulable")]}{.metadata.name}: {.status.conditions[0].message}{"\n"}{end}' | head -1
