//! kv_churn: a long prefix-sharing churn on the KV pool, watching for
//! driver-allocation growth and ledger drift (the long runs of scripts/long-run.sh).
//!
//!   EPM_DEVICE=cuda kv_churn              # on a GPU: 20,000 requests, ~1 min
//!   kv_churn --quick                      # 300 requests on the host device (CI smoke)
//!   kv_churn --iters N --window K --rotate R --prefix-tokens P --append-tokens A
//!
//! Defaults: 500 prefix tokens of a qwen2.5-0.5b-shaped layout (12,288 B per
//! token), so the prefix ends inside its third 2 MiB granule and every
//! request copies that boundary granule on write.
//!
//! Each request commits a sharer on the current pinned prefix (read-only, no
//! copy), appends A tokens (copy-on-write of the boundary granule, fresh
//! granules after it), writes them, and checks on the device that the
//! sharer's prefix and its own tokens carry the right checksums. K sharers
//! stay live; the oldest is destroyed. Every R requests a new prefix is
//! written, pinned from a short-lived origin, and the old one unpinned (it
//! is freed with its last sharer).
//!
//! At checkpoints it prints the ledger next to the live granules it counts
//! itself (the dummy, every sequence's private granules, every live
//! prefix's granules) and the device's driver counts. It fails (exit 1) if,
//! after the warm-up (K + 2R requests, one full rotation with a full
//! window), a physical allocation is made (cuMemCreate, cuMemHostAlloc,
//! cuMemAlloc), if the ledger ever differs from the live granules or from the
//! device's physical bytes, or if a checksum differs. Last line: the verdict.

use std::collections::VecDeque;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use epmem::device::{self, Device, DeviceBuffer, DriverCounts, Stream, checksum_host};
use epmem::kv::{AdmitMode, KvConfig, KvLayout, KvPool, KvShape, PrefixId, SeqId};

/// `n` deterministic bytes per seed, so a checksum failure reproduces.
fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    fastrand::Rng::with_seed(seed).fill(&mut v);
    v
}

struct Args {
    iters: u64,
    window: usize,
    rotate: u64,
    prefix_tokens: u64,
    append_tokens: u64,
    checkpoints: u64,
}

fn parse() -> Result<Args, String> {
    let mut a =
        Args { iters: 20_000, window: 16, rotate: 500, prefix_tokens: 500, append_tokens: 200, checkpoints: 10 };
    use lexopt::prelude::*;
    let mut p = lexopt::Parser::from_env();
    let e = |e: lexopt::Error| e.to_string();
    while let Some(arg) = p.next().map_err(e)? {
        match arg {
            Long("quick") => (a.iters, a.window, a.rotate) = (300, 4, 40),
            Long("iters") => a.iters = p.value().and_then(|v| v.parse()).map_err(e)?,
            Long("window") => a.window = p.value().and_then(|v| v.parse()).map_err(e)?,
            Long("rotate") => a.rotate = p.value().and_then(|v| v.parse()).map_err(e)?,
            Long("prefix-tokens") => a.prefix_tokens = p.value().and_then(|v| v.parse()).map_err(e)?,
            Long("append-tokens") => a.append_tokens = p.value().and_then(|v| v.parse()).map_err(e)?,
            Long("checkpoints") => a.checkpoints = p.value().and_then(|v| v.parse()).map_err(e)?,
            other => return Err(e(other.unexpected())),
        }
    }
    if a.window == 0 || a.rotate == 0 || a.prefix_tokens == 0 || a.append_tokens == 0 || a.checkpoints == 0 {
        return Err("--window, --rotate, --prefix-tokens, --append-tokens, --checkpoints must be positive".into());
    }
    Ok(a)
}

/// Physical allocations only: mappings and VA reservations are expected per request.
fn allocs(c: &DriverCounts) -> (u64, u64, u64) {
    (c.vmm_create_calls, c.pinned_alloc_calls, c.device_alloc_calls)
}

struct Churn {
    dev: Arc<dyn Device>,
    s: Stream,
    a: KvPool,
    layout: KvLayout,
    args: Args,
    /// Device slots for two checksums, and their host copy.
    sums: DeviceBuffer,
    appended: [Vec<u8>; 4],
    appended_sums: [u64; 4],
    /// Live prefixes: (id, pinned, host checksum of its bytes).
    prefixes: Vec<(PrefixId, bool, u64)>,
    /// Live sharers: (sequence, prefix id).
    window: VecDeque<(SeqId, PrefixId)>,
    mismatches: u64,
}

impl Churn {
    fn bytes(&self, tokens: u64) -> usize {
        (tokens * self.layout.bytes_per_token()) as usize
    }

    fn write(&self, dst: u64, data: &[u8]) -> epmem::Result<()> {
        // SAFETY: `data` outlives the copy: the stream is synchronized below.
        unsafe { self.dev.memcpy_htod_async(dst, data.as_ptr(), data.len(), self.s.raw())? };
        self.s.synchronize()
    }

    /// Device checksums of two ranges, compared with the host's.
    fn check(&mut self, what: &str, ranges: [(u64, usize, u64); 2]) -> epmem::Result<()> {
        for (i, &(p, n, _)) in ranges.iter().enumerate() {
            self.dev.checksum_async(p, n, self.sums.ptr() + 8 * i as u64, self.s.raw())?;
        }
        let mut got = [0u8; 16];
        // SAFETY: `got` outlives the copy: the stream is synchronized below.
        unsafe { self.dev.memcpy_dtoh_async(got.as_mut_ptr(), self.sums.ptr(), 16, self.s.raw())? };
        self.s.synchronize()?;
        for (i, &(_, _, want)) in ranges.iter().enumerate() {
            let v = u64::from_le_bytes(got[8 * i..8 * i + 8].try_into().unwrap());
            if v != want {
                if self.mismatches < 10 {
                    eprintln!("kv_churn: {what}, range {i}: device checksum {v:016x} != host {want:016x}");
                }
                self.mismatches += 1;
            }
        }
        Ok(())
    }

    /// Write a new prefix through a short-lived origin, pin it, unpin the old.
    fn rotate(&mut self, generation: u64) -> epmem::Result<()> {
        let p = self.args.prefix_tokens;
        let origin = self.a.create_sequence(&self.layout, p, AdmitMode::OnDemand)?;
        self.a.prepare_append(origin, p, self.s.raw())?;
        let data = random_bytes(1000 + generation, self.bytes(p));
        let base = self.a.sequence_info(origin)?.base;
        self.write(base, &data)?;
        let pid = self.a.pin_prefix(origin, p, self.s.raw())?;
        self.a.destroy_sequence(origin)?;
        for e in self.prefixes.iter_mut().filter(|e| e.1) {
            self.a.unpin_prefix(e.0)?;
            e.1 = false;
        }
        self.prefixes.push((pid, true, checksum_host(&data)));
        Ok(())
    }

    fn request(&mut self, i: u64) -> epmem::Result<()> {
        let (p, n) = (self.args.prefix_tokens, self.args.append_tokens);
        let &(pid, _, psum) = self.prefixes.last().expect("a pinned prefix");
        let seq = self.a.commit_shared_prefix(pid, p, p + n, AdmitMode::Promise)?;
        self.a.prepare_append(seq, n, self.s.raw())?;
        let base = self.a.sequence_info(seq)?.base;
        let v = (i % 4) as usize;
        let off = self.bytes(p);
        let app = std::mem::take(&mut self.appended[v]);
        let r = self.write(base + off as u64, &app);
        self.appended[v] = app;
        r?;
        let asum = self.appended_sums[v];
        self.check(&format!("request {i}"), [(base, off, psum), (base + off as u64, self.bytes(n), asum)])?;
        self.window.push_back((seq, pid));
        if self.window.len() > self.args.window {
            let (old, _) = self.window.pop_front().unwrap();
            self.a.destroy_sequence(old)?;
        }
        Ok(())
    }

    /// (owned granules by the ledger, live granules counted here). Also
    /// drops prefixes freed with their last sharer from the list.
    fn ledger_vs_live(&mut self) -> epmem::Result<(u64, u64, bool)> {
        self.prefixes.retain(|&(pid, _, _)| self.a.prefix_info(pid).is_ok());
        let mut live = 1; // the dummy
        for &(seq, _) in &self.window {
            live += self.a.sequence_info(seq)?.private_granules;
        }
        for &(pid, _, _) in &self.prefixes {
            live += self.a.prefix_info(pid)?.granules;
        }
        let st = self.a.stats();
        let g = st.granule_bytes;
        let device_ok = self.dev.live_counts().physical_bytes == st.ledger.owned_bytes + st.pool.retained * g;
        Ok((st.ledger.owned_granules, live, device_ok && st.ledger.owned_bytes == st.ledger.owned_granules * g))
    }
}

fn run(args: Args) -> Result<String, String> {
    let e = |e: epmem::Error| format!("{:?}: {}", e.status(), e.message());
    let dev = device::open_from_env(0).map_err(e)?;
    let layout = KvLayout::token_major(KvShape { layers: 24, kv_heads: 2, head_dim: 64, elem_bytes: 2 }).map_err(e)?;
    let g = dev.vmm_granularity() as u64;
    let per_seq = (args.prefix_tokens + args.append_tokens) * layout.bytes_per_token() / g + 2;
    // Room for the window, two prefixes and an origin, twice over: the pool
    // never has to give a retained granule back for budget.
    let budget = 2 * (args.window as u64 + 4) * per_seq * g;
    let a = KvPool::new(&dev, KvConfig::new(budget)).map_err(e)?;
    let n = (args.append_tokens * layout.bytes_per_token()) as usize;
    let appended: [Vec<u8>; 4] = std::array::from_fn(|v| random_bytes(7 + v as u64, n));
    let appended_sums = std::array::from_fn(|v| checksum_host(&appended[v]));
    let mut c = Churn {
        s: Stream::new(&dev).map_err(e)?,
        sums: DeviceBuffer::new(&dev, 16).map_err(e)?,
        dev: dev.clone(),
        a,
        layout,
        appended,
        appended_sums,
        prefixes: Vec::new(),
        window: VecDeque::new(),
        mismatches: 0,
        args,
    };
    let (iters, rotate, window) = (c.args.iters, c.args.rotate, c.args.window as u64);
    let warmup = (window + 2 * rotate).min(iters);
    let every = (iters / c.args.checkpoints).max(1);
    println!(
        "kv_churn on {}: {iters} requests, window {window}, new prefix every {rotate}, {} + {} tokens of {} B, granule {} KiB, warm-up {warmup}",
        dev.info().name,
        c.args.prefix_tokens,
        c.args.append_tokens,
        layout.bytes_per_token(),
        g >> 10
    );
    let mut baseline: Option<(u64, u64, u64)> = None;
    let mut problems = Vec::new();
    let t0 = Instant::now();
    for i in 0..iters {
        if i % rotate == 0 {
            c.rotate(i / rotate).map_err(e)?;
        }
        c.request(i).map_err(e)?;
        let done = i + 1;
        if done == warmup {
            baseline = Some(allocs(&dev.driver_counts()));
        }
        if done % every == 0 || done == iters || done == warmup {
            let (owned, live, device_ok) = c.ledger_vs_live().map_err(e)?;
            let d = dev.driver_counts();
            let st = c.a.stats();
            println!(
                "  {done:>6} requests {:>7.1} s: ledger {owned} granules, live {live}, retained {}; driver: vmm_create {} pinned_alloc {} device_alloc {} map {} unmap {}",
                t0.elapsed().as_secs_f64(),
                st.pool.retained,
                d.vmm_create_calls,
                d.pinned_alloc_calls,
                d.device_alloc_calls,
                d.vmm_map_calls,
                d.vmm_unmap_calls
            );
            if owned != live || !device_ok {
                problems.push(format!(
                    "ledger drift at {done}: ledger {owned} granules, live {live}, device agrees: {device_ok}"
                ));
            }
            if let Some(b) = baseline
                && allocs(&d) != b
            {
                problems.push(format!("driver allocations grew after warm-up at {done}: {b:?} -> {:?}", allocs(&d)));
            }
        }
    }
    while let Some((seq, _)) = c.window.pop_front() {
        c.a.destroy_sequence(seq).map_err(e)?;
    }
    for &(pid, pinned, _) in &c.prefixes {
        if pinned {
            c.a.unpin_prefix(pid).map_err(e)?;
        }
    }
    let st = c.a.stats();
    if st.ledger.owned_bytes != g || st.sequences != 0 || st.prefixes != 0 {
        problems.push(format!(
            "after teardown the ledger owns {} bytes (want one granule, the dummy): {st:?}",
            st.ledger.owned_bytes
        ));
    }
    if c.mismatches > 0 {
        problems.push(format!("{} checksum mismatches", c.mismatches));
    }
    let secs = t0.elapsed().as_secs_f64();
    let b = baseline.unwrap_or_default();
    if problems.is_empty() {
        Ok(format!(
            "kv_churn: PASS: {iters} requests in {secs:.1} s ({:.0}/s), driver allocations flat after warm-up (vmm_create {}, pinned {}, device {}), ledger = live granules at every checkpoint, {} COW granules, 0 checksum mismatches",
            iters as f64 / secs,
            b.0,
            b.1,
            b.2,
            st.counters.cow_granules
        ))
    } else {
        Err(problems.join("; "))
    }
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(m) => {
            eprintln!("kv_churn: {m}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(verdict) => {
            println!("{verdict}");
            ExitCode::SUCCESS
        }
        Err(m) => {
            println!("kv_churn: FAIL: {m}");
            ExitCode::FAILURE
        }
    }
}
