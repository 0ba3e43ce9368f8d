#!/usr/bin/env bash
# A second "cluster" on this machine: a Linux network namespace joined to the root one by a veth pair
# whose namespace side shapes its egress with tc tbf (the PrfaaS cluster's link; netem is not
# available on every kernel, tbf is). Needs root, iproute2 (ip, tc).
#
#   ci/netns.sh check                          exit 0 if a namespace can be made here, else say why
#   ci/netns.sh up   [--name N] [--rate R]     make namespace N (default xprfaas): root side 10.77.0.1,
#                                              namespace side 10.77.0.2, egress from N shaped to R
#                                              (tc units: 100mbit, 20mbit; default 100mbit)
#   ci/netns.sh rate [--name N] --rate R       change the shaped rate now (a mid-run cut)
#   ci/netns.sh stats [--name N]               bytes and packets N sent through the shaper (JSON)
#   ci/netns.sh down [--name N]                remove the namespace and the veth pair
#
# --local-ip / --remote-ip change the two addresses (a /24 between them).
set -euo pipefail

cmd="${1:-}"; shift || true
name=xprfaas; rate=100mbit; local_ip=10.77.0.1; remote_ip=10.77.0.2
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --local-ip) local_ip="$2"; shift 2 ;;
    --remote-ip) remote_ip="$2"; shift 2 ;;
    *) echo "netns.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ ${#name} -le 13 ] || { echo "netns.sh: --name at most 13 characters (interface names are 15)" >&2; exit 2; }
host_if="${name}-h"; ns_if="${name}-n"

shape() {  # $1: add | change
  # burst: 20 ms at the rate, at least a few full-size packets (a large burst would let short
  # transfers through faster than the rate); latency bounds the queue tbf keeps
  local burst
  burst=$(echo "$rate" | awk '{ v = $0 + 0; u = tolower($0); sub(/^[0-9.]+/, "", u);
    m = (u ~ /^g/) ? 1e9 : (u ~ /^m/) ? 1e6 : (u ~ /^k/) ? 1e3 : 1; if (u ~ /bps$/) m *= 8;
    b = int(v * m / 8 / 50); if (b < 4096) b = 4096; print b }')
  ip netns exec "$name" tc qdisc "$1" dev "$ns_if" root tbf rate "$rate" burst "$burst" latency 400ms
}

case "$cmd" in
  check)
    [ "$(id -u)" = 0 ] || { echo "network namespaces need root (uid $(id -u))"; exit 1; }
    command -v ip >/dev/null || { echo "iproute2's 'ip' is not installed (apt-get install iproute2)"; exit 1; }
    command -v tc >/dev/null || { echo "iproute2's 'tc' is not installed (apt-get install iproute2)"; exit 1; }
    probe="xnschk$$"
    if ! err=$(ip netns add "$probe" 2>&1); then echo "cannot create a network namespace: $err"; exit 1; fi
    ok=0
    if err=$(ip link add "${probe}a" type veth peer name "${probe}b" 2>&1); then
      ip link set "${probe}b" netns "$probe" 2>/dev/null || true
      if err=$(ip netns exec "$probe" tc qdisc add dev "${probe}b" root tbf rate 10mbit burst 32kb latency 50ms 2>&1); then
        ok=1
      else
        err="tc tbf is not available: $err"
      fi
      ip link del "${probe}a" 2>/dev/null || true
    else
      err="cannot create a veth pair: $err"
    fi
    ip netns del "$probe" 2>/dev/null || true
    [ "$ok" = 1 ] || { echo "$err"; exit 1; }
    echo "network namespaces, veth and tc tbf work here"
    ;;
  up)
    "$0" down --name "$name" >/dev/null 2>&1 || true
    ip netns add "$name"
    ip link add "$host_if" type veth peer name "$ns_if"
    ip link set "$ns_if" netns "$name"
    ip addr add "$local_ip/24" dev "$host_if"
    ip link set "$host_if" up
    ip netns exec "$name" ip addr add "$remote_ip/24" dev "$ns_if"
    ip netns exec "$name" ip link set "$ns_if" up
    ip netns exec "$name" ip link set lo up
    shape add
    echo "netns $name up: $local_ip (here) <-> $remote_ip (in $name), $name's egress shaped to $rate"
    ;;
  rate)
    shape change
    echo "netns $name: egress shaped to $rate"
    ;;
  stats)
    ip netns exec "$name" tc -s qdisc show dev "$ns_if" | awk -v rate="$rate" '
      /Sent/ { printf "{\"sent_bytes\": %s, \"sent_packets\": %s, \"dropped\": %s}\n", $2, $4, $7 + 0 }'
    ;;
  down)
    ip link del "$host_if" 2>/dev/null || true
    ip netns del "$name" 2>/dev/null || true
    ;;
  *)
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
