//! bench_kv: the KV pool against the VMM driver floor, and what prefix
//! sharing saves.
//!
//!   EPM_DEVICE=cuda bench_kv [--json PATH] [--runs N]   # on the H200
//!   bench_kv --quick                                     # small sizes (CI smoke on the host device)
//!
//! Part 1, per granule, medians after a warm-up: the driver floor (create,
//! map, set access RW/RO, unmap, release, one granule D2D copy) through the
//! Device trait, next to our commit_shared_prefix, prepare_append and
//! copy-on-write at the same sizes. Targets: ≤ 10% over the floor, COW ≤ 200 µs.
//! Part 2: physical bytes saved and admissible concurrency for 512/2,048/8,192
//! token prefixes × 2/4/8/16 sharers on qwen14b- and qwen2.5-0.5b-shaped
//! layouts, from the ledger and from the driver's free memory, next to the
//! arithmetic.
//! Part 3: a batch of 8/32/128 slots, one prompt pinned from slot 0
//! and mapped into the others, against every slot holding a private copy —
//! bytes from the ledger and from the driver's free memory.

use std::sync::Arc;
use std::time::Instant;

use epmem::device::{self, Access, Device, DeviceBuffer, Stream};
use epmem::kv::{AdmitMode, KvConfig, KvLayout, KvPool, KvShape, SlotChoice, admissible, request_cost};
use epmem_tools::bench::{BenchArgs, Report, Scenario, median, repeat};

const MIB: f64 = 1024.0 * 1024.0;
const GIB: u64 = 1 << 30;

fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

fn layouts() -> [(&'static str, KvLayout); 2] {
    let s14 = KvShape { layers: 48, kv_heads: 8, head_dim: 128, elem_bytes: 2 };
    let s05 = KvShape { layers: 24, kv_heads: 2, head_dim: 64, elem_bytes: 2 };
    [("qwen14b", KvLayout::token_major(s14).unwrap()), ("qwen2.5-0.5b", KvLayout::token_major(s05).unwrap())]
}

/// Per-granule medians of the raw driver calls for `k` granules.
struct Floor {
    create: f64,
    map: f64,
    set_rw: f64,
    set_ro: f64,
    unmap: f64,
    release: f64,
    copy: f64,
    /// One VA reservation of k granules (per call, not per granule).
    reserve: f64,
}

fn floor(dev: &Arc<dyn Device>, k: usize, warmup: usize, runs: usize) -> Floor {
    let g = dev.vmm_granularity();
    let s = Stream::new(dev).unwrap();
    let src = DeviceBuffer::new(dev, g).unwrap();
    let mut cols: [Vec<f64>; 8] = Default::default();
    for run in 0..warmup + runs {
        let mut t = [0f64; 8];
        let t0 = Instant::now();
        let va = dev.vmm_reserve(k * g, 0).unwrap();
        t[7] = us(t0) * k as f64;
        let mut hs = Vec::with_capacity(k);
        for _ in 0..k {
            let t0 = Instant::now();
            hs.push(dev.vmm_create(g).unwrap());
            t[0] += us(t0);
        }
        for (i, &h) in hs.iter().enumerate() {
            let at = va + (i * g) as u64;
            let t0 = Instant::now();
            dev.vmm_map(at, g, h, 0).unwrap();
            t[1] += us(t0);
            let t0 = Instant::now();
            dev.vmm_set_access(at, g, Access::ReadWrite).unwrap();
            t[2] += us(t0);
        }
        let t0 = Instant::now();
        dev.memcpy_dtod_async(va, src.ptr(), g, s.raw()).unwrap();
        s.synchronize().unwrap();
        t[6] = us(t0) * k as f64;
        for i in 0..k {
            let t0 = Instant::now();
            dev.vmm_set_access(va + (i * g) as u64, g, Access::ReadOnly).unwrap();
            t[3] += us(t0);
        }
        for i in 0..k {
            let t0 = Instant::now();
            dev.vmm_unmap(va + (i * g) as u64, g).unwrap();
            t[4] += us(t0);
        }
        for h in hs {
            let t0 = Instant::now();
            dev.vmm_release(h).unwrap();
            t[5] += us(t0);
        }
        dev.vmm_free_va(va, k * g).unwrap();
        if run >= warmup {
            for (c, v) in cols.iter_mut().zip(t) {
                c.push(v / k as f64);
            }
        }
    }
    let m: Vec<f64> = cols.iter().map(|c| median(c)).collect();
    Floor { create: m[0], map: m[1], set_rw: m[2], set_ro: m[3], unmap: m[4], release: m[5], copy: m[6], reserve: m[7] }
}

/// Per-granule medians of ours for `k` granules: (commit, append, cow).
fn ours(dev: &Arc<dyn Device>, l: &KvLayout, k: u64, warmup: usize, runs: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let g = dev.vmm_granularity() as u64;
    let s = Stream::new(dev).unwrap();
    // n tokens whose bytes end inside granule k: exactly k slots.
    let n = k * g / l.bytes_per_token();
    let mut a = KvPool::new(dev, KvConfig::new(64 * GIB)).unwrap();
    let o = a.create_sequence(l, n + 1, AdmitMode::OnDemand).unwrap();
    a.prepare_append(o, n, s.raw()).unwrap();
    let p = a.pin_prefix(o, n, s.raw()).unwrap();
    let commit = repeat(warmup, runs, || {
        let t0 = Instant::now();
        let q = a.commit_shared_prefix(p, n, n, AdmitMode::OnDemand).unwrap();
        let t = us(t0);
        a.destroy_sequence(q).unwrap();
        t / k as f64
    });
    let append = repeat(warmup, runs, || {
        let q = a.create_sequence(l, n, AdmitMode::OnDemand).unwrap();
        let t0 = Instant::now();
        a.prepare_append(q, n, s.raw()).unwrap();
        let t = us(t0);
        a.destroy_sequence(q).unwrap();
        t / k as f64
    });
    // One boundary granule per sharer; timed to the copy's completion.
    let cow = repeat(warmup, runs, || {
        let q = a.commit_shared_prefix(p, n, n + 1, AdmitMode::OnDemand).unwrap();
        let t0 = Instant::now();
        a.prepare_append(q, 1, s.raw()).unwrap();
        s.synchronize().unwrap();
        let t = us(t0);
        a.destroy_sequence(q).unwrap();
        t
    });
    (commit, append, cow)
}

fn part1(dev: &Arc<dyn Device>, r: &mut Report, quick: bool, warmup: usize, runs: usize) {
    let l = layouts()[0].1;
    let sizes: &[u64] = if quick { &[1, 4] } else { &[1, 16, 64, 192] };
    let md = &mut r.markdown;
    md.push_str("### Per granule: driver floor vs ours (µs, medians)\n\n");
    md.push_str("| granules | create | map | set RW | set RO | unmap | release | D2D copy | reserve VA (per call) | commit floor (reserve/k+map+RO) | ours commit_shared_prefix | append floor (unmap+map+RW) | ours prepare_append | COW floor (unmap+map+RW+copy) | ours COW |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    let mut rows = Vec::new();
    for &k in sizes {
        let f = floor(dev, k as usize, warmup, runs);
        let (c, a, w) = ours(dev, &l, k, warmup, runs);
        // A new sequence cannot map without its VA: the commit floor includes one reservation.
        let fc = f.reserve / k as f64 + f.map + f.set_ro;
        let fa = f.unmap + f.map + f.set_rw;
        let fw = fa + f.copy;
        let (oc, oa, ow) = (median(&c), median(&a), median(&w));
        md.push_str(&format!(
            "| {k} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {fc:.1} | {oc:.1} ({:+.0}%) | {fa:.1} | {oa:.1} ({:+.0}%) | {fw:.1} | {ow:.1} |\n",
            f.create, f.map, f.set_rw, f.set_ro, f.unmap, f.release, f.copy, f.reserve,
            (oc / fc - 1.0) * 100.0, (oa / fa - 1.0) * 100.0
        ));
        let x = k as f64;
        for (name, v) in [
            ("floor_create", f.create),
            ("floor_map", f.map),
            ("floor_set_rw", f.set_rw),
            ("floor_set_ro", f.set_ro),
            ("floor_unmap", f.unmap),
            ("floor_release", f.release),
            ("floor_copy", f.copy),
            ("floor_reserve", f.reserve),
        ] {
            r.scenarios.push(Scenario::new("floor", &format!("{name}/{k}"), "us/granule", false, vec![v]).at(x));
        }
        r.scenarios.push(Scenario::new("commit", &format!("ours_commit/{k}"), "us/granule", false, c).at(x));
        r.scenarios.push(Scenario::new("append", &format!("ours_append/{k}"), "us/granule", false, a).at(x));
        r.scenarios.push(Scenario::new("cow", &format!("ours_cow/{k}"), "us", false, w).at(x));
        rows.push((k, oc / fc - 1.0, oa / fa - 1.0, ow));
    }
    let md = &mut r.markdown;
    md.push('\n');
    for (k, c, a, w) in rows {
        let verdict = |ok: bool| if ok { "PASS" } else { "MISS" };
        md.push_str(&format!(
            "- target {k} granules: commit overhead {:+.1}% ({}), append overhead {:+.1}% ({}), COW {w:.0} µs per boundary granule ({})\n",
            c * 100.0, verdict(c <= 0.10), a * 100.0, verdict(a <= 0.10), verdict(w <= 200.0)
        ));
    }
    md.push('\n');
}

/// Owned bytes (ledger, dummy excluded) and driver-visible bytes of `sharers`
/// sequences holding `prefix` tokens, shared or not.
fn footprint(dev: &Arc<dyn Device>, l: &KvLayout, prefix: u64, sharers: u64, share: bool) -> (u64, i64) {
    let s = Stream::new(dev).unwrap();
    let g = dev.vmm_granularity() as u64;
    let mut a = KvPool::new(dev, KvConfig::new(u64::MAX / 4)).unwrap();
    let free0 = dev.mem_get_info().map_or(0, |m| m.0) as i64;
    let o = a.create_sequence(l, prefix, AdmitMode::OnDemand).unwrap();
    a.prepare_append(o, prefix, s.raw()).unwrap();
    if share {
        let p = a.pin_prefix(o, prefix, s.raw()).unwrap();
        for _ in 1..sharers {
            a.commit_shared_prefix(p, prefix, prefix, AdmitMode::OnDemand).unwrap();
        }
    } else {
        for _ in 1..sharers {
            let q = a.create_sequence(l, prefix, AdmitMode::OnDemand).unwrap();
            a.prepare_append(q, prefix, s.raw()).unwrap();
        }
    }
    let free1 = dev.mem_get_info().map_or(0, |m| m.0) as i64;
    (a.stats().ledger.owned_bytes - g, free0 - free1)
}

/// Requests admitted (Reserve) until the ledger refuses.
fn admit_count(dev: &Arc<dyn Device>, l: &KvLayout, budget: u64, prefix: u64, total: u64, share: bool) -> u64 {
    let s = Stream::new(dev).unwrap();
    let g = dev.vmm_granularity() as u64;
    // The dummy granule is the arena's, not a request's: add it on top.
    let mut a = KvPool::new(dev, KvConfig::new(budget + g)).unwrap();
    let Ok(o) = a.create_sequence(l, total, AdmitMode::Promise) else { return 0 };
    a.prepare_append(o, prefix, s.raw()).unwrap();
    let p = a.pin_prefix(o, prefix, s.raw()).unwrap();
    let mut n = 1;
    loop {
        let r = if share {
            a.commit_shared_prefix(p, prefix, total, AdmitMode::Promise)
        } else {
            a.create_sequence(l, total, AdmitMode::Promise)
        };
        match r {
            Ok(_) => n += 1,
            Err(_) => return n,
        }
    }
}

fn part2(dev: &Arc<dyn Device>, r: &mut Report, quick: bool) {
    let g = dev.vmm_granularity() as u64;
    let prefixes: &[u64] = if quick { &[512] } else { &[512, 2048, 8192] };
    let sharers: &[u64] = if quick { &[2, 4] } else { &[2, 4, 8, 16] };
    let models = layouts();
    let models = if quick { &models[1..] } else { &models[..] };
    r.markdown.push_str("### Physical bytes saved by sharing a prefix (MiB)\n\n| layout | prefix tokens | sharers | arithmetic | ledger | driver free memory |\n|---|---|---|---|---|---|\n");
    for (name, l) in models {
        for &pt in prefixes {
            let cost = request_cost(l, g, pt, pt);
            for &n in sharers {
                let arith = (n - 1) * cost.prefix_bytes;
                let (own_u, drv_u) = footprint(dev, l, pt, n, false);
                let (own_s, drv_s) = footprint(dev, l, pt, n, true);
                let (led, drv) = ((own_u - own_s) as f64 / MIB, (drv_u - drv_s) as f64 / MIB);
                r.markdown
                    .push_str(&format!("| {name} | {pt} | {n} | {:.0} | {led:.0} | {drv:.0} |\n", arith as f64 / MIB));
                let sc =
                    Scenario::new("saved", &format!("saved_mib/{name}/{pt}/{n}"), "MiB", true, vec![led]).at(n as f64);
                r.scenarios.push(sc);
                r.scenarios.push(
                    Scenario::new("saved", &format!("saved_driver_mib/{name}/{pt}/{n}"), "MiB", true, vec![drv])
                        .at(n as f64),
                );
            }
        }
    }
    r.markdown.push_str("\nExpected: qwen14b, 2,048 tokens, 8 sharers: 7 × 384 MiB = 2,688 MiB saved.\n\n");
    r.markdown.push_str("### Admissible concurrency, 50/50 prefix/private split, budget = 4 unshared requests\n\n| layout | prefix tokens | budget (MiB) | unshared: arithmetic / ledger | shared: arithmetic / ledger | shorthand 1+⌊(B−P)/Q⌋ |\n|---|---|---|---|---|---|\n");
    for (name, l) in models {
        for &pt in prefixes {
            let c = request_cost(l, g, pt, 2 * pt);
            let budget = 4 * c.unshared_bytes;
            let ar = admissible(budget, c.prefix_bytes, c.private_bytes);
            let (mu, ms) =
                (admit_count(dev, l, budget, pt, 2 * pt, false), admit_count(dev, l, budget, pt, 2 * pt, true));
            r.markdown.push_str(&format!(
                "| {name} | {pt} | {:.0} | {} / {mu} | {} / {ms} | {} |\n",
                budget as f64 / MIB,
                ar.without_sharing,
                ar.with_sharing,
                ar.over_admitting_formula
            ));
            r.scenarios.push(
                Scenario::new("admission", &format!("admitted_shared/{name}/{pt}"), "requests", true, vec![ms as f64])
                    .at(pt as f64),
            );
            r.scenarios.push(
                Scenario::new(
                    "admission",
                    &format!("admitted_unshared/{name}/{pt}"),
                    "requests",
                    true,
                    vec![mu as f64],
                )
                .at(pt as f64),
            );
        }
    }
    if !quick {
        // The reference cell: qwen14b, 3.0 GiB budget, 2,048 shared + 2,048 private tokens.
        let l = layouts()[0].1;
        let (mu, ms) =
            (admit_count(dev, &l, 3 * GIB, 2048, 4096, false), admit_count(dev, &l, 3 * GIB, 2048, 4096, true));
        r.markdown.push_str(&format!(
            "\nExpected by the shorthand: 3.0 GiB budget, 50/50 split: 4 → 8 requests. Measured on the ledger (qwen14b, 2,048 + 2,048 tokens): {mu} → {ms}. \
             The 8 comes from 1 + ⌊(B − P)/Q⌋, which counts one request more than fits (P + 8Q = 3.375 GiB).\n"
        ));
        r.scenarios.push(Scenario::new("admission", "seed_cell_shared", "requests", true, vec![ms as f64]));
    }
}

/// Owned bytes (ledger, dummy excluded) and driver-visible bytes of a batch of
/// `slots` slots each holding `prefix` tokens: mapped from one pinned copy
/// (`share`) or each its own.
fn batch_footprint(dev: &Arc<dyn Device>, l: &KvLayout, prefix: u64, slots: u32, share: bool) -> (u64, i64) {
    let s = Stream::new(dev).unwrap();
    let g = dev.vmm_granularity() as u64;
    let mut a = KvPool::new(dev, KvConfig::new(u64::MAX / 4)).unwrap();
    let free0 = dev.mem_get_info().map_or(0, |m| m.0) as i64;
    let b = a.create_batch(l, prefix, slots).unwrap();
    let o = a.take_slot(b, SlotChoice::Any, AdmitMode::OnDemand).unwrap();
    a.prepare_append(o, prefix, s.raw()).unwrap();
    let p = share.then(|| a.pin_prefix(o, prefix, s.raw()).unwrap());
    for _ in 1..slots {
        match p {
            Some(p) => {
                a.take_shared_slot(b, SlotChoice::Any, p, prefix, AdmitMode::OnDemand, s.raw()).unwrap();
            }
            None => {
                let q = a.take_slot(b, SlotChoice::Any, AdmitMode::OnDemand).unwrap();
                a.prepare_append(q, prefix, s.raw()).unwrap();
            }
        }
    }
    let free1 = dev.mem_get_info().map_or(0, |m| m.0) as i64;
    (a.stats().ledger.owned_bytes - g, free0 - free1)
}

fn part3(dev: &Arc<dyn Device>, r: &mut Report, quick: bool) {
    let g = dev.vmm_granularity() as u64;
    let models = layouts();
    let (name, l, prefix) = if quick { (models[1].0, models[1].1, 512) } else { (models[0].0, models[0].1, 2048) };
    let slot_counts: &[u32] = if quick { &[8] } else { &[8, 32, 128] };
    let driver = dev.info().kind == device::DeviceKind::Cuda;
    r.markdown.push_str(&format!(
        "\n### Batch of slots sharing one {prefix}-token prompt ({name}), MiB\n\n\
         | slots | private copies: ledger | shared: ledger | saved: arithmetic | saved: ledger | saved: driver free memory |\n|---|---|---|---|---|---|\n"
    ));
    for &n in slot_counts {
        let p = request_cost(&l, g, prefix, prefix).prefix_bytes;
        let (own_u, drv_u) = batch_footprint(dev, &l, prefix, n, false);
        let (own_s, drv_s) = batch_footprint(dev, &l, prefix, n, true);
        let led = (own_u - own_s) as f64 / MIB;
        // The host device's free memory is the machine's RAM, which other
        // processes move: only the driver's figure on CUDA means anything.
        let drv = if driver { format!("{:.0}", (drv_u - drv_s) as f64 / MIB) } else { "n/a (host)".into() };
        r.markdown.push_str(&format!(
            "| {n} | {:.0} | {:.0} | {:.0} | {led:.0} | {drv} |\n",
            own_u as f64 / MIB,
            own_s as f64 / MIB,
            (n as u64 - 1) as f64 * p as f64 / MIB
        ));
        r.scenarios.push(
            Scenario::new("batch_saved", &format!("batch_saved_mib/{name}/{prefix}/{n}"), "MiB", true, vec![led])
                .at(n as f64),
        );
        if driver {
            r.scenarios.push(
                Scenario::new(
                    "batch_saved",
                    &format!("batch_saved_driver_mib/{name}/{prefix}/{n}"),
                    "MiB",
                    true,
                    vec![(drv_u - drv_s) as f64 / MIB],
                )
                .at(n as f64),
            );
        }
    }
    r.markdown.push('\n');
}

fn main() {
    let args = BenchArgs::parse();
    // --quick only shrinks the sizes: in CI (no GPU) EPM_DEVICE=auto is the host device.
    let dev = match device::open_from_env(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("bench_kv: no device: {e}");
            std::process::exit(2);
        }
    };
    let (warmup, runs) = if args.quick { (1, 3) } else { (3, args.runs.unwrap_or(15)) };
    let info = dev.info().clone();
    let mut r = Report::new("kv", &info.name, info.kind.name(), runs, warmup);
    r.markdown.push_str(&format!("## bench_kv on {} (granule {} KiB)\n\n", info.name, info.granularity / 1024));
    part1(&dev, &mut r, args.quick, warmup, runs);
    part2(&dev, &mut r, args.quick);
    part3(&dev, &mut r, args.quick);
    print!("{}", r.markdown);
    if let Some(p) = &args.json {
        if let Err(e) = r.write_json(p) {
            eprintln!("bench_kv: writing {p}: {e}");
            std::process::exit(1);
        }
    }
}
