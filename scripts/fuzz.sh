#!/usr/bin/env bash
# Fuzzes everything that parses untrusted bytes (docs/ARCHITECTURE.md, "Fuzzing"): task
# descriptors and their validation against a session, control frames, requests and responses,
# the daemon's configuration file, kernel manifests and their size rules.
#
#   bash scripts/fuzz.sh                 each target for a fixed number of runs (make test; fails on a crash)
#   bash scripts/fuzz.sh --long SECONDS  each target for at most SECONDS and 10 M executions
#                                        ($FUZZ_RUNS), with its figures (executions, cov, ft)
#   bash scripts/fuzz.sh [--long S] TARGET...   only these targets
#
# Installs cargo-fuzz when missing. There is no nightly toolchain: libFuzzer's instrumentation
# needs unstable flags, so the stable compiler is used with RUSTC_BOOTSTRAP=1, and without a
# sanitizer (`--sanitizer none`: these parsers are safe Rust; a panic or a failed property is
# the crash). The committed seeds (fuzz/corpus/TARGET) are read, never written: what a run
# finds goes to a temporary directory. A crash is saved as fuzz/artifacts/TARGET/crash-*:
# reproduce it with `RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer none TARGET FILE`, fix the
# parser (with a unit test next to it) and add the file to fuzz/corpus/TARGET.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${FUZZ_RUNS:-50000}
long=""
if [ "${1:-}" = "--long" ]; then
  long=${2:?--long needs a number of seconds}
  RUNS=${FUZZ_RUNS:-10000000}
  shift 2
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(descriptor validate frames request response config manifest)
fi

export PATH="$HOME/.cargo/bin:$PATH"
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz (cargo install cargo-fuzz --locked)"
  cargo install cargo-fuzz --locked
fi

export RUSTC_BOOTSTRAP=1
echo "fuzz: building the targets"
cargo fuzz build --sanitizer none
bin=fuzz/target/x86_64-unknown-linux-gnu/release

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p fuzz/artifacts
for t in "${targets[@]}"; do
  mkdir -p "$scratch/$t" "fuzz/artifacts/$t"
  if [ -n "$long" ]; then
    args=(-max_total_time="$long" -runs="$RUNS" -print_final_stats=1)
  else
    args=(-runs="$RUNS")
  fi
  log="$scratch/$t.log"
  started=$(date +%s)
  if ! "$bin/$t" "${args[@]}" -artifact_prefix="fuzz/artifacts/$t/" "$scratch/$t" "fuzz/corpus/$t" >"$log" 2>&1; then
    tail -40 "$log"
    echo "fuzz: $t FAILED (the input is in fuzz/artifacts/$t/)" >&2
    exit 1
  fi
  done_line=$(grep -E '^Done [0-9]+ runs' "$log" | tail -1)
  cov_line=$(grep -E '^#[0-9]+' "$log" | grep -E 'cov: [0-9]+' | tail -1)
  cov=$(sed -nE 's/.*cov: ([0-9]+) ft: ([0-9]+).*/cov \1 ft \2/p' <<<"$cov_line")
  echo "fuzz: $t: ${done_line:-?} ($cov; $(($(date +%s) - started)) s wall), 0 crashes"
done
