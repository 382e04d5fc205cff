#!/usr/bin/env bash
# Runs the protocol crate's tests that exercise its unsafe code (the segment view over shared
# memory, the rings' slot reads and writes) under Miri, which checks them for undefined behaviour
# and — with the two-thread ring test — for data races: a slot access not ordered by the ring
# indices' release/acquire pairs is reported (checked once by weakening `publish` to Relaxed).
#
#   bash scripts/miri.sh            (make test runs it)
#
# Miri needs a nightly toolchain with the miri and rust-src components; installed here when
# missing (the project's scripts install what they need). Exhaustive tests without unsafe code
# are ignored under Miri (`cfg_attr(miri, ignore)`) and run natively in `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
if ! cargo +nightly miri --version >/dev/null 2>&1; then
  echo "miri: installing the nightly toolchain's miri and rust-src components"
  rustup toolchain install nightly --profile minimal --component miri,rust-src
fi
cargo +nightly miri setup >/dev/null
# Strict provenance: no integer-to-pointer casts, so Miri misses no pointer bug.
MIRIFLAGS="-Zmiri-strict-provenance" cargo +nightly miri test -p agora-protocol -- ring:: segment::
