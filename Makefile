# modelrelay — see README.md. Every target works from a fresh clone.
PREFIX ?= /usr/local
DESTDIR ?=
CARGO ?= cargo
comma = ,
BINDIR = $(DESTDIR)$(PREFIX)/bin
MANDIR = $(DESTDIR)$(PREFIX)/share/man/man8
UNITDIR = $(DESTDIR)$(PREFIX)/lib/systemd/system
DOCDIR = $(DESTDIR)$(PREFIX)/share/doc/modelrelay
EXAMPLEDIR = $(DOCDIR)/examples
# `make static TARGET=...`: x86_64-unknown-linux-musl (default), aarch64-unknown-linux-musl,
# armv7-unknown-linux-musleabihf, x86_64-pc-windows-gnu (the worker). contrib/cross/cargo.sh
# installs the rustup target and Debian's cross compiler when missing.
TARGET ?= x86_64-unknown-linux-musl
# x86_64 musl binaries pack their relative relocations (`-z pack-relative-relocs`, DT_RELR):
# the static-PIE start code applies them as before (ASLR stays), from a table 8 bytes per
# 64 pointers instead of 24 bytes per pointer (about 40 KB less for the server, 80 KB for
# the worker). It needs musl >= 1.2.4 in the toolchain's self-contained libc (Rust >= 1.90:
# an older one would crash at start, so it is left out there) and GNU ld >= 2.38 (an older
# one ignores it with a warning).
RUSTC_MINOR := $(shell rustc -V 2>/dev/null | sed -n 's/^rustc 1\.\([0-9]*\).*/\1/p')
RELR = $(if $(and $(findstring x86_64-unknown-linux-musl,$(TARGET)),$(shell [ "$(RUSTC_MINOR)" -ge 90 ] 2>/dev/null && echo y)), -C link-arg=-Wl$(comma)-z$(comma)pack-relative-relocs,)
STATIC_FLAGS = $(if $(findstring musl,$(TARGET)),-C target-feature=+crt-static$(RELR)$(if $(MINIMAL), $(ROUTER_FLAGS),),)
# The router build (FEATURES=minimal) aborts on a panic instead of unwinding: about 220 KB
# less (no landing pads, no exception tables). The price: a bug that panics in one
# connection's thread ends the whole process (its service manager restarts it; requests in
# flight and queued are lost, workers reconnect) where the default build loses only that
# connection. The panic message is still logged. `-C force-unwind-tables=no` drops only
# little more (x86_64 .eh_frame 180 -> 164 KB): with LTO the standard library's bitcode
# brings most tables back, so a panic's backtrace still works.
ROUTER_FLAGS = -C force-unwind-tables=no
# It is also optimised for size at any price (opt-level "z"; the default build uses "s",
# which costs about 150 KB and saves about 15% CPU per request under load).
ROUTER_ENV = $(if $(MINIMAL),CARGO_PROFILE_RELEASE_PANIC=abort CARGO_PROFILE_RELEASE_OPT_LEVEL=z,)
# Windows gets the worker only (the server is for the always-on box).
BINS = $(if $(findstring windows,$(TARGET)),modelrelay-worker,modelrelay-server modelrelay-worker)
EXE = $(if $(findstring windows,$(TARGET)),.exe,)
# Extra cargo features, e.g. `make static FEATURES=server-tls` for built-in server HTTPS;
# `NO_TLS=1` builds without any TLS. `FEATURES=minimal` is the router build: the default
# without the dashboard, op-token governance and the moe ensemble (the worker keeps
# wss://; with NO_TLS=1 too it has no TLS either: the smallest binaries).
FEATURES ?=
NO_TLS ?=
# The default features other than TLS (what NO_TLS=1 keeps).
APP_FEATURES = dashboard,governance,moe,ollama
MINIMAL = $(filter minimal,$(subst $(comma), ,$(FEATURES)))
EXTRA_FEATURES = $(subst $(space),$(comma),$(strip $(filter-out minimal,$(subst $(comma), ,$(FEATURES)))))
FEATURE_FLAGS = $(if $(MINIMAL),--no-default-features $(call features,$(if $(NO_TLS),,tls) $(EXTRA_FEATURES)),\
  $(if $(NO_TLS),--no-default-features --features $(APP_FEATURES),) $(if $(FEATURES),--features $(FEATURES),))
space = $(empty) $(empty)
features = $(if $(strip $(1)),--features $(subst $(space),$(comma),$(strip $(1))),)
# `make dist`: one tarball per target in dist/, plus SHA256SUMS.
DIST_TARGETS ?= x86_64-unknown-linux-musl aarch64-unknown-linux-musl armv7-unknown-linux-musleabihf x86_64-pc-windows-gnu

.PHONY: build release static size dist run docs test test-rust test-browser test-cross test-packaging chaos fuzz soak scale bench bench-compare bench-orig interop bench-queue bench-usage bench-usage-stream bench-dashboard bench-failover bench-affinity bench-affinity-sim install uninstall clean lint bench-binary bench-ha bench-resume bench-store bench-profile bench-allocs bench-instructions

build:
	$(CARGO) build

release:
	$(CARGO) build --release $(FEATURE_FLAGS)

# Stripped, fully static binaries for routers, NAS boxes and home-lab servers
# (target/$(TARGET)/release/).
static:
	@if [ -n "$(NO_TLS)" ] && [ -n "$(FEATURES)" ] && [ -z "$(MINIMAL)" ]; then echo "NO_TLS=1 and FEATURES=$(FEATURES) contradict each other" >&2; exit 2; fi
	$(ROUTER_ENV) RUSTFLAGS="$(STATIC_FLAGS)" contrib/cross/cargo.sh $(TARGET) build --release $(addprefix --bin ,$(BINS)) $(FEATURE_FLAGS)
	@for b in $(BINS); do \
	  f=$(or $(CARGO_TARGET_DIR),target)/$(TARGET)/release/$$b$(EXE); \
	  printf '%-22s %8d bytes  %s\n' $$b$(EXE) $$(stat -c %s $$f) "$$(file -b $$f 2>/dev/null | cut -d, -f1-2)"; \
	done

# The stripped static binaries of every build (default, FEATURES=minimal, NO_TLS=1,
# FEATURES=server-tls) for TARGET, their sizes and the x86_64 size budgets (fails when over).
size:
	contrib/size.sh $(TARGET)

# Release tarballs for every DIST_TARGETS entry (binaries, man pages, systemd units, OpenWrt
# scripts, examples, README, docs, LICENSE) and dist/SHA256SUMS. NO_TLS=1 / FEATURES=... as for
# `make static` (the tarball names say so).
dist:
	@if [ -n "$(NO_TLS)" ] && [ -n "$(FEATURES)" ] && [ -z "$(MINIMAL)" ]; then echo "NO_TLS=1 and FEATURES=$(FEATURES) contradict each other" >&2; exit 2; fi
	@for t in $(DIST_TARGETS); do $(MAKE) --no-print-directory static TARGET=$$t || exit 1; done
	contrib/dist.sh --out dist $(if $(FEATURES)$(NO_TLS),--variant $(subst $(comma),+,$(FEATURES))$(if $(and $(FEATURES),$(NO_TLS)),+,)$(if $(NO_TLS),notls,),) $(DIST_TARGETS)

# Starts a relay, a worker and a demo backend on 127.0.0.1 (see README).
run:
	$(CARGO) build --release --bins --example demo_backend
	./contrib/run-demo.sh

# Rewrites the generated option tables in docs/configuration.md from the code's option
# tables (the ones --help prints); tests/docs.rs fails until they agree.
docs:
	$(CARGO) run --quiet --example options_doc

# Every test: formatting, lints, unit, integration (real sockets), end to end, docs, the
# real llama-server + SDK suite, the cross suite (ARM under qemu-user, the Windows worker
# under wine) and the packaging suite; ends with a per-suite summary.
test:
	./contrib/ci/test-all.sh

# The Rust suites only (no llama.cpp, browser, cross or packaging suites): the quick loop.
test-rust:
	MODELRELAY_SKIP_REAL_BACKEND=1 MODELRELAY_SKIP_BROWSER=1 MODELRELAY_SKIP_CROSS=1 MODELRELAY_SKIP_PACKAGING=1 ./contrib/ci/test-all.sh

# The dashboard and setup wizard in headless chromium (screenshots in target/browser-artifacts/).
test-browser:
	./tests/browser/run.sh

# The long chaos run: release binaries, 10,000 mixed requests while workers
# are killed, paused and cut off, two server restarts; prints the invariants table.
# CHAOS_SEED, CHAOS_REQUESTS, CHAOS_CLIENTS, CHAOS_FAULTS, ... (see examples/chaos.rs).
chaos:
	$(CARGO) build --release --bins --example chaos
	./target/release/examples/chaos
	ABUSE_IDLE=10000 ABUSE_WORKERS=1000 $(CARGO) test --release --test abuse -- --nocapture --test-threads=1

# Mixed load with faults for SOAK_SECS (1800) seconds; RSS, threads and fds of the server
# and the workers sampled every 10 s, with their slope per hour. Not in CI.
soak:
	$(CARGO) build --release --bins --example soak
	./target/release/examples/soak

# 1,000 concurrent streams through one real worker: peak RSS and threads, cost per slot.
scale:
	$(CARGO) build --release --bins --example scale
	./target/release/examples/scale

# Every network parser fuzzed for FUZZ_SECS (30) seconds each: seeded mutations, then
# libFuzzer when a nightly toolchain is installed (contrib/fuzz.sh).
fuzz:
	./contrib/fuzz.sh

# One suite alone: the cross builds under qemu-user / wine, or the packaging checks.
test-cross:
	tests/cross/run.sh

test-packaging:
	tests/packaging/run.sh

# Rerunnable figures (latency, throughput, idle CPU/RSS); BENCH_SECS=5 for longer windows.
bench:
	$(CARGO) build --release --bins --example bench
	./target/release/examples/bench

# Where the server's time goes at 64 clients end to end (perf: user vs kernel, hottest
# symbols, context switches per request by thread): `make bench-profile [BIN_DIR=dir]`.
bench-profile:
	$(CARGO) build --release --bins --example bench
	contrib/profile.sh $(or $(BIN_DIR),target/release) $(or $(CLIENTS),64)

# Heap allocations per request in the server and the worker, end to end under load
# (perf uprobes on glibc's allocator; needs root): `make bench-allocs [BIN_DIR=dir]`.
bench-allocs:
	$(CARGO) build --release --bins --example bench
	contrib/allocs.sh $(or $(BIN_DIR),target/release) $(or $(CLIENTS),64)

# User-space instructions per request in the server and the worker (valgrind callgrind;
# repeatable where CPU time is not): `make bench-instructions [BASE=other/target/release]`.
bench-instructions:
	$(CARGO) build --release --bins --example demo_backend
	contrib/instructions.sh $(BASE) target/release

# Two builds back to back, alternating, RUNS times (default 5); the median of every figure
# per build: `make bench-compare BASE=../other/target/release` (NEW defaults to this
# checkout's release build). Judge by the CPU/request rows on a busy machine.
bench-compare:
	$(CARGO) build --release --bins --example bench
	contrib/bench-compare.sh $(BASE) $(or $(NEW),target/release) $(or $(RUNS),5)

# The same, with BASE the original ModelRelay's binaries built from its source:
# `make bench-orig ORIG=dir` (its rows beside this checkout's, median of RUNS each).
bench-orig:
	$(CARGO) build --release --bins --example bench
	BASE_ORIG=1 contrib/bench-compare.sh $(ORIG) $(or $(NEW),target/release) $(or $(RUNS),5)

# Interop with the original ModelRelay: `make interop ORIG=dir`, dir holding its
# modelrelay-server and modelrelay-worker built from its source (both directions, a
# worker on two relays; loopback only). Not part of `make test`: CI has no such build.
interop:
	$(CARGO) build --release --bins --example demo_backend
	contrib/interop.sh $(ORIG)

# `make bench` with the usage journal on, without and then with 1,000 usage-stream
# subscribers that never read (they must not slow the relay).
bench-usage-stream:
	$(CARGO) build --release --bins --example bench
	BENCH_USAGE_SUBSCRIBERS=0 ./target/release/examples/bench
	BENCH_USAGE_SUBSCRIBERS=1000 ./target/release/examples/bench

# What open dashboards cost: server CPU idle and under load with 0 and 10 dashboards
# (each its own session reading /dashboard/events), and snapshots per tab per second.
bench-dashboard:
	$(CARGO) build --release --bins --example dashboard_bench
	./target/release/examples/dashboard_bench

# What a resumable stream costs: heap per held stream and per event, time per event.
bench-resume:
	$(CARGO) run --release --example resume_bench

# Dispatch cost with 100 / 1,000 / 10,000 queued requests across many tenants.
bench-queue:
	$(CARGO) run --release --example queue_bench

# Usage journal after a simulated year (100 models x 100 keys, hourly): size on disk,
# start-up load time, cost per add and per flush.
bench-usage:
	$(CARGO) run --release --example usage_journal_bench

# Failover figures: a dead or a wedged backend beside a healthy one
# (two workers x 4 slots, ~0.2 s answers), and how soon a revived backend takes work.
bench-failover:
	$(CARGO) build --release --bins --example failover_bench
	./target/release/examples/failover_bench

# Binary bodies: throughput and peak RSS of a 100 MiB upload and a 100 MiB streamed
# answer through the relay, the latency it adds to a small binary request, base64 rates.
bench-binary:
	$(CARGO) build --release --bins --example binary_bench
	./target/release/examples/binary_bench

# Several relays, one pool (two workers x 4 slots): requests lost when a relay is killed
# under load behind HAProxy, seconds until a restarted relay has its workers back, slot
# utilization with 1 vs 3 relays, busy refusals, and conversations' turns that moved box.
bench-ha:
	$(CARGO) build --release --bins --example ha_bench
	./target/release/examples/ha_bench

# Shared state (Redis): admission round trip p50/p99, the latency a request gains with
# the store on vs off, and a run with Redis stopped for 10 s (needs redis-server).
bench-store:
	$(CARGO) build --release --bins --example store_bench --features redis-store
	./target/release/examples/store_bench

# Cache affinity with two real llama-servers (Gemma 3 270M, 2 slots each): later-turn
# prompt tokens evaluated, latency, wall time and box shares, affinity off vs on
# (AFFINITY_BENCH_PHASES=off,on,on@0,on@1000 to compare waits). A few minutes on 2 cores.
bench-affinity:
	contrib/ci/setup-real-backend.sh >/dev/null
	$(CARGO) build --release --bins --example affinity_bench
	./target/release/examples/affinity_bench

# The same workload simulated on the dispatcher with a fake clock (no llama-server, under
# a second): AFFINITY_WAIT_MS from 0 to 30 s for given speeds, e.g. ARGS="600 30".
bench-affinity-sim:
	$(CARGO) run --release --example affinity_sim -- $(ARGS)

install: release
	install -d $(BINDIR) $(MANDIR) $(UNITDIR) $(EXAMPLEDIR)
	install -m 755 target/release/modelrelay-server target/release/modelrelay-worker $(BINDIR)/
	install -m 644 man/modelrelay-server.8 man/modelrelay-worker.8 $(MANDIR)/
	sed 's|/usr/local/bin|$(PREFIX)/bin|' contrib/systemd/modelrelay-server.service > $(UNITDIR)/modelrelay-server.service
	sed 's|/usr/local/bin|$(PREFIX)/bin|' contrib/systemd/modelrelay-worker@.service > $(UNITDIR)/modelrelay-worker@.service
	chmod 644 $(UNITDIR)/modelrelay-server.service $(UNITDIR)/modelrelay-worker@.service
	install -m 644 contrib/systemd/server.env.example contrib/systemd/worker.env.example $(EXAMPLEDIR)/
	install -d $(DOCDIR)/docs
	install -m 644 README.md $(DOCDIR)/
	install -m 644 docs/*.md $(DOCDIR)/docs/

uninstall:
	rm -f $(BINDIR)/modelrelay-server $(BINDIR)/modelrelay-worker
	rm -f $(MANDIR)/modelrelay-server.8 $(MANDIR)/modelrelay-worker.8
	rm -f $(UNITDIR)/modelrelay-server.service $(UNITDIR)/modelrelay-worker@.service
	rm -rf $(DESTDIR)$(PREFIX)/share/doc/modelrelay

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

clean:
	$(CARGO) clean
	rm -rf dist
