# The two commands of this repository (see README.md):
#   make demo   install what is needed, build, run the demo (embedded daemon + client processes)
#   make test   the whole test suite: format, lints, unit and integration tests, short fuzz runs
#               of every parser of untrusted bytes (scripts/fuzz.sh), the protocol crate's
#               unsafe code under Miri (scripts/miri.sh), jobs on a real Slurm cluster on loopback
#               sharing nodes through Agora (scripts/slurm/agora-jobs.sh) and its --quick benchmark
#               (scripts/slurm/bench.sh), a --quick smoke run of every
#               benchmark, its JSON checked by scripts/bench-smoke.sh
.PHONY: setup demo test bench c gpu-dist


setup:
	bash scripts/setup.sh

demo: setup
	./target/release/agora demo

test: setup
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --release -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --release
	cargo test --workspace --release
	bash scripts/fuzz.sh
	bash scripts/miri.sh
	bash scripts/loom.sh
	.venv/bin/python -m pytest -q crates/python/tests
	bash scripts/slurm/agora-jobs.sh ./target/release/agora
	bash scripts/slurm/bench.sh ./target/release/agora --quick --json | .venv/bin/python -c 'import json,sys; d=json.load(sys.stdin); assert all(k in d for k in ("hooks_add_ms", "exclusive_over_shared", "shared_makespan_ms", "exclusive_makespan_ms")), d; print("slurm bench --quick: ok", d["hooks_add_ms"], "ms of hooks,", d["exclusive_over_shared"], "exclusive/shared")'
	bash scripts/bench-smoke.sh ./target/release/agora bench latency --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench overhead --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench hetero --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench sharing --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench sla --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench migrate --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench kernels --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench soak --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench gpu --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench checkpoint --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench insitu --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench rt --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench stall --quick --json
	bash scripts/bench-smoke.sh ./target/release/agora bench stall --quick --json --attack departures
	bash scripts/bench-smoke.sh ./target/release/agora bench stall --quick --json --attack evictions

bench: setup
	./target/release/agora bench latency

# The C client: dist/lib/libagora.{so,a}, dist/include/agora.h and agora_kernel.h (for kernels you write), dist/lib/pkgconfig/agora.pc.
# Then: PKG_CONFIG_PATH=$(PWD)/dist/lib/pkgconfig cc app.c $$(pkg-config --cflags --libs agora)
c: setup
	mkdir -p dist/lib/pkgconfig dist/include
	cp target/release/libagora_capi.so dist/lib/libagora.so
	cp target/release/libagora_capi.a dist/lib/libagora.a
	cp crates/capi/include/agora.h dist/include/agora.h
	cp crates/capi/include/agora_kernel.h dist/include/agora_kernel.h
	sed -e "s|@PREFIX@|$(CURDIR)/dist|" -e "s|@VERSION@|0.1.0|" crates/capi/agora.pc.in > dist/lib/pkgconfig/agora.pc

# What scripts/gpu-check.sh runs on a GPU machine without a Rust toolchain: the CLI and the GPU
# test binary, stripped, and the Python wheel (abi3: CPython 3.11 and later), in dist/gpu (copy it there with the repository's examples/packages).
gpu-dist: setup
	cargo test --release -p agora --test gpu --no-run
	cargo test --release -p agora-apps --test preemption --no-run
	mkdir -p dist/gpu
	strip -o dist/gpu/agora target/release/agora
	strip -o dist/gpu/gpu-tests $$(ls -t target/release/deps/gpu-* | grep -v '\.d$$' | head -1)
	strip -o dist/gpu/preemption-tests $$(ls -t target/release/deps/preemption-* | grep -v '\.d$$' | head -1)
	rm -f dist/gpu/agora-*.whl
	.venv/bin/python -m maturin build --quiet --release -m crates/python/Cargo.toml -o dist/gpu
