//! The allocator of the static Linux builds, when built with the `mimalloc` feature.
//!
//! musl's own allocator is small and keeps little memory, but it is slow with many
//! threads: at 64 clients end to end the static x86_64 build spent about 40 % more CPU
//! per request than the same code against glibc, most of it in the worker, which
//! allocates for every backend call. With mimalloc the static build costs what the glibc
//! build does, but every thread keeps its own heap: with 100 workers connected the
//! server's resident memory grows from about 8 to about 20 MB, an idle worker's from about
//! 3 to 7 MB (`make bench` with `BENCH_BIN_DIR` at each build; docs/deploying.md). That
//! is the trade a box with a weak CPU and memory to spare may want, so it is a feature,
//! not the default. Other targets keep their platform's allocator: glibc's is fast
//! already, and the 32-bit ARM build would need a libatomic its cross toolchain lacks.

#[cfg(all(
    feature = "mimalloc",
    target_env = "musl",
    any(target_arch = "x86_64", target_arch = "aarch64")
))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
