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

# Not --quiet: a first build takes minutes, and cargo's progress shows it is working.
echo "setup: building (release; the first build takes a few minutes)"
cargo build --release --workspace
bash scripts/build-packages.sh  # the example kernel packages' shared objects (examples/packages)

# Python: the `agora` package (PyO3 + maturin) and what its tests use, in the project's
# virtualenv .venv (a system Python may refuse `pip install` outside one, PEP 668).
# In your own environment the same package installs with `pip install ./crates/python`.
command -v python3 >/dev/null 2>&1 || {
  echo "setup: installing python3"
  need_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-dev
}
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv 2>/dev/null || {
    rm -rf .venv
    echo "setup: installing python3-venv"
    need_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-dev
    python3 -m venv .venv
  }
fi
echo "setup: installing the Python package into .venv (pip install ./crates/python)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check maturin numpy pytest pytest-timeout
.venv/bin/python -m pip install --quiet --disable-pip-version-check ./crates/python

# NVRTC and ptxas run without a GPU: the test suite compiles every built-in kernel to PTX,
# fences it and assembles it (the CUDA backend's checks on machines without CUDA). From PyPI,
# into the venv; the Makefile points AGORA_NVRTC and AGORA_PTXAS at them.
echo "setup: installing NVRTC and ptxas (PyPI: nvidia-cuda-nvrtc-cu12, nvidia-cuda-nvcc-cu12) into .venv"
.venv/bin/python -m pip install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc-cu12==12.9.*" "nvidia-cuda-nvcc-cu12==12.9.*"

# Slurm and MUNGE from Debian's packages, for the test that runs Agora under a real Slurm cluster
# on loopback (scripts/slurm/agora-jobs.sh; issue #17). Their system services are not used.
bash scripts/slurm/install.sh

echo "setup: done; the CLI is target/release/agora"
