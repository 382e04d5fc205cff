#!/usr/bin/env bash
# The control plane off the data path (issue #18), measured: `agora bench latency` against one
# daemon, quiet and while another process asks `status` in a loop and `agora trace save` writes
# the daemon's whole trace every 0.2 s (the requests that once ran on the dispatcher thread),
# interleaved (quiet, loaded, loaded, quiet, ...), then a min / median / max table of the
# round-trip p50 / p99.
#
#   scripts/measure-control-loop.sh           # 5 runs of each, 200 000 round trips (~2 min)
#   scripts/measure-control-loop.sh 9 50000   # 9 runs of 50 000 round trips each
#
# The loop asks about 400 statuses a second (2 ms apart) at `nice -n 19`: on a 2-core machine
# the latency client and the dispatcher each keep a core busy, and the aim is to see whether a
# slow control request delays tasks, not whether a third process that never sleeps takes CPU
# from them (it does: the dispatcher yields its core while it waits, and a busy loop takes it;
# run with BUSY=1 to see that). The raw JSON of every run is kept in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
AGORA=${AGORA:-./target/release/agora}
PY=${PYTHON:-.venv/bin/python}
runs=${1:-5}
iterations=${2:-200000}
OUT=${OUT:-$(mktemp -d -t agora-measure-control-XXXXXX)}
mkdir -p "$OUT"
export AGORA_LOG=${AGORA_LOG:-warn}
socket="$OUT/agora.sock"
"$AGORA" serve --socket "$socket" --trace "$OUT/trace.json" > /dev/null 2> "$OUT/daemon.log" &
daemon=$!
loop=""
cleanup() {
  [ -n "$loop" ] && kill "$loop" 2> /dev/null || true
  kill "$daemon" 2> /dev/null || true
  wait 2> /dev/null || true
}
trap cleanup EXIT
for _ in $(seq 100); do [ -S "$socket" ] && break; sleep 0.05; done

start_loop() {
  nice -n 19 "$PY" - "$socket" "$AGORA" "${BUSY:-0}" > "$OUT/loop-$1.log" 2>&1 <<'PYEOF' &
import subprocess, sys, time
import agora
socket, cli, busy = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
session = agora.Session(socket=socket, name="control-loop")
statuses = saves = 0
last_save = 0.0
while True:
    session.status()
    statuses += 1
    if not busy:
        time.sleep(0.002)
    if time.monotonic() - last_save > 0.2:
        subprocess.run([cli, "trace", "save", "--socket", socket], check=True, capture_output=True)
        saves += 1
        last_save = time.monotonic()
        print(f"{statuses} statuses, {saves} trace saves", flush=True)
PYEOF
  loop=$!
  # The loop is running (its first status and trace save done) before the measurement starts.
  for _ in $(seq 200); do [ -s "$OUT/loop-$1.log" ] && break; sleep 0.05; done
}

echo "agora bench latency --socket (one daemon, $iterations round trips per run): $runs runs quiet and $runs with a status + trace-save loop, interleaved" >&2
for ((run = 1; run <= runs; run++)); do
  order=(quiet loaded)
  ((run % 2 == 0)) && order=(loaded quiet)
  for mode in "${order[@]}"; do
    [ "$mode" = loaded ] && start_loop "$run"
    "$AGORA" bench latency --socket "$socket" --json --runs 1 --iterations "$iterations" > "$OUT/$mode-$run.json"
    if [ "$mode" = loaded ]; then
      kill "$loop"; wait "$loop" 2> /dev/null || true; loop=""
      echo "  run $run loaded: $(tail -1 "$OUT/loop-$run.log")" >&2
    fi
  done
done

"$PY" - "$OUT" "$runs" <<'PYEOF'
import json, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
def spread(values):
    values = sorted(values)
    return f"{values[0]/1e3:7.2f} {statistics.median(values)/1e3:7.2f} {values[-1]/1e3:7.2f}"
print(f"{'':8} {'p50 µs (min med max)':>24}   {'p99 µs (min med max)':>24}")
for mode in ("quiet", "loaded"):
    runs_ = [json.load(open(f"{out}/{mode}-{r}.json")) for r in range(1, runs + 1)]
    print(f"{mode:8} {spread([r['p50_ns'] for r in runs_]):>24}   {spread([r['p99_ns'] for r in runs_]):>24}")
    print("         per run p99 µs: " + ", ".join(f"{r['p99_ns']/1e3:.2f}" for r in runs_))
print(f"raw JSON in {out}")
PYEOF
