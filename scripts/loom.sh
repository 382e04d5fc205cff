#!/usr/bin/env bash
# Runs the loom models of crates/protocol/tests/loom.rs: the submission and completion rings
# (the real ring code, its header atomics swapped for loom's by `agora_protocol::sync`), the
# daemon-sleeping/doorbell handshake, the futex waiter protocol and a device lane's sleep/wake and
# wait for room (restated from the client, daemon and devices code with the same orderings). Loom explores every interleaving up to
# LOOM_MAX_PREEMPTIONS preemptions and every outcome the C11 memory model allows; a slot read
# before it was written, a slot overwritten before it was consumed, or a lost wake-up (a
# deadlock) fails the test. Each model was shown able to fail (see the test file).
#
#   bash scripts/loom.sh            (about 50 s the first time: its own build; then seconds)
#
# `--cfg loom` changes how the crate and its dependencies compile, so the build has its own
# target directory (target/loom) and leaves the normal build's alone.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}" CARGO_TARGET_DIR=target/loom \
  cargo test --release -p agora-protocol --test loom "$@"
