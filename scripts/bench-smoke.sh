#!/usr/bin/env bash
# Smoke check of one `agora bench` run: `bash scripts/bench-smoke.sh AGORA bench NAME --quick
# --json` runs that command and checks its JSON for the fields the benchmark's documentation
# promises and for verified results. `make test` runs it once per benchmark (the Makefile lists
# every `agora bench NAME --quick` run), so no benchmark can silently break. Timings are printed,
# never asserted (speed lives in the full benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ "$#" -lt 3 ] || [ "$2" != bench ]; then
  echo "usage: $0 AGORA bench NAME --quick --json" >&2
  exit 2
fi
bench=$3
state=$(mktemp -d -t agora-bench-smoke-XXXXXX)
trap 'rm -rf "$state"' EXIT
export AGORA_STATE_DIR="$state" AGORA_LOG=warn
# NVRTC and ptxas from PyPI, installed into .venv by setup.sh (`bench gpu` times them without a
# GPU); a value set by the caller wins.
nvidia=$(ls -d .venv/lib/python3*/site-packages/nvidia 2>/dev/null | head -1)
export AGORA_NVRTC=${AGORA_NVRTC:-${nvidia:+$PWD/$nvidia/cuda_nvrtc/lib/libnvrtc.so.12}}
export AGORA_PTXAS=${AGORA_PTXAS:-${nvidia:+$PWD/$nvidia/cuda_nvcc/bin/ptxas}}

# The checks, by benchmark: a Python expression over `d` (the parsed JSON) that must hold.
case "$bench" in
  stall) expr='all(k in d for k in ("quiet_p99_ns", "attack_p99_ns", "p99_ratio", "dispatcher_longest_ms", "attack_stalls", "attack_max_ns", "attack", "runs", "neighbour_class")) and d["batch_priority"] in ("auto", "batch") and d["quiet_p99_ns"] > 0 and all(r["attack_launches"] > 0 and r["attack_stalls"] >= 0 and r["batch_priority_under_attack"] in ("idle", "batch") for r in d["runs"])' ;;
  latency) expr='all(k in d for k in ("p50_ns", "p99_ns", "throughput_tasks_per_s", "lane_p50_ns", "control_p50_ns", "control_p99_ns", "callback_p50_ns", "callback_p99_ns", "floor_p50_ns", "opencl_empty_p50_ns", "opencl_native_empty_p50_ns", "opencl_empty_ratio", "opencl_device_host_hop_ratio")) and d["opencl_empty_ratio"] > 0 and d["opencl_device_host_hop_ratio"] > 0 and d["control_p50_ns"] > 0 and d["callback_p50_ns"] > 0' ;;
  overhead) expr='d["verified"] and all(p["verified"] for p in d["programs"]) and "geomean_ratio" in d and "transfer_ratio" in d
  and d["repetitions"] >= 1 and "load_average_at_start" in d
  and all(k in d for k in ("geomean_ratio_min", "geomean_ratio_median", "geomean_ratio_max", "transfer_ratio_min", "transfer_ratio_median", "transfer_ratio_max", "transfer_shared_ratio", "transfer_shared_ratio_min", "transfer_shared_ratio_median", "transfer_shared_ratio_max", "transfer_shared_agora_s"))
  and all(p["ratio_min"] <= p["ratio_median"] <= p["ratio_max"] and len(p["native_runs_s"]) == len(p["agora_runs_s"]) == d["repetitions"]
          and all(k in p for k in ("ratio", "ratio_best", "native", "agora")) for p in d["programs"])' ;;
  hetero) expr='isinstance(d, list) and d and all(all(k in p for k in ("policy", "makespan_s", "energy_j", "utilisation", "first_pass_s")) for p in d)' ;;
  sharing) expr='all(k in d for k in ("apps", "shared_s", "sequential_s", "ratio", "shared", "sequential", "load_average_at_start", "fairness_rates", "fairness_max_over_min"))
  and d["repetitions"] >= 1 and d["ratio_min"] <= d["ratio_median"] <= d["ratio_max"]
  and len(d["fairness_rates"]) == d["repetitions"] and all(len(r) >= 2 and min(r) > 0 for r in d["fairness_rates"])
  and 1 <= d["fairness_max_over_min"]["min"] <= d["fairness_max_over_min"]["max"]' ;;
  sla) expr='all(k in d for k in ("sla_ms", "alone", "unsliced", "chunked", "revoked", "preempt_chunked_p99_ms", "batch_per_s_chunked", "batch_priority", "load_average_at_start"))' ;;
  migrate) expr='d["moves"] and "app" in d' ;;
  kernels) expr='d["verified"] and all(k in d for k in ("package_ratio_geomean", "sandbox_ratio_geomean", "cpu_ratio_geomean", "sandbox_empty_p50_ns", "first_build_ms", "cached_build_ms")) and d["cache_hit"] and len(d["kernels"]) == 3' ;;
  soak) expr='d["verified"] and d["wrong_results"] == 0 and d["client_failures"] == 0 and d["daemon_alive"] and d["sessions_left"] == 0
  and d["rounds"] > 0 and d["kills"] >= 1 and d["restarts"] == d["kills"] and len(d["samples"]) >= 5
  and all(p["rounds"] > 0 for p in d["profiles"] if p["clients"] > 0)
  and d["throughput_rounds_per_s"]["min"] <= d["throughput_rounds_per_s"]["median"] <= d["throughput_rounds_per_s"]["max"]
  and all(k in d for k in ("rss_slope_mib_per_min", "rss_anon_slope_mib_per_min", "fd_slope_per_min", "rss_mib_max", "fds_max", "throughput_tasks_per_s", "stalled_intervals", "warm_up_s", "seed", "load_average_at_start"))' ;;
  gpu) expr='all(k in d for k in ("gpus", "empty_kernel_p50_ns", "native_empty_kernel_p50_ns", "h2d_ratio", "d2h_ratio", "rodinia_ratio_geomean", "fence_ratio_geomean", "sharing_ratio", "latency_under_batch_p99_ns", "pipeline"))
  and d["verified"] and d["pipeline"]["programs"] >= 8 and d["pipeline"]["nvrtc_ms"] > 0 and d["pipeline"]["ptxas_ms"] is not None
  and (d["gpus"] == 0 or (d["h2d_ratio"] > 0 and d["rodinia_ratio_geomean"] > 0))' ;;
  checkpoint) expr='d["verified"] and all(k in d for k in ("state_bytes", "plain_iteration_s", "checkpointed_iteration_s", "checkpoint_overhead_ratio", "dcp_written_fraction", "first_written_fraction", "write_mib_s", "recover_s", "load_average_at_start"))
  and 0 < d["dcp_written_fraction"]["median"] < 0.5 and d["first_written_fraction"] > 0.9 and d["write_mib_s"] > 0
  and d["partial_verified"] and d["partial_overhead_ratio"] > 0 and all(k in d for k in ("partial_rows", "partial_window_rows", "partial_whole_s", "partial_checkpointed_s"))' ;;
  insitu) expr='d["recovered_exact"] and all(k in d for k in ("recurring_attach_us", "one_time_attach_us", "async_insitu_overhead", "checkpoint_l1_overhead", "attach_512mib_us", "sync_insitu_overhead", "checkpoint_l3_overhead", "simulation_alone_s", "load_average_at_start"))
  and d["recurring_attach_us"] > 0 and d["one_time_attach_us"] > 0 and d["attach_512mib_us"] > 0 and len(d["configurations"]) == 7 and d["communication_points"] == 15' ;;
  rt) expr='d["simulated"] and d["admitted_misses"] == 0 and d["lanes"] == 4 and d["apedf_admitted_utilisation"] >= 2.5
  and all(k in d for k in ("gedf_miss_ratio_at_full", "fifo_miss_ratio_at_full", "release_jitter_p99_us", "points")) and len(d["points"]) >= 2
  and d["release_jitter_p99_us"] is not None and d["daemon"]["dags"][0]["admitted"] and d["daemon"]["dags"][0]["releases"] >= 100
  and all(k in d["daemon"]["dags"][0] for k in ("misses", "misses_without_overrun", "overruns", "handoff_p99_us"))
  and len(d["daemon_sweep"]) >= 2 and d["daemon_admitted_misses"] is not None
  and all(p["dags_admitted"] >= 1 and p["releases"] > 0 for p in d["daemon_sweep"])' ;;
  *)
    echo "bench-smoke: no checks for bench '$bench': add them here" >&2
    exit 2
    ;;
esac

start=$SECONDS
out="$state/$bench.json"
"$@" > "$out"
"$PY" - "$out" "$bench" "$expr" <<'PYEOF'
import json, sys
path, bench, expr = sys.argv[1:]
d = json.load(open(path))
if not eval("(" + expr + ")", {"d": d, "all": all, "isinstance": isinstance}):  # parenthesised: checks may span lines
    sys.exit(f"bench {bench} --quick --json: check failed: {expr}\n{json.dumps(d)[:2000]}")
PYEOF
echo "bench $bench --quick: ok ($((SECONDS - start)) s)"
