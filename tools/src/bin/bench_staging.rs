//! Page-in bandwidth, side by side in one run:
//!
//! - (a) pageable source, pinned buffer allocated and freed per page-in (what a host without a pool does);
//! - (b) pageable source, pooled buffer, host-synchronous: fill, copy, wait (a pool without overlap);
//! - (c) ours: the copy engine — pooled slots, multi-threaded fill overlapped with the DMA;
//! - (d) ours, direct path: the source registered once, copied with no staging;
//! - (e) the physical peak: one copy from an already-filled pinned buffer
//!   (cuMemHostAlloc memory);
//! - (e') the direct path's own ceiling: one raw copy from the same registered
//!   range (d) copies, timed exactly like (e), alternating with (d) run by run
//!   so both see the same machine. (d)/(e') is what the engine adds per copy;
//!   (e')/(e) in device time is what registered memory costs the DMA;
//! - (f) the host's fill ceiling: the best multi-threaded pageable → pinned
//!   memcpy rate while a long DMA runs (fill and DMA share host memory bandwidth);
//!   (f') the same fill cut into slot-sized pieces over the engine's number of
//!   recycled buffers. (c) at 128 MiB can exceed (f), so a big fresh
//!   destination is not the engine's ceiling; (f') shows whether the
//!   recycled destinations are why.
//!
//! (a) and (b) fill with the same fill threads as (c), so (b) → (c) isolates the
//! overlap and (a) → (b) the allocation. Every page-in rate is bytes over host
//! wall time from the call to observed completion (event synchronize), the time
//! a caller actually waits. Also: acquire+release latency of the pool, and the
//! pinned allocations of the steady state.
//!
//!   bench_staging [--quick] [--runs N] [--json PATH]
//!
//! Run on the H200 with EPM_DEVICE=cuda (scripts/bench.sh does). `--quick`
//! (small sizes, few runs) is the CI smoke test on the host device.

use std::fmt::Write as _;
use std::time::Instant;

use epmem::device::{self, DeviceBuffer, Event, HostRange, PinnedBuffer, Stream};
use epmem::staging::{CopyEngine, EngineConfig, PinnedStagingPool, PoolConfig};
use epmem::transfer::fill::FillThreads;
use epmem::transfer::witness::{self, CopyTiming};
use epmem_tools::bench::{BenchArgs, Report, Scenario, gbps, median, repeat};

const MIB: usize = 1 << 20;

struct Plan {
    sizes_mib: &'static [usize],
    warmup: usize,
    runs: usize,
    latency_iters: usize,
    ceiling_threads: &'static [usize],
    ceiling_fill: usize,
    ceiling_dma: usize,
    /// (c) tuning sweep: sizes, fill threads, chunks per page-in.
    sweep_mib: &'static [usize],
    sweep_threads: &'static [usize],
    sweep_chunks: &'static [usize],
}

const FULL: Plan = Plan {
    sizes_mib: &[2, 8, 32, 128],
    warmup: 2,
    runs: 9,
    latency_iters: 2000,
    ceiling_threads: &[4, 6, 8, 12, 16],
    ceiling_fill: 128 * MIB,
    ceiling_dma: 1024 * MIB,
    sweep_mib: &[8, 32, 128],
    sweep_threads: &[8, 12, 16],
    sweep_chunks: &[4, 8, 16],
};

const QUICK: Plan = Plan {
    sizes_mib: &[2, 8],
    warmup: 1,
    runs: 3,
    latency_iters: 200,
    ceiling_threads: &[2, 4],
    ceiling_fill: 8 * MIB,
    // Long enough that an oversubscribed 2-core CI host still fills 8 MiB
    // before this "DMA" (a host-device worker's memcpy) ends: 64 MiB was not.
    ceiling_dma: 512 * MIB,
    sweep_mib: &[8],
    sweep_threads: &[2],
    sweep_chunks: &[4, 16],
};

type Res<T> = epmem::Result<T>;

/// A pageable, touched source range that lives for the whole run.
fn pageable(len: usize, seed: u8) -> HostRange {
    let v: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    HostRange::from_static(Box::leak(v.into_boxed_slice()))
}

/// Wall-clock ms of `f`, which must end after observing completion.
fn timed(f: impl FnOnce() -> Res<()>) -> Res<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// Run a page-in `runs` times after `warmup` and return its GB/s samples.
fn rate(plan: &Plan, bytes: usize, mut f: impl FnMut() -> Res<()>) -> Res<Vec<f64>> {
    let mut err = None;
    let samples = repeat(plan.warmup, plan.runs, || match timed(&mut f) {
        Ok(ms) => gbps(bytes as u64, ms),
        Err(e) => {
            err.get_or_insert(e);
            f64::NAN
        }
    });
    match err {
        Some(e) => Err(e),
        None => Ok(samples),
    }
}

struct Ctx {
    stream: Stream,
    pool: PinnedStagingPool,
    engine: CopyEngine,
    fill: FillThreads,
}

/// (f): fill `plan.ceiling_fill` bytes pageable → pinned with `fill` while a
/// `plan.ceiling_dma` copy runs, in pieces of one `dsts` buffer's length taken
/// in turn (one big buffer: the plain ceiling; the engine's slots: the same
/// fill pattern the engine has: recycled destinations that may stay
/// partly cached). Returns GB/s, or None when the DMA ended before the fill
/// (then the sample did not measure contention).
fn fill_under_dma(
    c: &Ctx,
    plan: &Plan,
    fill: &FillThreads,
    dma_src: &mut Option<PinnedBuffer>,
    dma_dst: &DeviceBuffer,
    src: HostRange,
    dsts: &mut [PinnedBuffer],
) -> Res<Option<f64>> {
    let Some(piece) = dsts.first().map(|d| d.len().min(plan.ceiling_fill)) else {
        epmem::bail!(Internal, "no fill destination")
    };
    let Some(buf) = dma_src.take() else { epmem::bail!(Internal, "DMA source buffer lost") };
    let dma = witness::enqueue_htod(&c.stream, dma_dst.ptr(), buf, plan.ceiling_dma, None)?;
    let t = Instant::now();
    let n = dsts.len();
    for (i, from) in src.as_slice()[..plan.ceiling_fill].chunks(piece).enumerate() {
        fill.copy(&mut dsts[i % n][..from.len()], from)?;
    }
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let (buf, overlapped) = match dma.try_complete()? {
        witness::TryComplete::Done(done) => (done.into_buffer(), false),
        witness::TryComplete::Pending(dma) => (dma.wait()?.into_buffer(), true),
    };
    *dma_src = Some(buf);
    Ok(overlapped.then(|| gbps(plan.ceiling_fill as u64, ms)))
}

/// Samples of `fill_under_dma` after the warm-up, and how many were dropped.
fn ceiling_samples(
    c: &Ctx,
    plan: &Plan,
    fill: &FillThreads,
    dma: (&mut Option<PinnedBuffer>, &DeviceBuffer),
    src: HostRange,
    dsts: &mut [PinnedBuffer],
) -> Res<(Vec<f64>, usize)> {
    let (mut samples, mut contaminated) = (Vec::new(), 0);
    for i in 0..plan.warmup + plan.runs {
        match fill_under_dma(c, plan, fill, dma.0, dma.1, src, dsts)? {
            Some(g) if i >= plan.warmup => samples.push(g),
            Some(_) => {}
            None => contaminated += 1,
        }
    }
    Ok((samples, contaminated))
}

fn main() {
    let args = BenchArgs::parse();
    if let Err(e) = run(&args) {
        eprintln!("bench_staging: {e}");
        std::process::exit(1);
    }
}

fn run(args: &BenchArgs) -> Res<()> {
    let mut plan = if args.quick { QUICK } else { FULL };
    if let Some(r) = args.runs {
        plan.runs = r.max(1);
    }
    let dev = device::open_from_env(0)?;
    let info = dev.info().clone();
    let cfg = EngineConfig::default();
    let pool = PinnedStagingPool::new(&dev, PoolConfig::default())?;
    let c = Ctx {
        stream: Stream::new(&dev)?,
        engine: CopyEngine::new(&pool, cfg)?,
        fill: FillThreads::new(cfg.fill_threads)?,
        pool,
    };
    let mut rep = Report::new("staging", &info.name, info.kind.name(), plan.runs, plan.warmup);

    // (f) first: the ceiling every staged figure is judged against.
    let max_size = plan.sizes_mib.iter().max().copied().unwrap_or(1) * MIB;
    let ceiling_src = pageable(plan.ceiling_fill, 7);
    let mut ceiling_dst = [PinnedBuffer::new(&dev, plan.ceiling_fill)?];
    let mut slot_dsts = (0..cfg.slots).map(|_| PinnedBuffer::new(&dev, cfg.chunk_bytes)).collect::<Res<Vec<_>>>()?;
    let mut dma_src = Some(PinnedBuffer::new(&dev, plan.ceiling_dma)?);
    let dma_dst = DeviceBuffer::new(&dev, plan.ceiling_dma)?;
    let mut best = (0usize, 0.0f64, Vec::new());
    let mut best_slots = (0usize, 0.0f64);
    let mut ceiling_rows = String::new();
    for &t in plan.ceiling_threads {
        let fill = FillThreads::new(t)?;
        let (samples, contaminated) =
            ceiling_samples(&c, &plan, &fill, (&mut dma_src, &dma_dst), ceiling_src, &mut ceiling_dst)?;
        let (in_slots, slots_contaminated) =
            ceiling_samples(&c, &plan, &fill, (&mut dma_src, &dma_dst), ceiling_src, &mut slot_dsts)?;
        let alone = rate(&plan, plan.ceiling_fill, || fill.copy(&mut ceiling_dst[0], ceiling_src.as_slice()))?;
        let (m, ms, a) = (median(&samples), median(&in_slots), median(&alone));
        let dropped = contaminated + slots_contaminated;
        // Every sample of a thread count can outlast the DMA on a slow
        // machine (the 2-core CI host): then there is no figure, not a NaN.
        let fig = |v: f64| if v.is_finite() { format!("{v:.1}") } else { "–".to_string() };
        let _ = writeln!(ceiling_rows, "| {t} | {} | {} | {a:.1} | {dropped} |", fig(m), fig(ms));
        let x = t as f64;
        if !samples.is_empty() {
            rep.push(Scenario::new("fill_threads", &format!("f_under_dma/{t}"), "GB/s", true, samples.clone()).at(x));
        }
        if !in_slots.is_empty() {
            rep.push(Scenario::new("fill_threads", &format!("f_slots_under_dma/{t}"), "GB/s", true, in_slots).at(x));
        }
        rep.push(Scenario::new("fill_threads", &format!("fill_alone/{t}"), "GB/s", true, alone).at(x));
        if m > best.1 {
            best = (t, m, samples);
        }
        if ms > best_slots.1 {
            best_slots = (t, ms);
        }
    }
    drop(slot_dsts);

    // Acquire + release latency of the pool (the copy between them is not timed).
    let lat_dst = DeviceBuffer::new(&dev, 4096)?;
    let mut lat = Vec::with_capacity(plan.latency_iters);
    for i in 0..plan.latency_iters + 100 {
        let t0 = Instant::now();
        let buf = c.pool.acquire(4096)?;
        let acquire = t0.elapsed();
        let done = witness::enqueue_htod(&c.stream, lat_dst.ptr(), buf, 4096, None)?.wait()?;
        let t1 = Instant::now();
        c.pool.release(done);
        let release = t1.elapsed();
        if i >= 100 {
            lat.push((acquire + release).as_secs_f64() * 1e6);
        }
    }
    let lat_us = rep.push(Scenario::new("pool", "acquire_release", "us", false, lat));

    let mut table = String::new();
    let mut direct_rows = String::new();
    let mut steady_allocs = 0u64;
    let mut targets = Vec::new();
    let timing = CopyTiming::new(&dev)?;
    let mut sources = Vec::new();
    for &mib in plan.sizes_mib {
        let n = mib * MIB;
        let src = pageable(n, mib as u8);
        let dst = DeviceBuffer::new(&dev, n)?;
        let x = mib as f64;
        let tag = format!("{mib}MiB");

        let a = rate(&plan, n, || {
            let mut buf = PinnedBuffer::new(&dev, n)?;
            c.fill.copy(&mut buf, src.as_slice())?;
            drop(witness::enqueue_htod(&c.stream, dst.ptr(), buf, n, None)?.wait()?);
            Ok(())
        })?;
        let b = rate(&plan, n, || {
            let mut buf = c.pool.acquire(n)?;
            c.fill.copy(&mut buf[..n], src.as_slice())?;
            c.pool.release(witness::enqueue_htod(&c.stream, dst.ptr(), buf, n, None)?.wait()?);
            Ok(())
        })?;
        // (c): warm-up inside `rate` first, then count allocations over the measured runs.
        let mut allocs_before = None;
        let mut runs_seen = 0;
        let cc = rate(&plan, n, || {
            runs_seen += 1;
            if runs_seen == plan.warmup + 1 {
                allocs_before = Some(c.engine.stats().pinned_alloc_calls);
            }
            c.engine.htod(dst.ptr(), src, None)?.wait()
        })?;
        steady_allocs += c.engine.stats().pinned_alloc_calls - allocs_before.unwrap_or(0);
        let reg = c.engine.register(src)?;
        let direct = direct_vs_raw(&c, &plan, n, src, &dst)?;
        drop(reg);
        let mut peak_buf = Some(PinnedBuffer::new(&dev, n)?);
        let mut device_ms = Vec::new();
        let e = rate(&plan, n, || {
            let Some(buf) = peak_buf.take() else { epmem::bail!(Internal, "peak buffer lost") };
            let buf = witness::enqueue_htod(&c.stream, dst.ptr(), buf, n, Some(&timing))?.wait()?.into_buffer();
            if let Some(ms) = timing.elapsed_ms()? {
                device_ms.push(f64::from(ms));
            }
            peak_buf = Some(buf);
            Ok(())
        })?;
        let e_dev: Vec<f64> = device_ms.iter().skip(plan.warmup).map(|&ms| gbps(n as u64, ms)).collect();

        let page = |name: &str, samples: Vec<f64>| {
            Scenario::new("pagein", &format!("{name}/{tag}"), "GB/s", true, samples).at(x)
        };
        let dev_time = |name: &str, samples: Vec<f64>| {
            Scenario::new("pagein_device_time", &format!("{name}/{tag}"), "GB/s", true, samples).at(x)
        };
        let va = rep.push(page("a_alloc_free", a));
        let vb = rep.push(page("b_pooled_sync", b));
        let vc = rep.push(page("c_ours", cc));
        let vd = rep.push(page("d_direct", direct.d));
        let ve = rep.push(page("e_peak", e));
        let ver = rep.push(page("e_peak_registered", direct.raw));
        let ve_dev = rep.push(dev_time("e_peak_device", e_dev));
        let vd_dev = rep.push(dev_time("d_direct_device", direct.d_dev));
        let ver_dev = rep.push(dev_time("e_peak_registered_device", direct.raw_dev));
        rep.push(Scenario::new("pagein", &format!("f_fill_ceiling/{tag}"), "GB/s", true, best.2.clone()).at(x));
        let vf = best.1;
        let _ = writeln!(
            table,
            "| {mib} MiB | {va:.1} | {vb:.1} | **{vc:.1}** | {vd:.1} ({vd_dev:.1}) | {ve:.1} ({ve_dev:.1}) | {ver:.1} ({ver_dev:.1}) | {vf:.1} | {:.2} | {:.0}% | {:.0}% | {:.0}% |",
            vc / vf,
            100.0 * vc / ve,
            100.0 * vd / ve,
            100.0 * vd / ver
        );
        let _ = writeln!(
            direct_rows,
            "| {mib} MiB | {:.0}% | {:.0}% | {:.1} µs |",
            100.0 * ver_dev / ve_dev,
            100.0 * vd / ver,
            per_copy_us(n, vd, ver)
        );
        if mib >= 32 {
            targets.push(format!(
                "(c) ≥ 0.95×(f) at {mib} MiB: {:.2} {} (against (f') into the slots, {:.1} GB/s with {} threads: {:.2})",
                vc / vf,
                verdict(vc >= 0.95 * vf),
                best_slots.1,
                best_slots.0,
                vc / best_slots.1
            ));
            targets.push(format!("(c) ≥ 70% of (e) at {mib} MiB: {:.0}% {}", 100.0 * vc / ve, verdict(vc >= 0.7 * ve)));
        }
        targets.push(format!(
            "(d) ≥ 95% of (e) at {mib} MiB: {:.0}% {}; of (e') from the same registered range: {:.0}% {}",
            100.0 * vd / ve,
            verdict(vd >= 0.95 * ve),
            100.0 * vd / ver,
            verdict(vd >= 0.95 * ver)
        ));
        sources.push((mib, src, dst));
    }
    let (sweep, sweep_best) = sweep(&plan, &c.pool, &sources, &mut rep)?;
    for &(mib, v, t, k) in &sweep_best {
        let e = rep.get(&format!("e_peak/{mib}MiB")).unwrap_or(f64::NAN);
        targets.push(format!(
            "best of the sweep at {mib} MiB ({t} fill threads, {k} chunks): {v:.1} GB/s = {:.2}×(f), {:.0}% of (e)",
            v / best.1,
            100.0 * v / e
        ));
    }
    targets.insert(0, format!("acquire+release median ≤ 1 µs: {lat_us:.3} µs {}", verdict(lat_us <= 1.0)));
    targets.insert(1, format!("steady-state pinned_alloc_calls = 0: {steady_allocs} {}", verdict(steady_allocs == 0)));
    rep.push(Scenario::new("pool", "steady_state_pinned_allocs", "calls", false, vec![steady_allocs as f64]));

    let mut md = String::new();
    let _ = writeln!(
        md,
        "### Page-in bandwidth, GB/s ({} on {}; median of {} runs after {} warm-up)\n",
        info.kind.name(),
        info.name,
        plan.runs,
        plan.warmup
    );
    let _ = writeln!(
        md,
        "Engine: {} slots, chunks ≤ {} MiB, {} fill threads. (f) is the best of {:?} fill threads under a {} MiB DMA ({} threads).\n",
        cfg.slots,
        cfg.chunk_bytes / MIB,
        cfg.fill_threads,
        plan.ceiling_threads,
        plan.ceiling_dma / MIB,
        best.0
    );
    md.push_str("| size | (a) alloc+free | (b) pooled sync | (c) ours | (d) direct (device time) | (e) pinned peak (device time) | (e') raw from the registered range (device time) | (f) fill ceiling | c/f | c/e | d/e | d/e' |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    md.push_str(&table);
    md.push_str(
        "\n### Direct path: the DMA from registered memory vs what the engine adds\n\n\
         (e')/(e) in device time: registered (cuMemHostRegister) vs cuMemHostAlloc memory, the same copy. \
         (d)/(e') in host wall time: the engine's per-copy cost, alternating run by run with (e').\n\n\
         | size | e'/e, device time | d/e', wall time | engine cost per copy |\n|---|---|---|---|\n",
    );
    md.push_str(&direct_rows);
    let _ = writeln!(md, "\n### Fill rate, pageable → pinned, GB/s ({} MiB)\n", plan.ceiling_fill / MIB);
    let _ = writeln!(
        md,
        "(f') fills the same bytes in {} MiB pieces into {} recycled buffers, as the engine's slots are \
         (recycled destinations may stay partly cached; the big buffer's cannot).\n",
        cfg.chunk_bytes.min(plan.ceiling_fill) / MIB,
        cfg.slots
    );
    md.push_str(
        "| threads | (f) while a DMA runs | (f') into the slots, while a DMA runs | alone | samples where the DMA ended first (dropped) |\n|---|---|---|---|---|\n",
    );
    md.push_str(&ceiling_rows);
    let _ = writeln!(
        md,
        "\n### Tuning sweep: (c) GB/s by fill threads and chunks per page-in ({} slots, chunks ≤ 32 MiB)\n",
        cfg.slots
    );
    md.push_str(&sweep);
    let _ = writeln!(md, "\n### Targets (staging)\n");
    for t in &targets {
        let _ = writeln!(md, "- {t}");
    }
    let st = c.engine.stats();
    let _ = writeln!(
        md,
        "\nEngine counters: copies {}, bypassed {}, chunks {}, fill {:.1} ms, slot waits {:.1} ms, htod {:.1} ms (device), pinned allocs {} / frees {} / reuses {}, max copy {} MiB.",
        st.copies,
        st.bypassed,
        st.chunks,
        st.fill_ms,
        st.slot_wait_ms,
        st.htod_ms,
        st.pinned_alloc_calls,
        st.pinned_free_calls,
        st.pinned_reuses,
        max_size / MIB
    );
    print!("{md}");
    rep.markdown = md;
    if let Some(path) = &args.json {
        rep.write_json(path)
            .map_err(|e| epmem::Error::new(epmem::EpmStatus::OsError, format!("writing {path}: {e}")))?;
    }
    Ok(())
}

/// (d) and (e'), per run: host wall GB/s and device-event GB/s.
struct Direct {
    d: Vec<f64>,
    d_dev: Vec<f64>,
    raw: Vec<f64>,
    raw_dev: Vec<f64>,
}

/// (d) through the engine and (e') as a raw copy from the same registered
/// `src`, alternating (and alternating which goes first) so drift on the
/// machine hits both alike. (e') is timed exactly as (e): timing events
/// around the copy, a fresh completion event, host wait on it. (d)'s device
/// time is the engine's own timing pair, read from its counters after the
/// run (outside the timed span).
fn direct_vs_raw(c: &Ctx, plan: &Plan, n: usize, src: HostRange, dst: &DeviceBuffer) -> Res<Direct> {
    let timing = CopyTiming::new(c.engine.device())?;
    let mut out = Direct { d: Vec::new(), d_dev: Vec::new(), raw: Vec::new(), raw_dev: Vec::new() };
    let direct = |out: &mut Direct, keep: bool| -> Res<()> {
        let before = c.engine.stats();
        let ms = timed(|| {
            let f = c.engine.htod(dst.ptr(), src, None)?;
            epmem::ensure!(f.direct(), Internal, "a registered source was staged");
            f.wait()
        })?;
        let after = c.engine.stats();
        if keep {
            out.d.push(gbps(n as u64, ms));
            if after.timed_copies == before.timed_copies + 1 {
                out.d_dev.push(gbps(n as u64, after.htod_ms - before.htod_ms));
            }
        }
        Ok(())
    };
    let raw = |out: &mut Direct, keep: bool| -> Res<()> {
        let ms = timed(|| {
            let done = Event::new(c.engine.device(), false)?;
            timing.record_start(&c.stream)?;
            witness::enqueue_htod_from_range(&c.stream, dst.ptr(), src, None)?;
            timing.record_end(&c.stream)?;
            done.record(&c.stream)?;
            done.synchronize()
        })?;
        if keep {
            out.raw.push(gbps(n as u64, ms));
            if let Some(dev_ms) = timing.elapsed_ms()? {
                out.raw_dev.push(gbps(n as u64, f64::from(dev_ms)));
            }
        }
        Ok(())
    };
    for i in 0..plan.warmup + plan.runs {
        let keep = i >= plan.warmup;
        if i % 2 == 0 {
            direct(&mut out, keep)?;
            raw(&mut out, keep)?;
        } else {
            raw(&mut out, keep)?;
            direct(&mut out, keep)?;
        }
    }
    Ok(out)
}

/// Microseconds per copy that rate `slow` adds over rate `fast` for `n` bytes.
fn per_copy_us(n: usize, slow: f64, fast: f64) -> f64 {
    (n as f64 / (slow * 1e9) - n as f64 / (fast * 1e9)) * 1e6
}

/// (c) over fill threads × chunks per page-in (chunks up to 32 MiB): the
/// figures that choose the engine's defaults. Returns a markdown table and,
/// per size, the best (GB/s, fill threads, chunks).
fn sweep(
    plan: &Plan,
    pool: &PinnedStagingPool,
    sources: &[(usize, HostRange, DeviceBuffer)],
    rep: &mut Report,
) -> Res<(String, Vec<(usize, f64, usize, usize)>)> {
    let sizes: Vec<_> = sources.iter().filter(|(mib, ..)| plan.sweep_mib.contains(mib)).collect();
    let mut md = String::from("| fill threads | chunks per page-in |");
    for (mib, ..) in &sizes {
        let _ = write!(md, " {mib} MiB |");
    }
    md.push_str("\n|---|---|");
    md.push_str(&"---|".repeat(sizes.len()));
    md.push('\n');
    let mut best: Vec<(usize, f64, usize, usize)> = sizes.iter().map(|(mib, ..)| (*mib, 0.0, 0, 0)).collect();
    for &t in plan.sweep_threads {
        for &k in plan.sweep_chunks {
            let cfg =
                EngineConfig { fill_threads: t, target_chunks: k, chunk_bytes: 32 * MIB, ..EngineConfig::default() };
            let engine = CopyEngine::new(pool, cfg)?;
            let _ = write!(md, "| {t} | {k} |");
            for (i, (mib, src, dst)) in sizes.iter().enumerate() {
                let samples = rate(plan, mib * MIB, || engine.htod(dst.ptr(), *src, None)?.wait())?;
                let name = format!("c_threads{t}/k{k}");
                let v = rep.push(Scenario::new(&format!("sweep_{mib}MiB"), &name, "GB/s", true, samples).at(k as f64));
                let _ = write!(md, " {v:.1} |");
                if v > best[i].1 {
                    best[i] = (*mib, v, t, k);
                }
            }
            md.push('\n');
        }
    }
    Ok((md, best))
}

fn verdict(ok: bool) -> &'static str {
    if ok { "— met" } else { "— **not met**" }
}
