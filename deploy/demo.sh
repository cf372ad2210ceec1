#!/usr/bin/env bash
# lockstep demo: a sandbox "node" made of network namespaces on this machine.
#
#   node ns  ── h1 ══ e1 ── ep1 ns (endpoint 10.200.0.1, fd00:200::1)
#            ── h2 ══ e2 ── ep2 ns (endpoint 10.200.0.2, fd00:200::2)
#            ── u0 ══ n0 ── nb ns  (a neighbour on the "uplink", 10.201.0.2/24)
#
# lockstep loads its programs in the node namespace, pins its maps under a
# demo pin root, programs two endpoints and an announced address, and the demo
# shows traffic, a spoofed packet dropped, an ARP answered by BPF, the maps
# through bpftool and lockstep, and the counters moving. Everything is removed
# on exit. Traffic stays inside these namespaces.
set -euo pipefail

BIN=${LOCKSTEP_BIN:-target/debug/lockstep}
TAG=lockstep-demo-$$
NODE=$TAG-node; EP1=$TAG-ep1; EP2=$TAG-ep2; NB=$TAG-nb
PINS=/sys/fs/bpf/$TAG
STATE=/tmp/$TAG
AGENT=
in_node() { nsenter --net=/run/netns/$NODE -- "$@"; }
ls_node() { in_node "$BIN" "$@" --pin-root "$PINS"; }
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

cleanup() {
  if [ -n "$AGENT" ]; then kill -9 "$AGENT" 2>/dev/null || true; wait "$AGENT" 2>/dev/null || true; fi
  rm -rf "$STATE"
  "$BIN" datapath uninstall --pin-root "$PINS" >/dev/null 2>&1 || true
  for ns in $NODE $EP1 $EP2 $NB; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT

step "Building the sandbox node ($NODE) and its neighbours"
for ns in $NODE $EP1 $EP2 $NB; do ip netns add "$ns"; ip -n "$ns" link set lo up; done
in_node sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1 net.ipv4.conf.all.rp_filter=0
i=0
for ep in $EP1 $EP2; do
  i=$((i + 1))
  ip -n $NODE link add h$i type veth peer name e$i netns "$ep"
  ip -n $NODE link set h$i up; ip -n "$ep" link set e$i up
  ip -n "$ep" addr add 10.200.0.$i/32 dev e$i
  ip -n "$ep" -6 addr add fd00:200::$i/128 dev e$i nodad
  hmac=$(ip -n $NODE -j link show h$i | sed -E 's/.*"address":"([^"]+)".*/\1/')
  emac=$(ip -n "$ep" -j link show e$i | sed -E 's/.*"address":"([^"]+)".*/\1/')
  ip -n "$ep" neigh add 169.254.1.1 lladdr "$hmac" dev e$i nud permanent
  ip -n "$ep" route add 169.254.1.1/32 dev e$i scope link
  ip -n "$ep" route add default via 169.254.1.1 dev e$i
  ip -n "$ep" -6 neigh add fe80::1 lladdr "$hmac" dev e$i nud permanent
  ip -n "$ep" -6 route add default via fe80::1 dev e$i
  ip -n $NODE route add 10.200.0.$i/32 dev h$i
  ip -n $NODE -6 route add fd00:200::$i/128 dev h$i
  ip -n $NODE neigh add 10.200.0.$i lladdr "$emac" dev h$i nud permanent
  ip -n $NODE -6 neigh add fd00:200::$i lladdr "$emac" dev h$i nud permanent
done
ip -n $NODE link add u0 type veth peer name n0 netns $NB
ip -n $NODE link set u0 up; ip -n $NB link set n0 up
ip -n $NB addr add 10.201.0.2/24 dev n0

step "Loading lockstep's programs, pinning maps under $PINS"
ls_node datapath install --uplink u0
ls_node datapath endpoint --iface h1 --ipv4 10.200.0.1 --ipv6 fd00:200::1
ls_node datapath endpoint --iface h2 --ipv4 10.200.0.2 --ipv6 fd00:200::2
ls_node datapath l2-add --ip 10.201.0.50 --iface u0
ls_node datapath ipcache-add --prefix 10.96.0.0/12 --remote
ls_node datapath masq-skip-add --cidr 10.200.0.0/16
find "$PINS" -mindepth 1 | sort

step "Genuine traffic: ep1 -> ep2 (IPv4 and IPv6)"
ip netns exec $EP1 ping -c 3 -i 0.2 -I 10.200.0.1 10.200.0.2
ip netns exec $EP1 ping -6 -c 3 -i 0.2 -I fd00:200::1 fd00:200::2

step "Spoofed source: ep1 claims 10.200.0.99; from_endpoint drops it"
ip -n $EP1 addr add 10.200.0.99/32 dev e1
if ip netns exec $EP1 ping -c 2 -W 1 -I 10.200.0.99 10.200.0.2; then
  echo "unexpected: spoofed ping answered" >&2; exit 1
fi

step "ARP for 10.201.0.50 from the neighbour: answered by from_native (no kernel address holds it)"
echo "node uplink MAC: $(ip -n $NODE -j link show u0 | sed -E 's/.*"address":"([^"]+)".*/\1/')"
ip netns exec $NB arping -c 2 -w 3 -I n0 10.201.0.50

step "Masquerade in BPF: ep1 reaches the neighbour, which has no route back to 10.200.0.0/16"
# The node's uplink address; MASQ_CONFIG (node address 10.201.0.1, ports
# 61000-65535, IPv4 on) as the agent writes it, here by hand with bpftool.
ip -n $NODE addr add 10.201.0.1/24 dev u0
bpftool map update pinned "$PINS/maps/MASQ_CONFIG" key 0 0 0 0 value \
  10 201 0 1  0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0  72 238 255 255  1 0 0 0  0 0 0 0
ip netns exec $EP1 ping -c 3 -i 0.2 -I 10.200.0.1 10.201.0.2
echo "the translation (endpoint tuple -> node address and port):"
bpftool map dump pinned "$PINS/maps/NAT_FWD_V4"

step "The maps through bpftool (BTF-formatted)"
bpftool map dump pinned "$PINS/maps/IPCACHE_HOST_V4"
bpftool map dump pinned "$PINS/maps/L2_RESP_V4"

step "The maps through lockstep (decoded; works while no agent runs)"
"$BIN" maps dump --pin-root "$PINS"

step "Counters"
"$BIN" datapath counters --pin-root "$PINS"

# ---------------------------------------------------------------------------
step "The agent: a real lockstep agent in the node namespace, with its own store and pins"
"$BIN" datapath uninstall --pin-root "$PINS" >/dev/null
mkdir -p "$STATE"
cat > "$STATE/config.toml" <<TOML
node_name = "demo-node"
state_dir = "$STATE/db"
socket = "$STATE/api.sock"
reconcile_interval = "2s"
non_masquerade_cidrs = ["10.96.0.0/12"]
[datapath]
pin_root = "$PINS"
[[pools]]
name = "default"
ipv4 = ["10.244.1.0/24"]
ipv6 = ["fd00:10:244:1::/120"]
skip_masquerade = true
[[pools]]
name = "cloud"
ipv4 = ["10.0.5.16/28"]
allow_first_last = true
TOML
cat "$STATE/config.toml"
start_agent() {
  nsenter --net=/run/netns/$NODE -- "$BIN" agent --config "$STATE/config.toml" >>"$STATE/agent.log" 2>&1 &
  AGENT=$!
  for _ in $(seq 100); do cli status >/dev/null 2>&1 && return 0; sleep 0.05; done
  echo "agent did not become ready" >&2; cat "$STATE/agent.log" >&2; exit 1
}
cli() { "$BIN" --socket "$STATE/api.sock" "$@"; }
start_agent
cli status

step "Allocating through the CLI (idempotent per owner; the cloud /28 hands out its first address)"
cli allocate --kind endpoint --name pod-a --family ipv4
cli allocate --kind endpoint --name pod-a --family ipv4
cli allocate --kind endpoint --name pod-a --family ipv6
cli allocate --kind endpoint --name pod-b --family ipv4
cli allocate --pool cloud --name eni-1 --family ipv4
cli allocations
cli pools

step "The same allocations in the maps (lockstep maps dump reads the pins directly)"
"$BIN" maps dump --pin-root "$PINS"
bpftool map dump pinned "$PINS/maps/IPCACHE_HOST_V4"
cli verify

step "Drift: an entry deleted behind the agent's back with bpftool is named by verify, then repaired"
bpftool map delete pinned "$PINS/maps/IPCACHE_HOST_V4" key 10 244 1 1
cli verify || true
sleep 2.5
cli verify
cli status

step "Crash: SIGKILL the agent; the maps keep working without it; a restart restores everything"
kill -9 "$AGENT"; wait "$AGENT" 2>/dev/null || true
"$BIN" maps dump --pin-root "$PINS" | sed -n '/IPCACHE_V4/,/IPCACHE_V6/p'
start_agent
cli allocations
cli verify
kill -TERM "$AGENT"; wait "$AGENT" 2>/dev/null || true
echo
echo "demo finished; removing namespaces and pins"
