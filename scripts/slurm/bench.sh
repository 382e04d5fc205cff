#!/usr/bin/env bash
# Issue #17's benchmark, on the real two-node loopback cluster (scripts/slurm/cluster.sh):
#
#   bash scripts/slurm/bench.sh [AGORA] [--quick] [--json]
#
# 1. What Agora's Slurm hooks cost a job: a one-task job (`srun agora run vector-add --size 1024`)
#    from `srun` to its end, on three clusters side by side: with the project's Prolog/Epilog/
#    TaskProlog, with empty hooks (Slurm's own cost of running any hook), and with none (the task
#    then finds the daemon through AGORA_SOCKET in srun's environment); median of N runs each.
#    What Agora adds is with - empty (aim: the issue's ≤ 20 ms for what a plugin adds).
# 2. Spatial sharing (Arax's anchor: 31 % faster): two jobs, each a Rodinia mix (gaussian,
#    hotspot, nw, lavamd through Agora), on one node at once sharing its daemon, against the same
#    two jobs given the node one after the other by Slurm (`--exclusive`); makespan of each, and
#    the ratio exclusive / shared (> 1: sharing finished sooner).
# Every job's output is checked ("verified"); a run that does not verify fails the benchmark.
# --quick: 2 runs and small sizes (a smoke check that the fields exist). --json: JSON on stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
agora=target/release/agora
quick=0
json=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    --json) json=1 ;;
    *) agora=$arg ;;
  esac
done
agora=$(realpath "$agora")
[ -x "$agora" ] || { echo "slurm/bench: no agora binary at $agora (build first)" >&2; exit 1; }
command -v slurmctld >/dev/null || { echo "slurm/bench: Slurm is not installed: bash scripts/slurm/install.sh" >&2; exit 1; }
runs=$([ "$quick" = 1 ] && echo 2 || echo 9)
scale=$([ "$quick" = 1 ] && echo small || echo full)
log() { [ "$json" = 1 ] && echo "$*" >&2 || echo "$*"; }

root=$(mktemp -d -t agora-slurm-bench-XXXXXX)
chmod 0755 "$root"
pids=()
clusters=()
cleanup() {
  for dir in "${clusters[@]}"; do bash scripts/slurm/cluster.sh stop "$dir" >/dev/null 2>&1 || true; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$root"
}
trap cleanup EXIT

. scripts/slurm/common.sh

# A cluster in $root/$1, one Agora daemon per node; $2: Agora's hooks (hooks), empty hooks
# (empty) or none.
start_cluster() {
  local dir="$root/$1" hooks=$2 extra=""
  mkdir -p "$dir"
  chmod 0755 "$dir"
  start_agora_daemons "$dir" || exit 1
  case "$hooks" in
    hooks) extra=$(write_hooks "$dir") ;;
    empty) extra=$(write_hooks "$dir" empty) ;; # what Slurm's own hook mechanism costs
  esac
  SLURM_EXTRA_CONF="$extra" bash scripts/slurm/cluster.sh start "$dir" >/dev/null
  clusters+=("$dir")
}

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

# Median of the numbers given.
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }

# srun -> end of a one-task job, N times; prints the times in ms.
srun_times() {
  local dir=$1 times=()
  for _ in $(seq 1 "$runs"); do
    local t0 out
    t0=$(now_ms)
    out=$(SLURM_CONF="$dir/slurm.conf" AGORA_SOCKET="$dir/agora-n1.sock" \
      srun -w n1 --gres=agora:1 "$agora" run vector-add --size 1024 2>&1) || { echo "slurm/bench: srun failed: $out" >&2; exit 1; }
    echo "$out" | grep -q "verified OK" || { echo "slurm/bench: job did not verify: $out" >&2; exit 1; }
    times+=($(( $(now_ms) - t0 )))
  done
  echo "${times[@]}"
}

start_cluster with hooks
start_cluster empty empty
start_cluster without none
log "slurm/bench: clusters up (Agora's hooks, empty hooks, no hooks)"
with_times=($(srun_times "$root/with"))
empty_times=($(srun_times "$root/empty"))
without_times=($(srun_times "$root/without"))
with_ms=$(median "${with_times[@]}")
empty_ms=$(median "${empty_times[@]}")
without_ms=$(median "${without_times[@]}")
min() { printf '%s\n' "$@" | sort -n | head -1; }
log "slurm/bench: srun to the end of a one-task job: Agora's hooks ${with_times[*]} ms (min $(min "${with_times[@]}"), median $with_ms), empty hooks ${empty_times[*]} ms (min $(min "${empty_times[@]}"), median $empty_ms), none ${without_times[*]} ms (min $(min "${without_times[@]}"), median $without_ms)"

# Two jobs, each a Rodinia mix, sharing n1 through its daemon vs one after the other.
if [ "$scale" = small ]; then
  mix="$agora run gaussian --size 64 && $agora run hotspot --size 64 && $agora run nw --size 256 && $agora run lavamd --size 2"
else
  mix="$agora run gaussian --size 384 && $agora run hotspot --size 512 && $agora run nw --size 2048 && $agora run lavamd --size 6"
fi
dir="$root/with"
export SLURM_CONF="$dir/slurm.conf"
wait_jobs() {
  for _ in $(seq 1 6000); do
    [ -z "$(squeue -h -j "$(IFS=,; echo "$*")" 2>/dev/null)" ] && return 0
    sleep 0.05
  done
  echo "slurm/bench: jobs $* still running after 300 s" >&2
  exit 1
}
makespan() {
  local mode=$1 t0 a b
  t0=$(now_ms)
  a=$(sbatch --parsable -w n1 $mode -o "$dir/$2-a.out" --wrap "$mix")
  b=$(sbatch --parsable -w n1 $mode -o "$dir/$2-b.out" --wrap "$mix")
  wait_jobs "$a" "$b"
  local took=$(( $(now_ms) - t0 ))
  for out in "$dir/$2-a.out" "$dir/$2-b.out"; do
    [ "$(grep -c 'verified OK' "$out")" = 4 ] || { echo "slurm/bench: a job did not verify: $(cat "$out")" >&2; exit 1; }
  done
  echo "$took"
}
shared_runs=()
exclusive_runs=()
for _ in $(seq 1 $([ "$quick" = 1 ] && echo 1 || echo 3)); do
  shared_runs+=($(makespan "--gres=agora:1" shared))
  exclusive_runs+=($(makespan "--exclusive" exclusive))
done
shared_ms=$(median "${shared_runs[@]}")
exclusive_ms=$(median "${exclusive_runs[@]}")
ratio=$(awk -v e="$exclusive_ms" -v s="$shared_ms" 'BEGIN {printf "%.3f", e / s}')
log "slurm/bench: two Rodinia-mix jobs on n1: sharing it ${shared_runs[*]} ms (median $shared_ms), one after the other ${exclusive_runs[*]} ms (median $exclusive_ms): exclusive / shared = $ratio"

if [ "$json" = 1 ]; then
  python3 - "$with_ms" "$without_ms" "$shared_ms" "$exclusive_ms" "$ratio" "$runs" "${with_times[*]}" "${without_times[*]}" "${shared_runs[*]}" "${exclusive_runs[*]}" "$empty_ms" "${empty_times[*]}" <<'PY'
import json, os, sys
a = sys.argv[1:]
nums = lambda s: [float(x) for x in s.split()]
print(json.dumps({
    "srun_to_end_with_hooks_ms": float(a[0]),
    "srun_to_end_without_hooks_ms": float(a[1]),
    "hooks_add_ms": float(a[0]) - float(a[1]),
    "srun_to_end_empty_hooks_ms": float(a[10]),
    "agora_hooks_over_empty_ms": float(a[0]) - float(a[10]),
    # srun's times fall in ~100 ms steps (Slurm's own polling), so medians jump between modes;
    # the minima compare like with like.
    "agora_hooks_over_empty_min_ms": min(nums(a[6])) - min(nums(a[11])),
    "empty_hooks_over_none_min_ms": min(nums(a[11])) - min(nums(a[7])),
    "empty_hooks_ms": nums(a[11]),
    "shared_makespan_ms": float(a[2]),
    "exclusive_makespan_ms": float(a[3]),
    "exclusive_over_shared": float(a[4]),
    "runs": int(a[5]),
    "with_hooks_ms": nums(a[6]), "without_hooks_ms": nums(a[7]),
    "shared_ms": nums(a[8]), "exclusive_ms": nums(a[9]),
    "load_average_at_start": os.getloadavg()[0],
}, indent=2))
PY
fi
