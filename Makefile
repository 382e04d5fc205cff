# The two commands of this repository (see README.md):
#   make demo   install what is needed, build, run the demo (embedded daemon + client processes)
#   make test   the whole test suite: format, lints, unit and integration tests, benchmark smoke run
.PHONY: setup demo test bench

setup:
	bash scripts/setup.sh

demo: setup
	./target/release/agora demo

test: setup
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --release -- -D warnings
	cargo test --workspace --release
	./target/release/agora bench latency --quick

bench: setup
	./target/release/agora bench latency
