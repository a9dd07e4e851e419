# modelrelay — see README.md. Every target works from a fresh clone.
PREFIX ?= /usr/local
DESTDIR ?=
CARGO ?= cargo

.PHONY: build release run test bench clean lint

build:
	$(CARGO) build

release:
	$(CARGO) build --release

# Starts a relay, a worker and a demo backend on 127.0.0.1 (see README).
run: release
	./contrib/run-demo.sh

# Every test: unit, integration (real sockets), formatting and lints.
test:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings
	$(CARGO) test --all-targets

# Rerunnable figures (latency, throughput, idle CPU/RSS); BENCH_SECS=5 for longer windows.
bench:
	$(CARGO) build --release --bins --example bench
	./target/release/examples/bench

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

clean:
	$(CARGO) clean
