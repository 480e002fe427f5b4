#!/usr/bin/env bash
# A test cluster of K "hosts" on one machine: each host is a Linux network
# namespace with its own hostname (UTS namespace, set for every process the
# launcher starts there), loopback up, and one veth into a bridge in the root
# namespace. mpirun runs in one more namespace on the bridge, the "launcher
# host". Addresses come from the benchmarking range 198.18.0.0/15 only: host i
# is 198.18.N.(i+1)/24, the launcher 198.18.N.254/24 (N = DSC_NET, default 0);
# the bridge has none. No other route, no forwarding, no IPv6, nothing
# downloaded. Inside every namespace TCP gives up on an unacknowledged
# connection after ~3 s (net.ipv4.tcp_retries2 = DSC_TCP_RETRIES2, default 2;
# the kernel default 15 is ~15 min), so that mpirun notices a host whose link
# died instead of waiting for its daemon for a quarter of an hour.
#
#   scripts/cluster.sh [--hosts K] [--rate RATE] up     make it (idempotent; K default 3,
#                                                       RATE a tc rate, e.g. 1gbit; unshaped by default)
#   scripts/cluster.sh down                             remove everything it made (also after a crash)
#   scripts/cluster.sh status                           hosts, addresses, shaping, processes
#   scripts/cluster.sh run [--ppn N] [--np N] [--hosts-used H] -- PROGRAM ARGS...
#                                                       mpirun across the hosts (N ranks per host)
#   scripts/cluster.sh exec HOST CMD...                 run CMD inside HOST (its namespace + hostname)
#   scripts/cluster.sh link HOST up|down                unplug / plug HOST's cable: its switch port
#                                                       (the bridge end of the veth) goes down, the
#                                                       host sees no carrier (NO-CARRIER), its
#                                                       address and routes stay
#   scripts/cluster.sh shape HOST RATE|none             shape (tbf) HOST's link both ways
#   scripts/cluster.sh kill HOST                        SIGKILL every process in HOST's namespace
#   scripts/cluster.sh pids [HOST]                      processes in HOST's (every host's and the
#                                                       launcher's) namespace
#   scripts/cluster.sh counters HOST                    "tx_bytes rx_bytes tx_packets rx_packets"
#                                                       of HOST's interface
#   scripts/cluster.sh check                            exit 0 if the cluster can be made here, else
#                                                       print the reason and exit 77 (tests: skip)
#
# Hosts are named dsc-h0 .. dsc-h{K-1} (namespace = hostname = hostfile name;
# DSC_PREFIX changes "dsc"). `run` uses Open MPI without ssh: plm_rsh_agent is
# a small script (written by `up` into the state directory) that starts the
# daemon inside the host's namespace under `unshare --uts` with the host's
# hostname, so Open MPI sees K different nodes: ranks on one host share memory
# (vader), ranks on different hosts talk TCP through the (shaped) veths only
# (btl tcp,self,vader; btl/oob_tcp_if_include = the cluster subnet).
# Extra mpirun flags: DSC_MPIRUN_FLAGS. tbf's queue bound: DSC_TBF_LATENCY
# (default 50ms). Needs root, ip netns, veth, bridge.
set -euo pipefail

prefix=${DSC_PREFIX:-dsc}
# Interface names have 15 characters at most ("<prefix>-h199-r").
[[ $prefix =~ ^[a-z][a-z0-9]{0,5}$ ]] || { echo "cluster.sh: DSC_PREFIX=$prefix: 1-6 of [a-z0-9]" >&2; exit 1; }
state=/run/${prefix}-cluster
net=${DSC_NET:-0}
[[ $net =~ ^[0-9]+$ ]] && ((net <= 255)) || { echo "cluster.sh: DSC_NET=$net: 0..255" >&2; exit 1; }
subnet=198.18.$net.0/24
bridge=${prefix}-br
launcher=${prefix}-l
launcher_addr=198.18.$net.254
retries2=${DSC_TCP_RETRIES2:-2}
tbf_latency=${DSC_TBF_LATENCY:-50ms}
hosts=""
rate=""

die() { echo "cluster.sh: $*" >&2; exit 1; }
T() { timeout 20 "$@"; }  # every ip/tc call is bounded

host_name() { echo "${prefix}-h$1"; }
host_addr() { echo "198.18.$net.$(($1 + 1))"; }
veth_root() { echo "${prefix}-h$1-r"; }  # root end, on the bridge
veth_in=${prefix}eth                    # the host's end, inside its namespace

# Host index from a name (dsc-h2 -> 2), validated against the state.
host_index() {
  local h=$1 k
  [[ $h =~ ^${prefix}-h([0-9]+)$ ]] || [[ $h =~ ^([0-9]+)$ ]] || die "unknown host '$h'"
  k=${BASH_REMATCH[1]}
  ((k < $(state_hosts))) || die "host $h: the cluster has $(state_hosts) hosts"
  echo "$k"
}

state_hosts() { [[ -f $state/hosts ]] && cat "$state/hosts" || echo 0; }

check() {
  if ((EUID != 0)); then echo "needs root (uid $EUID)"; return 77; fi
  command -v ip >/dev/null || { echo "no 'ip' command"; return 77; }
  command -v unshare >/dev/null || { echo "no 'unshare' command"; return 77; }
  local probe=${prefix}pr$((RANDOM % 10000))
  if ! T ip netns add "$probe" 2>/tmp/.${prefix}-probe.$$; then
    echo "ip netns add refused: $(cat /tmp/.${prefix}-probe.$$)"
    rm -f /tmp/.${prefix}-probe.$$
    return 77
  fi
  local ok=0 why=""
  if ! why=$(T ip netns exec "$probe" unshare --uts true 2>&1); then
    ok=77 why="unshare --uts refused inside a namespace: $why"
  elif ! why=$(T ip link add "${probe}a" type veth peer name "${probe}b" 2>&1); then
    ok=77 why="cannot make a veth pair: $why"
  fi
  T ip link del "${probe}a" 2>/dev/null || true
  T ip netns del "$probe" 2>/dev/null || true
  rm -f /tmp/.${prefix}-probe.$$
  [[ -n $why && $ok != 0 ]] && echo "$why"
  return $ok
}

# tbf both ways on one host's link: egress of the host's end (what it sends)
# and of the root end (what it receives). burst: 1 ms worth of bytes, at
# least 64 KiB so that GSO segments pass; latency bounds the queue.
shape_host() {
  local k=$1 r=$2 ns
  ns=$(host_name "$k")
  T ip netns exec "$ns" tc qdisc del dev "$veth_in" root 2>/dev/null || true
  T tc qdisc del dev "$(veth_root "$k")" root 2>/dev/null || true
  if [[ -n $r && $r != none ]]; then
    local burst=$(( $(rate_bits "$r") / 8 / 1000 ))
    ((burst < 65536)) && burst=65536
    T ip netns exec "$ns" tc qdisc add dev "$veth_in" root tbf rate "$r" burst "$burst" latency "$tbf_latency"
    T tc qdisc add dev "$(veth_root "$k")" root tbf rate "$r" burst "$burst" latency "$tbf_latency"
  fi
  echo "${r:-none}" >"$state/rate.$k"
}

# "1gbit" -> 1000000000 (tc's decimal units).
rate_bits() {
  local r=${1,,} n unit
  [[ $r =~ ^([0-9]+)([kmg]?)bit$ ]] || die "rate '$1': use e.g. 100mbit, 1gbit, 10gbit"
  n=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
  case $unit in k) n=$((n * 1000)) ;; m) n=$((n * 1000000)) ;; g) n=$((n * 1000000000)) ;; esac
  echo "$n"
}

write_agent() {
  # Open MPI calls: AGENT HOST COMMAND... (the command is a shell string, as
  # for ssh). Runs it inside HOST's namespace with HOST as hostname.
  cat >"$state/agent" <<EOF
#!/bin/sh
# plm_rsh_agent of scripts/cluster.sh (written by 'up'; do not edit).
while [ \$# -gt 0 ]; do case "\$1" in -*) shift ;; *) break ;; esac; done
host=\$1; shift
case "\$host" in ${prefix}-h[0-9]*) ;; *) echo "cluster agent: unknown host \$host" >&2; exit 1 ;; esac
exec ip netns exec "\$host" unshare --uts -- /bin/sh -c "hostname \$host && \$*"
EOF
  chmod +x "$state/agent"
}

# Only 198.18.0.0/15 addresses: no IPv6 link-local ones on our links.
no_ipv6() { echo 1 >"/proc/sys/net/ipv6/conf/$1/disable_ipv6" 2>/dev/null || true; }

# One namespace NS with its veth (root end VR on the bridge), address ADDR.
make_ns() {
  local ns=$1 vr=$2 addr=$3
  [[ -e /run/netns/$ns ]] || T ip netns add "$ns"
  if ! ip link show "$vr" >/dev/null 2>&1; then
    T ip link add "$vr" type veth peer name "$veth_in" netns "$ns"
  fi
  no_ipv6 "$vr"
  T ip netns exec "$ns" sh -c "echo 1 >/proc/sys/net/ipv6/conf/$veth_in/disable_ipv6" 2>/dev/null || true
  T ip netns exec "$ns" sh -c "echo $retries2 >/proc/sys/net/ipv4/tcp_retries2"
  T ip link set "$vr" master "$bridge"
  T ip link set "$vr" up
  T ip netns exec "$ns" ip link set lo up
  T ip netns exec "$ns" ip addr replace "$addr/24" dev "$veth_in"
  T ip netns exec "$ns" ip link set "$veth_in" up
}

up() {
  local k=${hosts:-3}
  ((k >= 1 && k <= 200)) || die "--hosts $k: 1..200"
  local old
  old=$(state_hosts)
  if ((old > 0 && old != k)); then down; fi
  mkdir -p "$state"
  if ! ip link show "$bridge" >/dev/null 2>&1; then
    T ip link add "$bridge" type bridge
  fi
  no_ipv6 "$bridge"
  T ip link set "$bridge" up
  make_ns "$launcher" "$launcher-r" "$launcher_addr"
  for ((i = 0; i < k; ++i)); do make_ns "$(host_name "$i")" "$(veth_root "$i")" "$(host_addr "$i")"; done
  echo "$k" >"$state/hosts"
  for ((i = 0; i < k; ++i)); do shape_host "$i" "$rate"; done
  write_agent
  # Carrier on every link before we say "up".
  for ns in "$launcher" $(for ((i = 0; i < k; ++i)); do host_name "$i"; done); do
    local tries=0
    until [[ $(ip netns exec "$ns" cat /sys/class/net/$veth_in/operstate 2>/dev/null) == up ]]; do
      ((++tries < 50)) || die "$ns: link not up"
      sleep 0.1
    done
  done
  echo "cluster up: $k hosts (${rate:-unshaped}), launcher $launcher_addr, subnet $subnet"
}

down() {
  # Everything named with our prefix, whatever the state file says (a crash
  # may have left half a cluster).
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}-(h[0-9]+|l)$" || true); do
    local pids
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [[ -n $pids ]] && kill -KILL $pids 2>/dev/null || true
    # Until they are gone (a killed process lingers while the kernel tears it
    # down): `down` returns with nothing of ours left running.
    local i
    for ((i = 0; i < 100; ++i)); do
      local live="" p
      for p in $(ip netns pids "$ns" 2>/dev/null); do
        local st
        st=$(ps -o stat= -p "$p" 2>/dev/null || true)
        [[ -z $st || $st == Z* ]] || live+=" $p"
      done
      [[ -z $live ]] && break
      sleep 0.1
    done
    T ip netns del "$ns" || true
  done
  local l
  for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' |
             grep -E "^${prefix}-(h[0-9]+|l)-r$" || true); do
    T ip link del "$l" 2>/dev/null || true
  done
  if ip link show "$bridge" >/dev/null 2>&1; then T ip link del "$bridge"; fi
  rm -rf "$state"
  # Open MPI's session directories of our hosts (named by hostname), left
  # behind when a host's daemon was killed.
  rm -rf /tmp/ompi."${prefix}"-h[0-9]*.* /tmp/ompi."${prefix}"-launcher.*
}

status() {
  local k
  k=$(state_hosts)
  if ((k == 0)); then echo "cluster: down"; return 1; fi
  echo "cluster: $k hosts, launcher $launcher ($launcher_addr, $(ip netns pids "$launcher" 2>/dev/null | wc -l) processes), subnet $subnet"
  for ((i = 0; i < k; ++i)); do
    local ns link pids
    ns=$(host_name "$i")
    link=$(ip netns exec "$ns" cat /sys/class/net/$veth_in/operstate 2>/dev/null || echo "?")
    pids=$(ip netns pids "$ns" 2>/dev/null | wc -l)
    echo "  $ns $(host_addr "$i") link=$link rate=$(cat "$state/rate.$i" 2>/dev/null || echo none)" \
         "processes=$pids"
  done
}

run() {
  local k ppn=1 np="" used=""
  k=$(state_hosts)
  ((k > 0)) || die "cluster is down (scripts/cluster.sh up first)"
  while (($#)); do
    case $1 in
      --ppn) ppn=$2; shift 2 ;;
      --np) np=$2; shift 2 ;;
      --hosts-used) used=$2; shift 2 ;;
      --) shift; break ;;
      *) break ;;
    esac
  done
  (($#)) || die "run: no program"
  used=${used:-$k}
  ((used <= k)) || die "run: --hosts-used $used > $k hosts"
  np=${np:-$((used * ppn))}
  local hostfile
  hostfile=$(mktemp "$state/hostfile.XXXXXX")  # `down` removes it if we are killed
  for ((i = 0; i < used; ++i)); do echo "$(host_name "$i") slots=$ppn" >>"$hostfile"; done
  local rc=0
  # shellcheck disable=SC2086
  ip netns exec "$launcher" unshare --uts -- env OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 sh -c 'hostname "$0" && exec "$@"' "${prefix}-launcher" \
  mpirun --hostfile "$hostfile" -np "$np" --map-by ppr:"$ppn":node --bind-to none \
    --mca plm_rsh_agent "$state/agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca btl tcp,self,vader --mca btl_tcp_if_include "$subnet" \
    --mca oob_tcp_if_include "$subnet" --mca pml ob1 \
    ${DISTSTRAT_FLIGHT_RECORDER_DIR:+-x DISTSTRAT_FLIGHT_RECORDER_DIR} \
    ${DSC_MPIRUN_FLAGS:-} "$@" || rc=$?
  rm -f "$hostfile"
  return $rc
}

cmd=""
while (($#)); do
  case $1 in
    --hosts) hosts=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) cmd=$1; shift; break ;;
  esac
done
[[ -n $rate && $rate != none ]] && rate_bits "$rate" >/dev/null

case $cmd in
  check) check ;;
  up) ((EUID == 0)) || die "needs root"; up ;;
  down) ((EUID == 0)) || die "needs root"; down ;;
  status) status ;;
  run) run "$@" ;;
  exec)
    h=$(host_name "$(host_index "$1")"); shift
    exec ip netns exec "$h" unshare --uts -- /bin/sh -c 'hostname "$0" && exec "$@"' "$h" "$@" ;;
  link)
    i=$(host_index "$1")
    [[ $2 == up || $2 == down ]] || die "link HOST up|down"
    T ip link set "$(veth_root "$i")" "$2" ;;
  shape) i=$(host_index "$1"); shape_host "$i" "$2" ;;
  kill)
    i=$(host_index "$1")
    pids=$(ip netns pids "$(host_name "$i")" || true)
    [[ -n $pids ]] && kill -KILL $pids 2>/dev/null || true ;;
  pids)
    if (($#)); then ip netns pids "$(host_name "$(host_index "$1")")"; else
      for ((i = 0; i < $(state_hosts); ++i)); do ip netns pids "$(host_name "$i")"; done
      ip netns pids "$launcher" 2>/dev/null
    fi ;;
  counters)
    i=$(host_index "$1")
    ip netns exec "$(host_name "$i")" sh -c \
      "cd /sys/class/net/$veth_in/statistics && cat tx_bytes rx_bytes tx_packets rx_packets" |
      tr '\n' ' '
    echo ;;
  "") die "no command (up|down|status|run|exec|link|shape|kill|pids|counters|check)" ;;
  *) die "unknown command '$cmd'" ;;
esac
