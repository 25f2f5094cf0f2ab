//! CPU-side micro-benchmarks: the costs the hot paths add on the host, with
//! no device work in the timed region.
//!
//!   cargo bench -p epmem-tools --bench micro              # times them (on any machine; host device by default)
//!   cargo bench -p epmem-tools --bench micro -- --quick   # fewer iterations
//!
//! CI compiles this file (`cargo bench --workspace --no-run`) but does not
//! time it: timings on a shared 2-core CI machine mean nothing. Each figure
//! is the median over repeated batches after a warm-up batch.
//!
//! The harness stays hand-written (the 15-line `bench` below) rather than
//! criterion: criterion and its plotting/serde/rayon tree would add more to
//! the CI build on 2 cores than the whole tools crate compiles now, for
//! statistics these coarse ns/op figures do not need (bench_compare.py
//! judges the GPU benches, not these).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use epmem::arena::{Arena, ArenaConfig, DeviceArena, PinnedArena};
use epmem::device::{self, Device, DeviceBuffer, Stream};
use epmem::kv::ledger::Ledger;
use epmem::staging::{PinnedStagingPool, PoolConfig};
use epmem::transfer::witness;
use epmem_tools::bench::median;

/// ns per operation: median over `batches` batches of `per_batch` calls, after one warm-up batch.
fn bench<F: FnMut(u64)>(name: &str, batches: usize, per_batch: u64, mut f: F) {
    let mut samples = Vec::with_capacity(batches);
    for b in 0..=batches {
        let t = Instant::now();
        for i in 0..per_batch {
            f(i);
        }
        let ns = t.elapsed().as_nanos() as f64 / per_batch as f64;
        if b > 0 {
            samples.push(ns);
        }
    }
    println!("{name:48} {:>10.1} ns/op  (median of {batches} batches x {per_batch})", median(&samples));
}

fn main() -> epmem::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let (batches, n) = if quick { (5, 1_000) } else { (21, 20_000) };
    let dev: Arc<dyn Device> = device::open_from_env(0)?;
    println!("epmem micro-benchmarks on {} ({})", dev.info().name, dev.info().kind.name());

    // Pool: acquire, a completed copy to mint the witness (not timed), retire.
    let pool = PinnedStagingPool::new(&dev, PoolConfig::default())?;
    let stream = Stream::new(&dev)?;
    let dst = DeviceBuffer::new(&dev, 4096)?;
    let mut samples = Vec::new();
    for b in 0..=batches {
        let mut ns = 0u128;
        for _ in 0..n / 10 {
            let t = Instant::now();
            let buf = pool.acquire(4096)?;
            ns += t.elapsed().as_nanos();
            let done = witness::enqueue_htod(&stream, dst.ptr(), buf, 4096, None)?.wait()?;
            let t = Instant::now();
            pool.release(done);
            ns += t.elapsed().as_nanos();
        }
        if b > 0 {
            samples.push(ns as f64 / (n / 10) as f64);
        }
    }
    println!(
        "{:48} {:>10.1} ns/op  (median of {batches} batches x {})",
        "staging pool acquire+retire (4 KiB)",
        median(&samples),
        n / 10
    );

    // Arenas: alloc+free pairs once the chunk is committed (steady state: no driver call).
    let arena = DeviceArena::new(&dev, ArenaConfig::with_capacity(64 << 20))?;
    arena.free(arena.alloc(1 << 20, 0)?)?;
    bench("device arena alloc+free (64 KiB)", batches, n, |_| {
        let a = arena.alloc(64 << 10, 0).expect("alloc");
        arena.free(black_box(a)).expect("free");
    });
    let mut live = Vec::with_capacity(64);
    bench("device arena 64 live, alloc+free mixed sizes", batches, n, |i| {
        if live.len() == 64 {
            arena.free(live.swap_remove((i as usize * 7) % 64)).expect("free");
        }
        live.push(arena.alloc(4096 << (i % 6), 0).expect("alloc"));
    });
    for a in live.drain(..) {
        arena.free(a)?;
    }
    let pinned = PinnedArena::new(&dev, ArenaConfig::with_capacity(64 << 20))?;
    pinned.free(pinned.alloc(4096, 0)?)?;
    bench("pinned arena alloc+free (4 KiB)", batches, n, |_| {
        let a = pinned.alloc(4096, 0).expect("alloc");
        pinned.free(black_box(a)).expect("free");
    });

    // KV ledger: charge + credit of one granule.
    let mut ledger = Ledger::new(1 << 40);
    bench("kv ledger charge+credit", batches, n, |i| {
        let key = i as u32;
        ledger.charge(key, 2 << 20, false).expect("charge");
        black_box(ledger.credit(key).expect("credit"));
    });
    Ok(())
}
