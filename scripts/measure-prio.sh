#!/usr/bin/env bash
# OS priorities for batch lanes (issue #14 item 4), side by side: `agora bench sla --json` with
# `--batch-priority normal` (lanes as before: batch and latency work at the same OS priority) and
# with the daemon's default, interleaved (normal, default, normal, default, ...), then a
# min / median / max table of chunked preemption latency p50 / p99 and batch throughput.
#
#   scripts/measure-prio.sh                 # 3 runs each of normal and the default (~2.5 min)
#   scripts/measure-prio.sh 5 normal batch idle nice:10   # 5 runs each of these, interleaved
#   SLA_ARGS="--requests 400" scripts/measure-prio.sh     # extra `agora bench sla` options
#
# Run it on a quiet machine: each run prints the 1-minute load average it started at, and
# `agora bench sla` warns on stderr when it is above half the cores. The raw JSON of every run is
# kept in $OUT (default: a new directory under /tmp, printed at the end).
# Aims (issue #14): chunked preemption p99 <= 1 ms; batch throughput (chunked) not more than 5 %
# below `normal`'s.
set -euo pipefail
cd "$(dirname "$0")/.."
AGORA=${AGORA:-./target/release/agora}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
runs=${1:-3}
shift || true
if [ $# -gt 0 ]; then
  priorities=("$@")
else
  default=$("$AGORA" serve --print-config | sed -n 's/^batch_priority = "\(.*\)"$/\1/p')
  priorities=(normal "${default:?cannot read the default batch_priority from agora serve --print-config}")
fi
OUT=${OUT:-$(mktemp -d -t agora-measure-prio-XXXXXX)}
mkdir -p "$OUT"
export AGORA_LOG=${AGORA_LOG:-warn}

echo "agora bench sla --json ${SLA_ARGS:-}: $runs runs each of --batch-priority ${priorities[*]}, interleaved" >&2
for ((run = 1; run <= runs; run++)); do
  # Alternate the order within each round too, so drift in the machine's speed evens out.
  order=("${priorities[@]}")
  if ((run % 2 == 0)); then
    order=()
    for ((i = ${#priorities[@]} - 1; i >= 0; i--)); do order+=("${priorities[i]}"); done
  fi
  for p in "${order[@]}"; do
    file="$OUT/sla-${p//:/_}-$run.json"
    # shellcheck disable=SC2086 # SLA_ARGS is a list of options
    "$AGORA" bench sla --json --batch-priority "$p" ${SLA_ARGS:-} > "$file"
    "$PY" - "$file" "$p" "$run" >&2 <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"  run {sys.argv[3]} {sys.argv[2]:<8} load {d.get('load_average_at_start') or 0:.2f}  "
      f"chunked preemption p50 {d['preempt_chunked_p50_ms']:.3f} p99 {d['preempt_chunked_p99_ms']:.3f} ms  "
      f"batch {d['batch_per_s_chunked']:.2f} sgemm/s")
PYEOF
  done
done

"$PY" - "$OUT" "${priorities[@]}" <<'PYEOF'
import glob, json, sys
out, priorities = sys.argv[1], sys.argv[2:]
def spread(values):
    v = sorted(values)
    n = len(v)
    median = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2
    return v[0], median, v[-1]
rows = {}
for p in priorities:
    runs = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/sla-{p.replace(':', '_')}-*.json"))]
    rows[p] = {
        "runs": len(runs),
        "load": spread([r.get("load_average_at_start") or 0.0 for r in runs]),
        "p50": spread([r["preempt_chunked_p50_ms"] for r in runs]),
        "p99": spread([r["preempt_chunked_p99_ms"] for r in runs]),
        "sla": spread([r["chunked"]["sla_met_fraction"] * 100 for r in runs]),
        "batch": spread([r["batch_per_s_chunked"] for r in runs]),
        "unsliced": spread([r["batch_per_s_unsliced"] for r in runs]),
    }
cols = [
    ("p50", "chunked preempt p50 (ms)", "{:.3f}"),
    ("p99", "chunked preempt p99 (ms)", "{:.3f}"),
    ("sla", "within SLA, chunked (%)", "{:.1f}"),
    ("batch", "batch sgemm/s, chunked", "{:.2f}"),
    ("unsliced", "batch sgemm/s, unsliced", "{:.2f}"),
    ("load", "load average at start", "{:.2f}"),
]
print("\nmin / median / max over runs; preemption latency = response time beyond the alone median")
print(f"{'batch priority':<16}{'runs':>5}  " + "  ".join(f"{title:>26}" for _, title, _ in cols))
for p, r in rows.items():
    cells = ["/".join(fmt.format(x) for x in r[key]) for key, _, fmt in cols]
    print(f"{p:<16}{r['runs']:>5}  " + "  ".join(f"{c:>26}" for c in cells))
if len(priorities) >= 2 and priorities[0] in rows:
    base = rows[priorities[0]]
    for p in priorities[1:]:
        r = rows[p]
        print(f"{p} vs {priorities[0]} (medians): chunked preemption p99 {r['p99'][1]:.3f} vs {base['p99'][1]:.3f} ms "
              f"(aim <= 1 ms: {'met' if r['p99'][1] <= 1.0 else 'not met'}); batch throughput "
              f"{r['batch'][1] / base['batch'][1]:.3f}x (aim >= 0.95x: {'met' if r['batch'][1] >= 0.95 * base['batch'][1] else 'not met'})")
print(f"raw JSON: {out}")
PYEOF
