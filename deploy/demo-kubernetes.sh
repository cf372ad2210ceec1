#!/usr/bin/env bash
# lockstep Kubernetes demo (docs/kubernetes.md): a Service of
# `type: LoadBalancer` gets its address in its status, and the address is
# answered on the node's uplink; a pod annotated `lockstep.io/ip-pool` gets
# its address from that pool through the CNI plugin.
#
#   node ns ── u0 ══ n0 ── nb ns (a neighbour on the "uplink", 10.203.0.2/24)
#      ├─ lockstep agent, [kubernetes] pointing at ...
#      └─ the Kubernetes API double (tests/src/kubeapi, on 127.0.0.1:18080)
#
# No Kubernetes API server can be installed on these machines: the API here
# is lockstep's test double (what it does and does not do: the top of
# tests/src/kubeapi/mod.rs). The agent talks to it exactly as to a real
# one (kube-rs: list, watch, status patches, Events). Everything is removed
# on exit; traffic stays inside these namespaces.
set -euo pipefail

BIN=${LOCKSTEP_BIN:-target/debug/lockstep}
DOUBLE=${KUBE_DOUBLE_BIN:-target/debug/kube-double}
TAG=lsk-$$
NODE=$TAG-node; NB=$TAG-nb; POD=$TAG-pod
PINS=/sys/fs/bpf/$TAG
STATE=/tmp/$TAG
API=http://127.0.0.1:18080
PIDS=()
in_node() { nsenter --net=/run/netns/$NODE -- "$@"; }
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
kapi() { local method=$1 path=$2; shift 2; in_node curl -sS -X "$method" -H 'Content-Type: application/json' "$API$path" "$@"; }
cli() { "$BIN" --socket "$STATE/api.sock" "$@"; }
fail() { echo "demo: FAILED: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }
# A datapath counter (summed over CPUs), read from the pinned maps.
counter() {
  "$BIN" datapath counters --pin-root "$PINS" --output json |
    python3 -c 'import json, sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"
}

cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  # nsenter's child (the agent, the double) outlives a kill of nsenter.
  for ns in $NODE $NB $POD; do ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true; done
  "$BIN" datapath uninstall --pin-root "$PINS" >/dev/null 2>&1 || true
  for ns in $NODE $NB $POD; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$STATE"
}
trap cleanup EXIT

step "A sandbox node ($NODE) with an uplink to a neighbour"
for ns in $NODE $NB; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
ip -n $NODE link add u0 type veth peer name n0 netns $NB
ip -n $NODE link set u0 up; ip -n $NB link set n0 up
ip -n $NODE addr add 10.203.0.1/24 dev u0
ip -n $NB addr add 10.203.0.2/24 dev n0
UMAC=$(ip -n $NODE -j link show u0 | sed -E 's/.*"address":"([^"]+)".*/\1/')
echo "node uplink MAC: $UMAC"

step "The Kubernetes API (the test double) in the node namespace, with the Node object"
mkdir -p "$STATE"
in_node "$DOUBLE" 127.0.0.1:18080 >>"$STATE/double.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do kapi GET /api/v1/nodes >/dev/null 2>&1 && break; sleep 0.05; done
kapi POST /api/v1/nodes -d '{"metadata": {"name": "demo-node", "labels": {"topology.kubernetes.io/zone": "a"}}}' >/dev/null
kapi PATCH /api/v1/nodes/demo-node/status -H 'Content-Type: application/merge-patch+json' \
  -d '{"status": {"addresses": [{"type": "InternalIP", "address": "10.203.0.1"}]}}' >/dev/null
kapi GET /api/v1/nodes/demo-node; echo
cat > "$STATE/kubeconfig" <<YAML
apiVersion: v1
kind: Config
clusters: [{name: demo, cluster: {server: "$API"}}]
users: [{name: lockstep, user: {token: demo}}]
contexts: [{name: demo, context: {cluster: demo, user: lockstep}}]
current-context: demo
YAML

step "The agent, with [kubernetes] and no etcd: the only agent, it wins the Lease and is the LB writer"
cat > "$STATE/config.toml" <<TOML
node_name = "demo-node"
state_dir = "$STATE/db"
socket = "$STATE/api.sock"
reconcile_interval = "2s"
[datapath]
pin_root = "$PINS"
uplink = "u0"
[[pools]]
name = "default"
ipv4 = ["10.244.1.0/24"]
[[pools]]
name = "blue"
ipv4 = ["10.245.1.0/24"]
[kubernetes]
kubeconfig = "$STATE/kubeconfig"
TOML
cat "$STATE/config.toml"
in_node "$BIN" agent --config "$STATE/config.toml" >>"$STATE/agent.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 200); do cli status >/dev/null 2>&1 && break; sleep 0.05; done
cli status >/dev/null || { echo "agent did not become ready" >&2; cat "$STATE/agent.log" >&2; exit 1; }

step "kubectl apply -f pool.yaml: a LoadBalancerIPPool announced on L2"
kapi POST /apis/lockstep.io/v1alpha1/loadbalancerippools \
  -d '{"apiVersion": "lockstep.io/v1alpha1", "kind": "LoadBalancerIPPool", "metadata": {"name": "public"}, "spec": {"cidrs": ["10.203.0.128/28"], "announce": "l2"}}'
echo

step "kubectl expose deployment web --type=LoadBalancer --port=80"
kapi POST /api/v1/namespaces/default/services \
  -d '{"metadata": {"name": "web", "namespace": "default"}, "spec": {"type": "LoadBalancer", "selector": {"app": "web"}, "ports": [{"port": 80}]}}' >/dev/null
IP=
for _ in $(seq 100); do
  IP=$(kapi GET /api/v1/namespaces/default/services/web | grep -o '"ingress":\[{"ip":"[^"]*"' | sed -E 's/.*"ip":"([^"]*)"/\1/' || true)
  [ -n "$IP" ] && break; sleep 0.1
done
[ -n "$IP" ] || { cat "$STATE/agent.log" >&2; fail "no address in the Service's status"; }
echo "kubectl get svc web:   EXTERNAL-IP $IP"
echo "its status, as lockstep wrote it:"
kapi GET /api/v1/namespaces/default/services/web | grep -o '"status":.*'
echo "the pool's status:"
kapi GET /apis/lockstep.io/v1alpha1/loadbalancerippools/public | grep -o '"status":.*'
echo "the Lease electing the writer (kubectl -n kube-system get lease lockstep-lb-writer):"
HOLDER=$(kapi GET /apis/coordination.k8s.io/v1/namespaces/kube-system/leases/lockstep-lb-writer | grep -o '"holderIdentity":"[^"]*"' || true)
[ "$HOLDER" = '"holderIdentity":"demo-node"' ] || fail "the Lease does not name demo-node: $HOLDER"
echo "$HOLDER"
echo "the Event:"
kapi GET /apis/events.k8s.io/v1/namespaces/default/events | grep -o '"reason":"[^"]*","regarding":{[^}]*}\|"note":"[^"]*"' | head -4

step "ARP for $IP from the neighbour: answered by lockstep's BPF responder (no kernel address holds it)"
if ip -n $NODE addr show | grep "inet $IP/" >/dev/null; then fail "a kernel address holds $IP"; fi
replied=$(counter arp_replied)
reply=$(ip netns exec $NB arping -c 2 -w 3 -I n0 "$IP") || fail "no ARP reply for $IP: $reply"
echo "$reply"
echo "$reply" | grep -i "\[$UMAC\]" >/dev/null || fail "the reply does not carry the uplink's MAC $UMAC"
[ "$(counter arp_replied)" -ge $((replied + 2)) ] || fail "arp_replied did not count the replies"
ok "answered with $UMAC by the BPF responder; arp_replied $replied -> $(counter arp_replied)"
cli lb get

step "kubectl delete svc web: the address is released and answered no more"
kapi DELETE /api/v1/namespaces/default/services/web >/dev/null
released=
for _ in $(seq 100); do cli lb get | grep '"default/web"' >/dev/null || { released=1; break; }; sleep 0.1; done
[ -n "$released" ] || fail "default/web still holds an address after the delete"
if ip netns exec $NB arping -c 2 -w 2 -I n0 "$IP"; then
  fail "$IP is still answered after the Service's deletion"
fi
ok "no answer for $IP: released"

step "A pod annotated lockstep.io/ip-pool=blue: kubelet's CNI ADD gets an address from pool blue"
kapi POST /api/v1/namespaces/shop/pods \
  -d '{"metadata": {"name": "web-0", "namespace": "shop", "annotations": {"lockstep.io/ip-pool": "blue"}}, "spec": {"nodeName": "demo-node", "containers": [{"name": "web", "image": "nginx"}]}}' >/dev/null
ip netns add $POD
echo "CNI_ARGS=K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0 (as kubelet passes them)"
ANSWER=$(printf '{"cniVersion":"1.1.0","name":"demo","type":"lockstep","agentSocket":"%s"}' "$STATE/api.sock" |
  in_node env CNI_COMMAND=ADD CNI_CONTAINERID=$TAG-web0 CNI_NETNS=/run/netns/$POD CNI_IFNAME=eth0 \
    CNI_PATH=/opt/cni/bin "CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0" "$BIN")
POD_IP=$(echo "$ANSWER" | grep -o '"address":"[^"]*"' | head -1 | sed -E 's/.*"address":"([^"/]*).*/\1/')
echo "pod shop/web-0 got $POD_IP (pool blue is 10.245.1.0/24)"
case "$POD_IP" in 10.245.1.*) ;; *) fail "not from pool blue: $ANSWER";; esac
ip -n $POD -br addr show eth0
printf '{"cniVersion":"1.1.0","name":"demo","type":"lockstep","agentSocket":"%s"}' "$STATE/api.sock" |
  in_node env CNI_COMMAND=DEL CNI_CONTAINERID=$TAG-web0 CNI_NETNS=/run/netns/$POD CNI_IFNAME=eth0 \
    CNI_PATH=/opt/cni/bin "$BIN"
echo "DEL: released"
echo
echo "demo finished; removing namespaces and pins"
