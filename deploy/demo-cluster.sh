#!/usr/bin/env bash
# lockstep cluster demo: three sandbox "nodes" sharing pools through etcd,
# all made of network namespaces on this machine.
#
#   underlay ns (bridge br0 10.250.0.254/24, three etcd members on it)
#     ├─ node-1 ns (u0 10.250.0.1) ── pods 1a, 1b
#     ├─ node-2 ns (u0 10.250.0.2) ── pods 2a, 2b
#     └─ node-3 ns (u0 10.250.0.3) ── pods 3a, 3b
#
# A cluster pool is applied once; each node's agent claims blocks of it in
# etcd, gives its pods addresses from them through the CNI plugin, and learns
# where the other nodes' blocks live (IPCACHE entries and routes via their
# node address). Pods then ping across nodes. Everything is removed on exit;
# traffic stays inside these namespaces.
set -euo pipefail

BIN=${LOCKSTEP_BIN:-target/debug/lockstep}
ETCD=${ETCD:-/usr/bin/etcd}
TAG=lsc-$$
UL=$TAG-ul
DIR=/tmp/$TAG
NODES=(1 2 3)
PIDS=()
EPS=http://10.250.0.254:23791,http://10.250.0.254:23792,http://10.250.0.254:23793
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
in_ul() { nsenter --net=/run/netns/$UL -- "$@"; }
in_node() { local n=$1; shift; nsenter --net=/run/netns/$TAG-n$n -- "$@"; }
cluster() { in_ul "$BIN" cluster --etcd "$EPS" "$@"; }
cli() { local n=$1; shift; "$BIN" --socket "$DIR/n$n/api.sock" "$@"; }
fail() { echo "demo: FAILED: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }

cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  for n in "${NODES[@]}"; do
    "$BIN" datapath uninstall --pin-root "/sys/fs/bpf/$TAG-n$n" >/dev/null 2>&1 || true
    for ns in $TAG-n$n $TAG-p${n}a $TAG-p${n}b; do ip netns del "$ns" 2>/dev/null || true; done
  done
  ip netns del "$UL" 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
mkdir -p "$DIR"

step "The underlay: a bridge, and three etcd members on it ($DIR)"
ip netns add "$UL"
ip -n "$UL" link set lo up
ip -n "$UL" link add br0 type bridge
ip -n "$UL" addr add 10.250.0.254/24 dev br0
ip -n "$UL" link set br0 up
initial=m1=http://10.250.0.254:23801,m2=http://10.250.0.254:23802,m3=http://10.250.0.254:23803
for m in 1 2 3; do
  # Started directly (not through a function): $! is the process itself,
  # so the cleanup's kill reaches it.
  nsenter --net=/run/netns/$UL -- "$ETCD" --name m$m --data-dir "$DIR/etcd-m$m" \
    --listen-client-urls http://10.250.0.254:2379$m --advertise-client-urls http://10.250.0.254:2379$m \
    --listen-peer-urls http://10.250.0.254:2380$m --initial-advertise-peer-urls http://10.250.0.254:2380$m \
    --initial-cluster "$initial" --initial-cluster-token "$TAG" --initial-cluster-state new \
    >"$DIR/etcd-m$m.log" 2>&1 &
  PIDS+=($!)
done
for _ in $(seq 100); do
  in_ul etcdctl --endpoints "$EPS" endpoint health >/dev/null 2>&1 && break
  sleep 0.1
done
in_ul etcdctl --endpoints "$EPS" endpoint health

step "One set of pools for every node, applied once"
cat > "$DIR/pools.toml" <<'TOML'
[[pools]]
name = "pods"
ipv4 = ["10.244.0.0/16"]
block_v4 = 28
TOML
cat "$DIR/pools.toml"
cluster pools apply -f "$DIR/pools.toml"
cluster pools get

step "Three nodes, each with an agent in cluster mode"
for n in "${NODES[@]}"; do
  ns=$TAG-n$n
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  in_node "$n" sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0
  ip -n "$ns" link add u0 type veth peer name ul$n netns "$UL"
  ip -n "$UL" link set ul$n master br0 up
  ip -n "$ns" addr add 10.250.0.$n/24 dev u0
  ip -n "$ns" link set u0 up
  mkdir -p "$DIR/n$n"
  cat > "$DIR/n$n/config.toml" <<TOML
state_dir = "$DIR/n$n/db"
socket = "$DIR/n$n/api.sock"
metrics_addr = "127.0.0.1:0"
reconcile_interval = "2s"
pools = []
[datapath]
pin_root = "/sys/fs/bpf/$TAG-n$n"
uplink = "u0"
[cluster]
etcd = ["http://10.250.0.254:23791", "http://10.250.0.254:23792", "http://10.250.0.254:23793"]
node_name = "node-$n"
node_ip_v4 = "10.250.0.$n"
TOML
  nsenter --net=/run/netns/$TAG-n$n -- "$BIN" agent --config "$DIR/n$n/config.toml" >"$DIR/n$n/agent.log" 2>&1 &
  PIDS+=($!)
done
for n in "${NODES[@]}"; do
  for _ in $(seq 200); do cli "$n" status >/dev/null 2>&1 && break; sleep 0.05; done
  cli "$n" status >/dev/null || { echo "agent $n not ready" >&2; cat "$DIR/n$n/agent.log" >&2; exit 1; }
done
cat "$DIR/n1/config.toml"
cluster nodes

step "Two pods per node through the CNI plugin (each node takes a block of its own)"
declare -A ADDR
for n in "${NODES[@]}"; do
  for p in a b; do
    pod=$TAG-p$n$p
    ip netns add "$pod"
    out=$(CNI_COMMAND=ADD CNI_CONTAINERID="demo-$n$p" CNI_NETNS=/run/netns/$pod CNI_IFNAME=eth0 \
      CNI_PATH=/opt/cni/bin "$BIN" <<JSON
{"cniVersion": "1.1.0", "name": "demo", "type": "lockstep", "agentSocket": "$DIR/n$n/api.sock"}
JSON
)
    ADDR[$n$p]=$(echo "$out" | sed -E 's/.*"address":"([0-9.]+)\/[0-9]+".*/\1/')
    case "${ADDR[$n$p]}" in 10.244.*) ;; *) fail "pod $n$p got no address of pool pods: $out";; esac
    echo "pod $n$p on node-$n: ${ADDR[$n$p]}"
  done
done
cluster blocks

step "What node-1 learned about the other nodes' blocks"
echo "routes lockstep owns (protocol 213), each block via its node's address:"
ip -n $TAG-n1 route show proto 213
for n in 2 3; do
  ip -n $TAG-n1 route show proto 213 | grep "via 10.250.0.$n" >/dev/null || fail "node-1 has no route via node-$n"
done
echo "IPCACHE prefixes (remote blocks, with the owner's node address):"
"$BIN" maps dump --pin-root /sys/fs/bpf/$TAG-n1 | sed -n '/IPCACHE_V4/,/IPCACHE_V6/p'

step "Pods ping across nodes"
for from in 1a 2b 3a; do
  for to in 1b 2a 3b; do
    [ "$from" = "$to" ] && continue
    printf '%s (%s) -> %s (%s): ' "$from" "${ADDR[$from]}" "$to" "${ADDR[$to]}"
    ip netns exec $TAG-p$from ping -c 2 -i 0.2 -W 2 -q "${ADDR[$to]}" | grep -o '[0-9]* received'
  done
done

step "Every node verifies its maps, routes and blocks"
for n in "${NODES[@]}"; do cli "$n" verify; done

step "node-3 is removed from the cluster: the others drop its routes and entries"
kill -9 "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true
cluster node remove node-3 --force
dropped=
for _ in $(seq 100); do
  ip -n $TAG-n1 route show proto 213 | grep 10.250.0.3 >/dev/null || { dropped=1; break; }
  sleep 0.1
done
ip -n $TAG-n1 route show proto 213
[ -n "$dropped" ] || fail "node-1 still routes via node-3 after its removal"
ok "node-1 dropped node-3's routes"
cluster blocks
echo
echo "cluster demo finished; removing namespaces, pins, agents and etcd"
