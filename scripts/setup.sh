#!/usr/bin/env bash
# Installs what Agora needs on a fresh Debian/Ubuntu machine and builds it (release).
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

need_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# System packages: a C toolchain for the Rust build, and OpenCL (loader + PoCL).
missing=()
command -v cc >/dev/null 2>&1 || missing+=(build-essential)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
command -v curl >/dev/null 2>&1 || missing+=(curl)
# OpenCL: the ICD loader and PoCL (a real OpenCL platform on the CPU), plus clinfo to inspect it.
[ -e /etc/OpenCL/vendors/pocl.icd ] || missing+=(pocl-opencl-icd)
ldconfig -p 2>/dev/null | grep -q 'libOpenCL.so.1' || missing+=(ocl-icd-libopencl1)
command -v clinfo >/dev/null 2>&1 || missing+=(clinfo)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  need_root apt-get update -qq
  need_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

# Rust: a stable toolchain with rustfmt and clippy (the tests run both).
if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "setup: installing Rust (rustup, stable)"
    curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --component rustfmt,clippy
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
fi
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi

echo "setup: building (release)"
cargo build --release --workspace --quiet
echo "setup: done; the CLI is target/release/agora"
