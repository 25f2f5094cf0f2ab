//! Two devices streaming weights at once from one registered host copy:
//! the aggregate page-in rate against twice the
//! single-device rate, and the host's memory-copy rate that caps both.
//!
//! One host buffer of `layers` weights is page-locked once
//! (`SharedHostRegistration`, PORTABLE on CUDA) through device 0; a residency
//! manager on each device attaches it, with a budget of a few layers, so
//! nearly every acquire of a decode step pages a layer in (direct DMA from
//! the shared bytes, no staging). Rates are the managers' `htod_bytes` over
//! host wall time of whole decode steps (synchronized), i.e. what a caller
//! waits for. Rows:
//!
//! - `single/dev0`, `single/dev1`: one device streams, the other idles;
//! - `both/aggregate`: both stream at once (two threads, one barrier);
//! - `both/vs_2x_single`: aggregate / (single/dev0 + single/dev1), i.e.
//!   against twice the single-GPU figure for two alike GPUs — 1.0 means the
//!   second GPU's stream costs the first nothing; below it, a shared cap
//!   (host memory or the PCIe root complex) is reached;
//! - `host/memcpy_read`: a multi-threaded host memcpy of the same buffer
//!   (bytes read per second), the host-memory ceiling both DMAs share.
//!
//! It also checks the "no second registration" claim on every run:
//! device 1's `host_register_calls` stays put and no page-in is staged.
//!
//!   bench_multi [--quick] [--runs N] [--json PATH]
//!
//! EPM_DEVICE=cuda needs two GPUs; with one it prints "not run: 1 GPU",
//! writes a JSON report with no scenarios, and exits 0. On the host device
//! the two devices are two host-device instances (the CI smoke test runs
//! `--quick` there; its figures mean nothing).
//!
//! Arguments, medians and the JSON report are the shared ones of
//! `epmem_tools::bench`, as in every other bench.

use std::fmt::Write as _;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use epmem::EpmStatus;
use epmem::device::{self, Device, DeviceKind, DeviceSelect, HostRange, Stream};
use epmem::residency::{ResidencyConfig, ResidencyManager, WeightId};
use epmem::transfer::pinning::SharedHostRegistration;
use epmem_tools::bench::{self, BenchArgs, Report, Scenario};

const MIB: usize = 1 << 20;

fn fail(msg: String) -> ! {
    eprintln!("bench_multi: {msg}");
    std::process::exit(1)
}

struct Side {
    m: ResidencyManager,
    ids: Vec<WeightId>,
    stream: Stream,
}

impl Side {
    /// Run `steps` decode steps; bytes paged in and wall seconds.
    fn steps(&self, steps: usize) -> (u64, f64) {
        let before = self.m.stats().htod_bytes;
        let t = Instant::now();
        for _ in 0..steps {
            for &w in &self.ids {
                self.m.acquire(w, self.stream.raw()).unwrap_or_else(|e| fail(format!("acquire: {e}")));
                self.m.release(w, self.stream.raw()).unwrap_or_else(|e| fail(format!("release: {e}")));
            }
        }
        self.stream.synchronize().unwrap_or_else(|e| fail(format!("synchronize: {e}")));
        self.m.synchronize().unwrap_or_else(|e| fail(format!("synchronize: {e}")));
        (self.m.stats().htod_bytes - before, t.elapsed().as_secs_f64())
    }
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bench::gbps(bytes, secs * 1e3)
}

/// Write the report as JSON where `--json` asked for it.
fn write(a: &BenchArgs, r: &Report) {
    if let Some(p) = &a.json {
        r.write_json(p).unwrap_or_else(|e| fail(format!("{p}: {e}")));
    }
}

fn main() {
    let a = BenchArgs::parse();
    let (layer_mib, layers, resident, steps, runs) =
        if a.quick { (2, 8, 2, 2, a.runs.unwrap_or(2)) } else { (64, 32, 4, 3, a.runs.unwrap_or(5)) };
    let d0 = device::open_from_env(0).unwrap_or_else(|e| fail(format!("open device 0: {e}")));
    let kind = d0.info().kind;
    let select = if kind == DeviceKind::Cuda { DeviceSelect::Cuda } else { DeviceSelect::Host };
    let d1 = match device::open(select, 1) {
        Ok(d) => d,
        Err(e) if e.status() == EpmStatus::DeviceUnavailable => {
            let md = format!("not run: 1 GPU ({})\n", e.message());
            print!("{md}");
            let mut r = Report::new("bench_multi", &d0.info().name, kind.name(), 0, 1);
            r.markdown = md;
            write(&a, &r);
            return;
        }
        Err(e) => fail(format!("open device 1: {e}")),
    };

    let layer = layer_mib * MIB;
    let total = layer * layers;
    // Page-aligned pageable buffer, touched so it is backed before registering.
    let mut buf = vec![0u8; total + 4096];
    for (i, b) in buf.iter_mut().enumerate().step_by(4096) {
        *b = i as u8 | 1;
    }
    let base = buf.as_ptr().align_offset(4096);
    // SAFETY: inside `buf`, which lives (unmodified) until the end of main,
    // after every manager and the registration are gone (dropped in order below).
    let whole = unsafe { HostRange::new(buf.as_ptr().add(base), total) };
    let calls1 = d1.driver_counts().host_register_calls;
    let t = Instant::now();
    let reg = SharedHostRegistration::new(&d0, whole).unwrap_or_else(|e| fail(format!("register {total} B: {e}")));
    let reg_ms = t.elapsed().as_secs_f64() * 1e3;

    let side = |dev: &Arc<dyn Device>| -> Side {
        let mut c = ResidencyConfig::with_budget(resident * layer);
        c.coalesce_below_bytes = 0;
        let m = ResidencyManager::new(dev, c).unwrap_or_else(|e| fail(format!("manager: {e}")));
        m.attach_host_registration(&reg).unwrap_or_else(|e| fail(format!("attach: {e}")));
        let ids: Vec<WeightId> = (0..layers)
            // SAFETY: a sub-range of `whole` (see above).
            .map(|i| m.register(unsafe { HostRange::new(whole.ptr().add(i * layer), layer) }).unwrap())
            .collect();
        m.declare_cycle(&ids).unwrap_or_else(|e| fail(format!("declare_cycle: {e}")));
        Side { stream: Stream::new(dev).unwrap(), m, ids }
    };
    let (s0, s1) = (side(&d0), side(&d1));
    // Warm-up: arenas committed, plans made, first page-ins done.
    s0.steps(1);
    s1.steps(1);

    let (mut one0, mut one1, mut agg, mut ratio, mut host) = (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..runs {
        let (b, t) = s0.steps(steps);
        one0.push(gbps(b, t));
        let (b, t) = s1.steps(steps);
        one1.push(gbps(b, t));
        let bar = Barrier::new(2);
        let t = Instant::now();
        let (b0, b1) = std::thread::scope(|sc| {
            let h0 = sc.spawn(|| {
                bar.wait();
                s0.steps(steps).0
            });
            let h1 = sc.spawn(|| {
                bar.wait();
                s1.steps(steps).0
            });
            (h0.join().unwrap(), h1.join().unwrap())
        });
        let g = gbps(b0 + b1, t.elapsed().as_secs_f64());
        agg.push(g);
        // Twice the single-GPU figure, from this run's own singles (two alike
        // GPUs give ~2x either; the sum is robust to one slightly slower link).
        ratio.push(g / (one0.last().copied().unwrap_or(f64::NAN) + one1.last().copied().unwrap_or(f64::NAN)));
        host.push(host_memcpy_gbps(&buf[base..base + total]));
    }

    // The claim under test, checked every run rather than assumed.
    let (st0, st1) = (s0.m.stats(), s1.m.stats());
    if st0.staged_page_ins + st1.staged_page_ins > 0 || d1.driver_counts().host_register_calls != calls1 {
        fail(format!(
            "a second registration or a staged copy: staged {}+{}, device 1 host_register_calls +{}",
            st0.staged_page_ins,
            st1.staged_page_ins,
            d1.driver_counts().host_register_calls - calls1
        ));
    }
    let device = format!("{} + {}", d0.info().name, d1.info().name);
    let mut r = Report::new("bench_multi", &device, kind.name(), runs, 1);
    for s in [
        Scenario::new("single", "single/dev0", "GB/s", true, one0),
        Scenario::new("single", "single/dev1", "GB/s", true, one1),
        Scenario::new("both", "both/aggregate", "GB/s", true, agg),
        Scenario::new("both", "both/vs_2x_single", "x", true, ratio),
        Scenario::new("host", "host/memcpy_read", "GB/s", true, host),
    ] {
        r.push(s);
    }
    let mut md = String::new();
    let _ = writeln!(
        md,
        "### bench_multi: {} + {} ({}), {layers} x {layer_mib} MiB layers, {resident} resident per device, one registration ({reg_ms:.0} ms)\n",
        d0.info().name,
        d1.info().name,
        kind.name()
    );
    let _ = writeln!(md, "| scenario | median | unit |\n|---|---|---|");
    for s in &r.scenarios {
        let _ = writeln!(md, "| {} | {:.3} | {} |", s.name, s.value(), s.unit);
    }
    let _ = writeln!(
        md,
        "\ndevice 1: host_register_calls +0, staged page-ins 0 (page-ins {} / {}); \
         target: both/vs_2x_single near 1.0 unless host/memcpy_read caps it",
        st0.page_ins, st1.page_ins
    );
    print!("{md}");
    r.markdown = md;
    write(&a, &r);
    drop((s0, s1, reg));
    drop(buf);
}

/// Host memory read rate of `src`: 8 threads memcpy their share into
/// buffers of their own (each byte read once, written once).
fn host_memcpy_gbps(src: &[u8]) -> f64 {
    let threads = 8.min(src.len() / MIB).max(1);
    let part = src.len() / threads;
    let mut dst: Vec<Vec<u8>> = (0..threads).map(|_| vec![1u8; part]).collect();
    let t = Instant::now();
    std::thread::scope(|s| {
        for (i, d) in dst.iter_mut().enumerate() {
            let chunk = &src[i * part..(i + 1) * part];
            s.spawn(move || d.copy_from_slice(chunk));
        }
    });
    let secs = t.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    (part * threads) as f64 / secs / 1e9
}
