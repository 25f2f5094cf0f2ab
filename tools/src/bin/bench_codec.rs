//! The weight codec, measured and checked in one run:
//!
//! - compressed ÷ raw for bf16 and fp16 tensors of three
//!   distributions (N(0, 0.02), Kaiming-uniform U(±1/64), Student-t(3) × 0.02);
//! - the encoder's rate on the host (raw GB/s, all cores and per core) and the
//!   CPU decoder's;
//! - the device decode (`Device::decode_async`: the codec.ptx kernel on CUDA)
//!   checked bit-exact against the input, every bf16/fp16 bit pattern first,
//!   then timed with events: output GB/s, median of `--runs`, beside a D2D copy
//!   of the same raw size (the device's own copy rate);
//! - exit status 1 on any mismatch, so a script can rely on it.
//!
//!   bench_codec [--quick] [--mib N] [--runs N] [--threads N] [--json PATH] [--dump DIR]
//!
//! `--dump DIR` also writes every case's encoded buffer (`NAME.epmz`) and raw
//! input (`NAME.raw`), names listed in `DIR/cases.txt` in run order: what
//! scripts/codec-kernel-bench.cu decodes with each kernel variant it times.
//!
//! On the H200: `EPM_DEVICE=cuda bench_codec` (scripts/codec-gpu.sh runs it;
//! default 256 MiB outputs). `--quick` (4 MiB, 3 runs) is the CI smoke test on
//! the host device.

use std::sync::Arc;
use std::time::Instant;

use epmem::codec::{self, Dtype, EncodeOptions, Encoded};
use epmem::device::{self, Device, DeviceBuffer, Event, Stream};

const MIB: usize = 1 << 20;

struct Args {
    mib: usize,
    runs: usize,
    threads: usize,
    json: Option<String>,
    dump: Option<String>,
}

fn parse_args() -> Args {
    let mut a = Args { mib: 256, runs: 9, threads: 0, json: None, dump: None };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut num = |name: &str| -> usize {
            it.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
                eprintln!("bench_codec: {name} needs a number");
                std::process::exit(2)
            })
        };
        match arg.as_str() {
            "--quick" => (a.mib, a.runs) = (4, 3),
            "--mib" => a.mib = num("--mib"),
            "--runs" => a.runs = num("--runs"),
            "--threads" => a.threads = num("--threads"),
            "--json" => a.json = Some(it.next().unwrap_or_else(|| fail("--json needs a path".into()))),
            "--dump" => a.dump = Some(it.next().unwrap_or_else(|| fail("--dump needs a directory".into()))),
            other => {
                eprintln!(
                    "bench_codec: unknown argument {other}; usage: bench_codec [--quick] [--mib N] [--runs N] [--threads N] [--json PATH] [--dump DIR]"
                );
                std::process::exit(2)
            }
        }
    }
    a
}

fn normal(rng: &mut fastrand::Rng) -> f64 {
    let (u, v) = (rng.f64().max(1e-300), rng.f64());
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

fn draw(dist: &str, rng: &mut fastrand::Rng) -> f32 {
    (match dist {
        "normal" => 0.02 * normal(rng),
        "kaiming" => (rng.f64() * 2.0 - 1.0) / 64.0,
        _ => {
            let chi2: f64 = (0..3).map(|_| normal(rng).powi(2)).sum();
            0.02 * normal(rng) / (chi2 / 3.0).sqrt()
        }
    }) as f32
}

fn bf16(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

fn fp16(x: f32) -> u16 {
    let sign = ((x.to_bits() >> 16) & 0x8000) as u16;
    let a = x.abs();
    if a >= 65504.0 {
        return sign | 0x7BFF;
    }
    if a < 6.103_515_6e-5 {
        return sign | (a / 5.960_464_5e-8).round() as u16;
    }
    let b = a.to_bits();
    let e = (b >> 23) as i32 - 127 + 15;
    let m = b & 0x7F_FFFF;
    sign | (((e as u32) << 10 | (m >> 13)) + ((m >> 12) & 1)) as u16
}

/// `bytes` of `dtype` values of `dist`, generated on every core.
fn tensor(dist: &str, dtype: Dtype, bytes: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; bytes];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = (bytes / 2).div_ceil(threads) * 2;
    std::thread::scope(|s| {
        for (i, chunk) in out.chunks_mut(per.max(2)).enumerate() {
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(seed * 1000 + i as u64);
                for v in chunk.chunks_exact_mut(2) {
                    let x = draw(dist, &mut rng);
                    v.copy_from_slice(&(if dtype == Dtype::Fp16 { fp16(x) } else { bf16(x) }).to_le_bytes());
                }
            });
        }
    });
    out
}

/// CPU seconds this process has used (all threads): a per-core rate that
/// other load on a shared host does not distort.
fn cpu_seconds() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer for the duration of the call.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn fail(msg: String) -> ! {
    eprintln!("bench_codec: FAIL: {msg}");
    std::process::exit(1)
}

/// Upload `buf`, decode it on the device, compare with `raw`; then time
/// `runs` decodes (and as many D2D copies of the raw size) with events.
/// Returns (decode GB/s, D2D GB/s) of the output bytes, medians.
fn device_decode(dev: &Arc<dyn Device>, s: &Stream, raw: &[u8], buf: &[u8], runs: usize, what: &str) -> (f64, f64) {
    let go = || -> epmem::Result<(f64, f64)> {
        let desc = codec::parse(buf, 0)?;
        let src = DeviceBuffer::new(dev, buf.len())?;
        let dst = DeviceBuffer::new(dev, raw.len())?;
        let copy = DeviceBuffer::new(dev, raw.len())?;
        dev.memset_d8_async(dst.ptr(), 0xA5, raw.len(), s.raw())?;
        // SAFETY: `buf` outlives the copy: the stream is synchronized below.
        unsafe { dev.memcpy_htod_async(src.ptr(), buf.as_ptr(), buf.len(), s.raw())? };
        dev.decode_async(src.ptr(), buf.len(), dst.ptr(), raw.len(), &desc, s.raw())?;
        let mut out = vec![0u8; raw.len()];
        // SAFETY: `out` is untouched until the stream is synchronized.
        unsafe { dev.memcpy_dtoh_async(out.as_mut_ptr(), dst.ptr(), raw.len(), s.raw())? };
        s.synchronize()?;
        if out != raw {
            let i = out.chunks(2).zip(raw.chunks(2)).position(|(a, b)| a != b).unwrap_or(0);
            fail(format!(
                "{what}: device decode differs at value {i}: got {:02x?}, want {:02x?}",
                &out[2 * i..2 * i + 2],
                &raw[2 * i..2 * i + 2]
            ));
        }
        let (a, b) = (Event::new(dev, true)?, Event::new(dev, true)?);
        let time = |f: &dyn Fn() -> epmem::Result<()>| -> epmem::Result<f64> {
            f()?; // warm-up
            let mut v = Vec::with_capacity(runs);
            for _ in 0..runs {
                a.record(s)?;
                f()?;
                b.record(s)?;
                b.synchronize()?;
                v.push(raw.len() as f64 / (b.elapsed_since(&a)? as f64 * 1e6));
            }
            Ok(median(v))
        };
        let dec = time(&|| dev.decode_async(src.ptr(), buf.len(), dst.ptr(), raw.len(), &desc, s.raw()))?;
        let d2d = time(&|| dev.memcpy_dtod_async(copy.ptr(), dst.ptr(), raw.len(), s.raw()))?;
        Ok((dec, d2d))
    };
    go().unwrap_or_else(|e| fail(format!("{what}: {e}")))
}

/// `--dump`: the case's encoded buffer and raw input, and its name appended to cases.txt.
fn dump(dir: Option<&str>, name: &str, raw: &[u8], buf: &[u8]) {
    let Some(dir) = dir else { return };
    let go = || -> std::io::Result<()> {
        use std::io::Write;
        std::fs::create_dir_all(dir)?;
        std::fs::write(format!("{dir}/{name}.epmz"), buf)?;
        std::fs::write(format!("{dir}/{name}.raw"), raw)?;
        let mut list = std::fs::OpenOptions::new().create(true).append(true).open(format!("{dir}/cases.txt"))?;
        writeln!(list, "{name}")
    };
    go().unwrap_or_else(|e| fail(format!("--dump {dir}: {name}: {e}")));
}

fn main() {
    let args = parse_args();
    if let Some(dir) = &args.dump {
        // A fresh list: cases of an earlier run are not this run's.
        let _ = std::fs::remove_file(format!("{dir}/cases.txt"));
    }
    let dev = device::open_from_env(0).unwrap_or_else(|e| fail(format!("opening the device: {e}")));
    let s = Stream::new(&dev).unwrap_or_else(|e| fail(format!("a stream: {e}")));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if args.threads == 0 { cores } else { args.threads };
    println!(
        "bench_codec on {} ({} host cores, encoder threads {threads}), {} MiB per tensor, {} runs",
        dev.info().name,
        cores,
        args.mib,
        args.runs
    );

    // Every bit pattern, every code width: bit-exact through the device.
    let all: Vec<u8> = (0..=u16::MAX).flat_map(|v| v.to_le_bytes()).collect();
    for dtype in [Dtype::Bf16, Dtype::Fp16] {
        for k in 1..=4 {
            // k2 = 0: format v1; 1..=4: format v2 with that escape code width.
            for k2 in 0..=4 {
                let opts = EncodeOptions { threads, max_ratio: 1e9, min_bytes: 0, k: Some(k), k2: Some(k2) };
                let Ok(Encoded::Coded(buf)) = codec::encode(&all, dtype, &opts) else {
                    fail(format!("encoding all {} patterns", dtype.name()))
                };
                device_decode(&dev, &s, &all, &buf, 1, &format!("all {} patterns, k={k}, k2={k2}", dtype.name()));
                let name = if k2 == 0 {
                    format!("all-{}-k{k}", dtype.name())
                } else {
                    format!("all-{}-k{k}-v2k{k2}", dtype.name())
                };
                dump(args.dump.as_deref(), &name, &all, &buf);
            }
        }
    }
    println!(
        "all 65536 bf16 and fp16 bit patterns, k=1..4, format v1 and v2 with k2=1..4: bit-exact through decode_async"
    );
    // A length that ends in a partial block and a partial 16-value slice.
    const ODD: usize = 1_000_003;
    for dtype in [Dtype::Bf16, Dtype::Fp16] {
        let raw = tensor("normal", dtype, 2 * ODD, 5);
        let opts = EncodeOptions { threads, max_ratio: 1e9, min_bytes: 0, k: None, k2: None };
        let Ok(Encoded::Coded(buf)) = codec::encode(&raw, dtype, &opts) else {
            fail(format!("encoding {ODD} {} values", dtype.name()))
        };
        device_decode(&dev, &s, &raw, &buf, 1, &format!("{ODD} normal {} values", dtype.name()));
        dump(args.dump.as_deref(), &format!("odd-normal-{}", dtype.name()), &raw, &buf);
    }
    println!("{ODD} normal bf16 and fp16 values (a partial last block): bit-exact through decode_async");

    println!();
    println!(
        "| tensor | dtype | ratio | v | k | k2 | escapes | encode GB/s (per CPU-second) | CPU decode GB/s (per CPU-second) | device decode GB/s | device D2D GB/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let bytes = args.mib * MIB;
    let mut rows = Vec::new();
    for (i, dist) in ["normal", "kaiming", "student_t3"].into_iter().enumerate() {
        for dtype in [Dtype::Bf16, Dtype::Fp16] {
            let raw = tensor(dist, dtype, bytes, 7 + i as u64);
            let opts = EncodeOptions { threads, max_ratio: 1.0, ..Default::default() };
            let (t, cpu) = (Instant::now(), cpu_seconds());
            let enc = codec::encode(&raw, dtype, &opts).unwrap_or_else(|e| fail(format!("encode {dist}: {e}")));
            let (enc_s, enc_cpu) = (t.elapsed().as_secs_f64(), cpu_seconds() - cpu);
            let Encoded::Coded(buf) = enc else { fail(format!("{dist} {}: kept raw: {enc:?}", dtype.name())) };
            let desc = codec::parse(&buf, threads).unwrap_or_else(|e| fail(format!("{dist}: {e}")));
            let mut out = vec![0u8; raw.len()];
            let (t, cpu) = (Instant::now(), cpu_seconds());
            codec::decode_with(&desc, &buf, &mut out, threads).unwrap_or_else(|e| fail(format!("{dist}: {e}")));
            let (dec_s, dec_cpu) = (t.elapsed().as_secs_f64(), cpu_seconds() - cpu);
            if out != raw {
                fail(format!("{dist} {}: CPU decode differs", dtype.name()));
            }
            let what = format!("{dist} {}", dtype.name());
            let (gpu, d2d) = device_decode(&dev, &s, &raw, &buf, args.runs, &what);
            dump(args.dump.as_deref(), &format!("{dist}-{}", dtype.name()), &raw, &buf);
            let enc_gbps = raw.len() as f64 / enc_s / 1e9;
            rows.push(serde_json::json!({
                "tensor": dist, "dtype": dtype.name(), "raw_bytes": raw.len(), "compressed_bytes": buf.len(),
                "ratio": desc.ratio(), "format_version": desc.version(), "k": desc.k(), "k2": desc.k2(),
                "escapes": desc.escapes(), "escapes3": desc.escapes3(),
                "encode_gbps": enc_gbps, "encode_threads": threads, "encode_gbps_per_cpu_second": raw.len() as f64 / enc_cpu / 1e9,
                "cpu_decode_gbps": raw.len() as f64 / dec_s / 1e9, "cpu_decode_gbps_per_cpu_second": raw.len() as f64 / dec_cpu / 1e9,
                "device_decode_gbps": gpu, "device_d2d_gbps": d2d, "bit_exact": true,
            }));
            println!(
                "| {dist} | {} | {:.4} | {} | {} | {} | {:.2}% | {:.2} ({:.2}) | {:.2} ({:.2}) | {:.1} | {:.1} |",
                dtype.name(),
                desc.ratio(),
                desc.version(),
                desc.k(),
                desc.k2(),
                100.0 * desc.escapes() as f64 / desc.values() as f64,
                enc_gbps,
                raw.len() as f64 / enc_cpu / 1e9,
                raw.len() as f64 / dec_s / 1e9,
                raw.len() as f64 / dec_cpu / 1e9,
                gpu,
                d2d
            );
        }
    }
    println!();
    println!("ratio = compressed bytes / raw bytes (header and index included); GB/s of raw (decoded) bytes;");
    println!("per CPU-second = raw bytes / CPU time of all threads, the per-core rate whatever else runs on the host.");
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "bench": "bench_codec", "device": dev.info().name, "kind": dev.info().kind.name(),
            "mib": args.mib, "runs": args.runs, "host_cores": cores, "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap_or_default())
            .unwrap_or_else(|e| fail(format!("writing {path}: {e}")));
    }
    println!("bench_codec: all checks passed");
}
