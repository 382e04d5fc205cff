#!/usr/bin/env bash
# GPU diagnosis, from the same prebuilt binaries as gpu-check.sh (make gpu-dist; copy the
# repository with dist/gpu and examples/packages): times nw, lavaMD and gaussian through
# `agora run` on the GPU under four daemons: the defaults, revocation off (--latency-policy
# none), running kernels revocable through the mapped flag (AGORA_CUDA_REVOCATION=mapped), and
# completions from the driver's stream callbacks (AGORA_CUDA_COMPLETIONS=callbacks). Each program
# runs twice per daemon (the second run uses what the performance model learned from the first).
# Prints one line per run and the revocation counters; files go to $OUT (default /tmp/diag).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=dist/gpu/agora
out=${OUT:-/tmp/diag}; mkdir -p "$out"
export AGORA_CUDA_CACHE="$out/ptx-cache"
run() {
  local tag=$1; shift
  local sock="$out/$tag.sock"
  "$bin" serve --socket "$sock" --no-opencl "$@" > "$out/daemon-$tag.log" 2>&1 &
  local d=$!
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
  for app in "nw 4096" "lavamd 16" "gaussian 2048" "nw 4096"; do
    set -- $app
    /usr/bin/time -f "$tag $1 wall %e s" "$bin" run "$1" --size "$2" --device-kind cuda --socket "$sock" --json > "$out/run-$tag-$1.json" 2> "$out/time.tmp"
    echo "$(tail -1 "$out/time.tmp") $(python3 -c "import json; d=json.load(open('$out/run-$tag-$1.json')); print({k:v for k,v in d.items() if k in ('seconds','verified','max_error')})" 2>/dev/null || cat "$out/time.tmp")"
  done
  "$bin" status --socket "$sock" --json > "$out/status-$tag.json" 2>&1
  python3 -c "import json; d=json.load(open('$out/status-$tag.json')); print('$tag', {k:v for k,v in d.items() if 'revo' in k or 'slice' in k})" 2>&1 | head -3
  kill -TERM "$d"; wait "$d" || true
}
run default
run nopolicy --latency-policy none
AGORA_CUDA_REVOCATION=mapped run mappedflag
AGORA_CUDA_COMPLETIONS=callbacks run callbacks --latency-policy none
