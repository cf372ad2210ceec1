#!/usr/bin/env bash
# lockstep demo: a sandbox "node" made of network namespaces on this machine.
#
#   node ns  ── h1 ══ e1 ── ep1 ns (endpoint 10.200.0.1, fd00:200::1)
#            ── h2 ══ e2 ── ep2 ns (endpoint 10.200.0.2, fd00:200::2)
#            ── u0 ══ n0 ── nb ns  (a neighbour on the "uplink", 10.201.0.2/24)
#
# Part one uses lockstep's low-level datapath tools (no agent): it loads the
# programs in the node namespace, pins the maps under a demo pin root,
# programs two endpoints and an announced address, and shows traffic, a
# spoofed packet dropped and an ARP answered by BPF. Part two runs the agent
# on the same node from a config file: allocations through the CLI, a pod
# added through the CNI plugin and masqueraded in BPF towards the
# neighbour, drift repaired, a crash survived. Every step checks what it
# claims and the demo stops at the first that does not hold (`cargo xtask
# test` runs it). Everything is removed on exit; traffic stays inside these
# namespaces.
set -euo pipefail

BIN=${LOCKSTEP_BIN:-target/debug/lockstep}
TAG=lockstep-demo-$$
NODE=$TAG-node; EP1=$TAG-ep1; EP2=$TAG-ep2; NB=$TAG-nb; POD=$TAG-pod
PINS=/sys/fs/bpf/$TAG
STATE=/tmp/$TAG
AGENT=
in_node() { nsenter --net=/run/netns/$NODE -- "$@"; }
ls_node() { in_node "$BIN" "$@" --pin-root "$PINS"; }
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
fail() { echo "demo: FAILED: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }
mac_of() { ip -n "$1" -j link show "$2" | sed -E 's/.*"address":"([^"]+)".*/\1/'; }
# A datapath counter (summed over CPUs), read from the pinned maps.
counter() {
  "$BIN" datapath counters --pin-root "$PINS" --output json |
    python3 -c 'import json, sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"
}
# How many entries `lockstep maps dump` shows in one map.
entries() {
  "$BIN" maps dump --pin-root "$PINS" --output json |
    python3 -c 'import json, sys; print(len(json.load(sys.stdin)[sys.argv[1]]))' "$1"
}

cleanup() {
  if [ -n "$AGENT" ]; then kill -9 "$AGENT" 2>/dev/null || true; wait "$AGENT" 2>/dev/null || true; fi
  rm -rf "$STATE"
  "$BIN" datapath uninstall --pin-root "$PINS" >/dev/null 2>&1 || true
  for ns in $NODE $EP1 $EP2 $NB $POD; do ip netns del "$ns" 2>/dev/null || true; done
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
  hmac=$(mac_of $NODE h$i)
  emac=$(mac_of "$ep" e$i)
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
passed=$(counter from_endpoint_passed)
ip netns exec $EP1 ping -c 3 -i 0.2 -I 10.200.0.1 10.200.0.2
ip netns exec $EP1 ping -6 -c 3 -i 0.2 -I fd00:200::1 fd00:200::2
[ "$(counter from_endpoint_passed)" -gt "$passed" ] || fail "from_endpoint counted no packet passed"
ok "both pings answered; from_endpoint_passed $passed -> $(counter from_endpoint_passed)"

step "Spoofed source: ep1 claims 10.200.0.99; from_endpoint drops it"
ip -n $EP1 addr add 10.200.0.99/32 dev e1
spoofed=$(counter spoof_dropped_v4)
if ip netns exec $EP1 ping -c 2 -W 1 -I 10.200.0.99 10.200.0.2; then
  fail "the spoofed ping was answered"
fi
[ "$(counter spoof_dropped_v4)" -ge $((spoofed + 2)) ] || fail "spoof_dropped_v4 did not count both packets"
ok "no answer; spoof_dropped_v4 $spoofed -> $(counter spoof_dropped_v4)"

step "ARP for 10.201.0.50 from the neighbour: answered by from_native (no kernel address holds it)"
umac=$(mac_of $NODE u0)
echo "node uplink MAC: $umac"
if ip -n $NODE addr show | grep 10.201.0.50 >/dev/null; then fail "a kernel address holds 10.201.0.50"; fi
replied=$(counter arp_replied)
reply=$(ip netns exec $NB arping -c 2 -w 3 -I n0 10.201.0.50) || fail "no ARP reply: $reply"
echo "$reply"
echo "$reply" | grep -i "\[$umac\]" >/dev/null || fail "the reply does not carry the uplink's MAC $umac"
[ "$(counter arp_replied)" -ge $((replied + 2)) ] || fail "arp_replied did not count the replies"
ok "answered with $umac; arp_replied $replied -> $(counter arp_replied)"

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
# The node's uplink address: masquerade translates to it (the config's
# [masquerade] section; the default takes the uplink's first address).
ip -n $NODE addr add 10.201.0.1/24 dev u0
mkdir -p "$STATE"
cat > "$STATE/config.toml" <<TOML
node_name = "demo-node"
state_dir = "$STATE/db"
socket = "$STATE/api.sock"
metrics_addr = "127.0.0.1:0"
reconcile_interval = "2s"
non_masquerade_cidrs = ["10.96.0.0/12"]
[datapath]
pin_root = "$PINS"
uplink = "u0"
[masquerade]
enabled = true
address_v4 = "10.201.0.1"
ports = "61000-65535"
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
  for _ in $(seq 200); do cli status >/dev/null 2>&1 && return 0; sleep 0.05; done
  cat "$STATE/agent.log" >&2
  fail "the agent did not become ready"
}
cli() { "$BIN" --socket "$STATE/api.sock" "$@"; }
start_agent
cli status

step "Allocating through the CLI (idempotent per owner; the cloud /28 hands out its first address)"
a1=$(cli allocate --kind endpoint --name pod-a --family ipv4)
a2=$(cli allocate --kind endpoint --name pod-a --family ipv4)
echo "$a1"; echo "$a2"
[ "$a1" = "$a2" ] || fail "a second allocate for pod-a gave another address"
cli allocate --kind endpoint --name pod-a --family ipv6
cli allocate --kind endpoint --name pod-b --family ipv4
cloud=$(cli allocate --pool cloud --name eni-1 --family ipv4)
echo "$cloud"
echo "$cloud" | grep '10\.0\.5\.16' >/dev/null || fail "the cloud /28 did not hand out its first address 10.0.5.16"
cli allocations
cli pools

step "The same allocations in the maps (lockstep maps dump reads the pins directly)"
"$BIN" maps dump --pin-root "$PINS"
bpftool map dump pinned "$PINS/maps/IPCACHE_HOST_V4"
cli verify

step "Drift: an entry deleted behind the agent's back with bpftool is named by verify, then repaired"
bpftool map delete pinned "$PINS/maps/IPCACHE_HOST_V4" key 10 244 1 1
if cli verify; then fail "verify did not name the deleted entry"; fi
repaired=
for _ in $(seq 100); do cli verify >/dev/null 2>&1 && { repaired=1; break; }; sleep 0.1; done
[ -n "$repaired" ] || fail "the reconcile did not repair the entry"
cli verify
cli status

step "A pod through the CNI plugin: ADD gives it an address from pool default and a veth"
ip netns add $POD
CONF=$(printf '{"cniVersion":"1.1.0","name":"demo","type":"lockstep","agentSocket":"%s"}' "$STATE/api.sock")
cni() { echo "$CONF" | in_node env CNI_COMMAND="$1" CNI_CONTAINERID=$TAG-web CNI_NETNS=/run/netns/$POD CNI_IFNAME=eth0 CNI_PATH=/opt/cni/bin "$BIN"; }
answer=$(cni ADD)
echo "$answer"
POD_IP=$(echo "$answer" | python3 -c 'import json, sys; print(json.load(sys.stdin)["ips"][0]["address"].split("/")[0])')
case "$POD_IP" in 10.244.1.*) ;; *) fail "the pod's address $POD_IP is not from pool default";; esac
ip -n $POD -br addr show eth0

step "Masquerade in BPF: the pod reaches the neighbour, which has no route back to 10.244.0.0/16"
ip -n $NB route show
if ip -n $NB route get "$POD_IP" 2>/dev/null | grep via >/dev/null; then fail "the neighbour has a route to $POD_IP"; fi
translated=$(counter masq_translated)
ip netns exec $POD ping -c 3 -i 0.2 -W 2 10.201.0.2
[ "$(counter masq_translated)" -gt "$translated" ] || fail "to_native translated nothing"
[ "$(entries NAT_FWD_V4)" -ge 1 ] || fail "no translation in NAT_FWD_V4"
echo "the translation (the pod's tuple -> node address 10.201.0.1 and a port of 61000-65535):"
"$BIN" maps dump --pin-root "$PINS" --output json |
  python3 -c 'import json, sys; d = json.load(sys.stdin); print(json.dumps({k: d[k] for k in ("NAT_FWD_V4", "MASQ_CONFIG")}, indent=1))'
"$BIN" maps dump --pin-root "$PINS" --output json |
  python3 -c 'import json, sys; c = json.load(sys.stdin)["MASQ_CONFIG"]; sys.exit(c["node_v4"] != "10.201.0.1")' ||
  fail "MASQ_CONFIG does not translate to 10.201.0.1"
ok "answered through the translation; masq_translated $translated -> $(counter masq_translated)"

step "Crash: SIGKILL the agent; the maps keep working without it; a restart restores everything"
kill -9 "$AGENT"; wait "$AGENT" 2>/dev/null || true
AGENT=
"$BIN" maps dump --pin-root "$PINS" | sed -n '/IPCACHE_V4/,/IPCACHE_V6/p'
ip netns exec $POD ping -c 2 -i 0.2 -W 2 10.201.0.2
ok "the pod reaches the neighbour with no agent running"
start_agent
cli allocations
cli verify

step "DEL: the pod's veth and address go"
cni DEL
if ip -n $POD link show eth0 >/dev/null 2>&1; then fail "the pod's eth0 is still there after DEL"; fi
if cli allocations | grep "$POD_IP" >/dev/null; then fail "$POD_IP is still allocated after DEL"; fi
ok "eth0 gone and $POD_IP released"
cli verify
kill -TERM "$AGENT"; wait "$AGENT" 2>/dev/null || true
AGENT=
echo
echo "demo finished; removing namespaces and pins"
