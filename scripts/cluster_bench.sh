#!/usr/bin/env bash
# Benchmarks on the namespace cluster (scripts/cluster.sh; needs root):
#   scripts/cluster_bench.sh [wire] [train] [busbw] [ps]     (default: all)
# BUILD (default build) holds the benchmarks; OUT (default /tmp/cluster_bench)
# receives the logs and timelines. Uses its own cluster (DSC_PREFIX=dscb,
# 198.18.2.0/24), torn down on exit.
#   wire   bytes on the wire vs the cost model: each host's tx counter around
#          two runs of N1 and N2 all-reduces of n bytes, per call =
#          (tx(N2) - tx(N1)) / (N2 - N1), so start-up and tear-down cancel.
#          ring on 3 hosts x 1 (model 2(p-1)/p n per host), ring and
#          hierarchical on 2 hosts x 2 (hierarchical: ranks of a host meet in
#          shared memory, only the cross-host step touches the wire: model
#          2(N-1)/N n per host for N hosts, flat ring over 4 ranks 3/4 n per
#          rank-crossing), and the multi-worker strategy's wire compression
#          (train_bench --compression f16|bf16 vs none: half the bytes).
#   train  1 Gbit/s links, 2 hosts x 1: train_bench --strategy multi_worker,
#          overlap on/off, MLP width x depth 256x2, 1024x2, 512x6, 1024x4
#          (compression none; bf16 too for the last two), three alternating
#          rounds, with timelines.
#   busbw  1 Gbit/s links, 2 hosts x 1: allreduce_bench 64 MiB (ring, mpi)
#          vs the link rate.
#   ps     parameter server across hosts: 1 PS host + 2 workers; fashion_mnist
#          to the usual bar with equal links, then worker host 1's link at
#          1/10 of the others (100 Mbit/s vs 1 Gbit/s), async and with
#          --max-staleness 2. The final line is the chief's (worker 0, on a
#          fast link); the job's wall time includes the slow worker's share.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
build=${BUILD:-$root/build}
out=${OUT:-/tmp/cluster_bench}
cluster=$here/cluster.sh
export DSC_PREFIX=${DSC_PREFIX:-dscb} DSC_NET=${DSC_NET:-2}
mkdir -p "$out"
sections=("$@")
((${#sections[@]})) || sections=(wire train busbw ps)
trap 'timeout 60 "$cluster" down >/dev/null 2>&1' EXIT
trap 'exit 1' INT TERM
why=$(timeout 30 "$cluster" check) || { echo "cluster_bench: cannot make the cluster: $why"; exit 77; }

up() { timeout 60 "$cluster" down >/dev/null 2>&1; timeout 60 "$cluster" "$@" up >/dev/null || exit 1; }
tx_sum() {  # tx bytes of hosts 0..K-1, space separated
  local k=$1 i
  for ((i = 0; i < k; ++i)); do timeout 5 "$cluster" counters "$i" | awk '{printf "%s ", $1}'; done
}
run() { timeout -s KILL 580 "$cluster" run "$@"; }

# per_call HOSTS PPN N1 N2 CMD_WITH_@N@ -> mean tx bytes per host per call
per_call() {
  local k=$1 ppn=$2 n1=$3 n2=$4
  shift 4
  local -a b1 a1 b2 a2
  read -ra b1 <<<"$(tx_sum "$k")"
  # shellcheck disable=SC2046  # the command is split into words on purpose
  run --ppn "$ppn" --hosts-used "$k" -- $(echo "$@" | sed "s/@N@/$n1/g") >>"$out/wire.log" 2>&1
  read -ra a1 <<<"$(tx_sum "$k")"
  read -ra b2 <<<"$(tx_sum "$k")"
  # shellcheck disable=SC2046
  run --ppn "$ppn" --hosts-used "$k" -- $(echo "$@" | sed "s/@N@/$n2/g") >>"$out/wire.log" 2>&1
  read -ra a2 <<<"$(tx_sum "$k")"
  local i s=0
  for ((i = 0; i < k; ++i)); do
    s=$((s + (a2[i] - b2[i]) - (a1[i] - b1[i])))
  done
  echo $((s / k / (n2 - n1)))
}

row() {  # name hosts ppn measured model
  awk -v name="$1" -v h="$2" -v p="$3" -v m="$4" -v mod="$5" 'BEGIN {
    printf "| %-34s | %d x %d | %12d | %12d | %6.3f |\n", name, h, p, m, mod, m / mod }'
}

wire() {
  : >"$out/wire.log"
  local n=$((4 << 20)) ab=$build/benchmarks/allreduce_bench
  local ar="$ab --min-bytes $n --max-bytes $n --iters @N@ --warmup 2 --dtype float32"
  {
    echo "bytes on the wire per host per all-reduce of n = $n bytes (f32), measured vs model"
    echo "| run                                | hosts x ranks | measured B | model B | ratio |"
    echo "|---|---|---|---|---|"
    up --hosts 3
    row "ring (allreduce_bench --algos ring)" 3 1 "$(per_call 3 1 10 30 "$ar --algos ring")" $((2 * 2 * n / 3))
    up --hosts 2
    row "ring" 2 1 "$(per_call 2 1 10 30 "$ar --algos ring")" $((n))
    row "ring over 4 ranks" 2 2 "$(per_call 2 2 10 30 "$ar --algos ring")" $((2 * 3 * n / 4))
    row "hierarchical" 2 2 "$(per_call 2 2 10 30 "$ar --algos hierarchical")" $((n))
    # The strategy's gradients: the MLP 784-256-256-10 has 269322 f32
    # parameters; one fused all-reduce per step without overlap.
    local g=$((269322 * 4)) tb=$build/benchmarks/train_bench
    local t="$tb --strategy multi_worker --no-overlap --warmup 5 --steps @N@"
    row "train_bench, compression none" 2 1 "$(per_call 2 1 20 60 "$t --compression none")" $((g))
    row "train_bench, compression f16" 2 1 "$(per_call 2 1 20 60 "$t --compression f16")" $((g / 2))
    row "train_bench, compression bf16" 2 1 "$(per_call 2 1 20 60 "$t --compression bf16")" $((g / 2))
  } | tee "$out/wire.md"
}

train() {
  up --hosts 2 --rate 1gbit
  : >"$out/train.log"
  local tb=$build/benchmarks/train_bench cfg w d c o r
  {
    echo "train_bench --strategy multi_worker, 2 hosts x 1 rank, links 1 Gbit/s, batch 128/replica,"
    echo "three alternating rounds (samples/s)"
    echo "| width x depth | compression | overlap | no overlap |"
    echo "|---|---|---|---|"
    for cfg in 256:2 1024:2 512:6 1024:4; do
      w=${cfg%:*} d=${cfg#*:}
      for c in none bf16; do
        [[ $c == bf16 && $cfg != 512:6 && $cfg != 1024:4 ]] && continue
        local -A got=()
        for r in 1 2 3; do
          for o in overlap no-overlap; do
            local steps=200 line
            ((w > 256 || d > 2)) && steps=60
            line=$(run --ppn 1 -- "$tb" --strategy multi_worker --width "$w" --depth "$d" \
                     --compression "$c" --"$o" --steps "$steps" --warmup 10 \
                     --timeline "$out/timeline_w${w}_d${d}_${c}_${o}_$r.json" 2>&1 |
                   tee -a "$out/train.log" | grep "^train_bench:")
            got[$o]+="$(echo "$line" | sed -n 's/.*samples_per_sec=\([0-9]*\).*/\1/p') "
          done
        done
        echo "| $w x $d | $c | ${got[overlap]}| ${got[no-overlap]}|"
        unset got
      done
    done
  } | tee "$out/train.md"
}

busbw() {
  up --hosts 2 --rate 1gbit
  {
    echo "allreduce_bench 64 MiB f32, 2 hosts x 1 rank, links 1 Gbit/s (= 125 MB/s, 0.125 GB/s)"
    run --ppn 1 -- "$build/benchmarks/allreduce_bench" --algos ring,mpi --min-bytes $((64 << 20)) \
      --max-bytes $((64 << 20)) --iters 5 --warmup 1 2>&1 | grep -vE "^\[|setpgid"
  } | tee "$out/busbw.md"
}

ps() {
  local fm=$build/examples/fashion_mnist
  [[ -f $fm ]] || fm=$build/examples/fashion_mnist/fashion_mnist
  # The final line is the chief's (worker 0, host 0, always on a fast link):
  # its own epoch time shows whether the slow worker held it back; the job's
  # wall time includes the slow worker finishing its share.
  psrun() {
    local t0=$SECONDS line
    line=$(run --ppn 1 -- "$fm" --strategy parameter_server --ps 1 --epochs 1 "$@" 2>&1 |
           tr '\r' '\n' | tee -a "$out/ps.log" | grep -E "^final:")
    echo "| $1 ${2:-} | $line | job wall $((SECONDS - t0)) s |"
  }
  : >"$out/ps.log"
  {
    echo "fashion_mnist --strategy parameter_server --ps 1 --epochs 1, 3 hosts x 1 (workers h0, h1; PS h2)"
    up --hosts 3 --rate 1gbit
    echo "equal links (1 Gbit/s):"
    psrun --max-staleness -1
    timeout 20 "$cluster" shape 1 100mbit
    echo "worker host 1 at 100 Mbit/s, the others 1 Gbit/s:"
    psrun --max-staleness -1
    psrun --max-staleness 2
  } | tee "$out/ps.md"
}

for s in "${sections[@]}"; do
  case $s in
    wire | train | busbw | ps) "$s" ;;
    *) echo "unknown section $s (wire train busbw ps)"; exit 2 ;;
  esac
done
