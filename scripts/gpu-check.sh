#!/usr/bin/env bash
# The GPU checks, on a machine with an NVIDIA GPU and its driver, from prebuilt binaries (no Rust
# toolchain, no network): the GPU test cases (every library kernel against its host reference,
# two tenants at once, launches beyond the grid, a buffer beyond the GPU's limit, running kernels
# revoked and replayed with every program verified, a kernel fault recovered from by the GPU's
# device host), the fencing test's kernel unfenced under compute-sanitizer (scripts/gpu/stray.cu,
# built with the machine's nvcc), the Python client on a GPU queue (scripts/gpu_check.py, from
# the abi3 wheel) and `agora bench gpu --json`, with the GPU in a device host (the default) and
# in the daemon (`--in-daemon`: the hop's cost).
#
# Build the binaries on a development machine with `make gpu-dist` (dist/gpu: agora, gpu-tests,
# the Python wheel),
# copy the repository (with dist/gpu and examples/packages) to the GPU machine, then run
#   bash scripts/gpu-check.sh [--quick]
# Results go to $OUT (default /tmp/agora-gpu-check): devices.txt, tests.txt, bench-gpu.json,
# bench-gpu-in-daemon.json and daemon logs. NVRTC is the CUDA toolkit's (libnvrtc.so on the loader's path, or AGORA_NVRTC).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=""
[ "${1:-}" = "--quick" ] && quick="--quick"
bin=${AGORA_GPU_DIST:-dist/gpu}
out=${OUT:-/tmp/agora-gpu-check}
mkdir -p "$out"
export AGORA_CUDA_CACHE="$out/ptx-cache" AGORA_LOG=${AGORA_LOG:-info}
for f in agora gpu-tests preemption-tests; do
  [ -x "$bin/$f" ] || { echo "gpu-check: $bin/$f missing: run 'make gpu-dist' first" >&2; exit 2; }
done
# Tenant programs' executors are the agora binary (the fencing test builds one).
export AGORA_EXECUTOR="$(cd "$bin" && pwd)/agora"
nvidia-smi -L | tee "$out/gpus.txt"
ls /etc/OpenCL/vendors >> "$out/gpus.txt" 2>&1 || echo "no OpenCL ICDs" >> "$out/gpus.txt"
status=0

echo "== devices"
sock="$out/agora.sock"
"$bin/agora" serve --socket "$sock" --no-opencl > "$out/daemon.log" 2>&1 &
daemon=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
"$bin/agora" devices --socket "$sock" | tee "$out/devices.txt" || status=1

echo "== Python client"
wheel=$(ls "$bin"/agora-*.whl 2>/dev/null | head -1 || true)
if [ -n "$wheel" ]; then
  python3 -m pip install --quiet --no-index --no-deps --target "$out/python" "$wheel" \
    && PYTHONPATH="$out/python" AGORA_SOCKET="$sock" python3 scripts/gpu_check.py || status=1
else
  echo "gpu-check: no wheel in $bin (make gpu-dist builds it)"; status=1
fi
# A daemon that does not stop within 15 s is a failure of its own (and must not hang the check).
kill -TERM "$daemon"
for _ in $(seq 150); do kill -0 "$daemon" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$daemon" 2>/dev/null; then
  echo "gpu-check: the daemon did not stop within 15 s of SIGTERM (see $out/daemon.log)"; status=1
  kill -KILL "$daemon"
fi
wait "$daemon" || true
grep -q cuda "$out/devices.txt" || { echo "gpu-check: the daemon found no GPU (see $out/daemon.log)"; status=1; }

echo "== GPU test cases"
timeout "${AGORA_GPU_TEST_TIMEOUT:-900}" "$bin/gpu-tests" --ignored --test-threads=1 --nocapture 2>&1 | tee "$out/tests.txt" || status=1
echo "== revocation of running GPU kernels (every program verified while latency tasks revoke it)"
# Running kernels are revoked only with the mapped flag (not the default: see docs/gpu.md); with
# the copied flag the GPU does not poll revocation and no launch there is revocable.
AGORA_CUDA_REVOCATION=mapped timeout "${AGORA_GPU_TEST_TIMEOUT:-900}" "$bin/preemption-tests" --ignored on_a_gpu --test-threads=1 --nocapture 2>&1 \
  | tee "$out/revocation.txt" || status=1

echo "== the same out-of-bounds kernel unfenced, natively, under compute-sanitizer"
# The contrast to the fencing test above: without the fence, the tool sees the tenant's writes
# land outside its memory. Needs the CUDA toolkit's nvcc and compute-sanitizer.
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -z "$sanitizer" ] || [ -z "$nvcc" ]; then
  echo "gpu-check: nvcc or compute-sanitizer not found (the CUDA toolkit's): the contrast did not run"; status=1
elif "$nvcc" -o "$out/stray" scripts/gpu/stray.cu > "$out/sanitizer.txt" 2>&1; then
  "$out/stray" >> "$out/sanitizer.txt" 2>&1 || true
  "$sanitizer" --tool memcheck --print-limit 4 "$out/stray" >> "$out/sanitizer.txt" 2>&1 || true
  head -c 3000 "$out/sanitizer.txt"; echo
  if grep -q "Invalid __global__" "$out/sanitizer.txt"; then
    echo "compute-sanitizer caught the unfenced kernel's $(grep -c "Invalid __global__" "$out/sanitizer.txt") first stray accesses (print limit 4)"
  else
    echo "gpu-check: compute-sanitizer did not report the unfenced kernel's stray writes (see $out/sanitizer.txt)"; status=1
  fi
else
  cat "$out/sanitizer.txt"; echo "gpu-check: nvcc did not build scripts/gpu/stray.cu"; status=1
fi

echo "== agora bench gpu $quick"
# shellcheck disable=SC2086 # AGORA_GPU_BENCH_ARGS: extra options, e.g. "--repetitions 3"
timeout "${AGORA_GPU_BENCH_TIMEOUT:-1800}" "$bin/agora" bench gpu --json $quick ${AGORA_GPU_BENCH_ARGS:-} > "$out/bench-gpu.json" 2> "$out/bench-gpu.log" || status=1
cat "$out/bench-gpu.log"
head -c 6000 "$out/bench-gpu.json"; echo
# The same with the GPU in the daemon's process: what the device host's hop costs
# (AGORA_GPU_BENCH_IN_DAEMON=0 skips it).
if [ "${AGORA_GPU_BENCH_IN_DAEMON:-1}" != 0 ]; then
  echo "== agora bench gpu $quick --in-daemon"
  # shellcheck disable=SC2086
  timeout "${AGORA_GPU_BENCH_TIMEOUT:-1800}" "$bin/agora" bench gpu --json --in-daemon $quick ${AGORA_GPU_BENCH_ARGS:-} > "$out/bench-gpu-in-daemon.json" 2> "$out/bench-gpu-in-daemon.log" || status=1
  head -c 6000 "$out/bench-gpu-in-daemon.json"; echo
fi
exit $status
