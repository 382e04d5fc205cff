#!/usr/bin/env bash
# Smoke run of every `agora bench`: each in its --quick mode, with --json, checked for the fields
# its documentation promises and for verified results. `make test` runs this, so no benchmark can
# silently break. Timings are printed, never asserted (speed lives in the full benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."
AGORA=./target/release/agora
PY=${PYTHON:-.venv/bin/python}
state=$(mktemp -d -t agora-bench-smoke-XXXXXX)
trap 'rm -rf "$state"' EXIT
export AGORA_STATE_DIR="$state" AGORA_LOG=warn

check() { # bench name, then a Python expression over `d` (the parsed JSON) that must hold
  local bench=$1 expr=$2 out="$state/$1.json"
  local start=$SECONDS
  "$AGORA" bench "$bench" --quick --json > "$out"
  "$PY" - "$out" "$bench" "$expr" <<'PYEOF'
import json, sys
path, bench, expr = sys.argv[1:]
d = json.load(open(path))
if not eval("(" + expr + ")", {"d": d, "all": all, "isinstance": isinstance}):  # parenthesised: checks may span lines
    sys.exit(f"bench {bench} --quick --json: check failed: {expr}\n{json.dumps(d)[:2000]}")
PYEOF
  echo "bench $bench --quick: ok ($((SECONDS - start)) s)"
}

check latency  'all(k in d for k in ("p50_ns", "p99_ns", "throughput_tasks_per_s", "lane_p50_ns", "floor_p50_ns", "opencl_empty_p50_ns", "opencl_native_empty_p50_ns", "opencl_empty_ratio")) and d["opencl_empty_ratio"] > 0'
check overhead 'd["verified"] and all(p["verified"] for p in d["programs"]) and "geomean_ratio" in d and "transfer_ratio" in d
  and d["repetitions"] >= 1 and "load_average_at_start" in d
  and all(k in d for k in ("geomean_ratio_min", "geomean_ratio_median", "geomean_ratio_max", "transfer_ratio_min", "transfer_ratio_median", "transfer_ratio_max"))
  and all(p["ratio_min"] <= p["ratio_median"] <= p["ratio_max"] and len(p["native_runs_s"]) == len(p["agora_runs_s"]) == d["repetitions"]
          and all(k in p for k in ("ratio", "ratio_best", "native", "agora")) for p in d["programs"])'
check hetero   'isinstance(d, list) and d and all(all(k in p for k in ("policy", "makespan_s", "energy_j", "utilisation")) for p in d)'
check sharing  'all(k in d for k in ("apps", "shared_s", "sequential_s", "ratio", "shared", "sequential", "load_average_at_start"))
  and d["repetitions"] >= 1 and d["ratio_min"] <= d["ratio_median"] <= d["ratio_max"]'
check sla      'all(k in d for k in ("sla_ms", "alone", "unsliced", "chunked", "revoked", "preempt_chunked_p99_ms", "batch_per_s_chunked", "batch_priority", "load_average_at_start"))'
check migrate  'd["moves"] and "app" in d'
check kernels  'd["verified"] and all(k in d for k in ("package_ratio_geomean", "sandbox_ratio_geomean", "cpu_ratio_geomean", "sandbox_empty_p50_ns", "first_build_ms", "cached_build_ms")) and d["cache_hit"] and len(d["kernels"]) == 3'
