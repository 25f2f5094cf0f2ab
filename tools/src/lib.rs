//! epmem's tools: the benchmark programs (tools/src/bin/bench_*.rs), the kv_churn
//! long run (src/bin/kv_churn.rs) and the CPU micro-benchmarks
//! (benches/micro.rs). They use only the public Rust API of `epmem`; nothing
//! here is compiled into the library.

pub mod bench;
