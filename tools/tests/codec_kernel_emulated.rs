//! The decode kernel (src/device/cuda/codec.cu) run on the CPU by
//! tools/codec-emu/emulate.cpp (a thread per CUDA thread, barriers for
//! __syncthreads and warp shuffles), bit-exact against the encoder's input:
//! the kernel's indexing, escape scans and partial blocks, in format v1 and
//! in format v2 (two-level escape codes, level-3 bytes), are checked on every
//! `cargo test`, GPU or not, as shipped (two 16-value slices per thread) and
//! as built with `-DEPM_SLICES=1` (one per thread, the variant
//! `scripts/codec-gpu.sh --variants` times beside it). Speed and
//! real-hardware behaviour are the GPU run's (scripts/codec-gpu.sh).

use std::path::PathBuf;
use std::process::Command;

use epmem::codec::{self, Dtype, EncodeOptions, Encoded};

fn weight_like(n: usize, seed: u64, dtype: Dtype) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let odd: [u16; 4] =
        if dtype == Dtype::Fp16 { [0x7E01, 0x7C00, 0x8000, 0x0001] } else { [0x7FC1, 0x7F80, 0x8000, 0x0001] };
    (0..n)
        .flat_map(|_| {
            let v = if rng.u32(..300) == 0 {
                odd[rng.usize(..4)]
            } else {
                let x = ((0..4).map(|_| rng.f32()).sum::<f32>() - 2.0) * 0.035;
                let b = x.to_bits();
                match dtype {
                    // Normal fp16 range (|x| < 0.14 keeps the exponent above 0 mostly; 0 flushes).
                    Dtype::Fp16 => {
                        let e = ((b >> 23) & 0xFF) as i32 - 127 + 15;
                        if e <= 0 {
                            (b >> 16) as u16 & 0x8000
                        } else {
                            ((b >> 16) & 0x8000 | (e as u32) << 10 | (b >> 13) & 0x3FF) as u16
                        }
                    }
                    _ => (b >> 16) as u16,
                }
            };
            v.to_le_bytes()
        })
        .collect()
}

#[test]
fn the_decode_kernel_emulated_on_the_cpu_is_bit_exact() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = std::env::temp_dir().join(format!("epmem-codec-emu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let exes: Vec<(&str, PathBuf)> =
        [("shipped (2 slices a thread)", "-DEPM_SLICES=2"), ("1 slice a thread", "-DEPM_SLICES=1")]
            .into_iter()
            .map(|(name, define)| {
                let exe = dir.join(format!("emulate{}", &define[define.len() - 1..]));
                let built = Command::new(&cxx)
                    .args([
                        "-std=c++20",
                        "-O1",
                        "-pthread",
                        "-Wall",
                        "-Wextra",
                        "-Wno-unknown-pragmas",
                        "-Werror",
                        define,
                        "-o",
                    ])
                    .arg(&exe)
                    .arg(root.join("tools/codec-emu/emulate.cpp"))
                    .status()
                    .unwrap_or_else(|e| panic!("this test needs a C++20 compiler ({cxx}): {e}"));
                assert!(built.success(), "{cxx} {define} failed on tools/codec-emu/emulate.cpp");
                (name, exe)
            })
            .collect();

    let all: Vec<u8> = (0..=u16::MAX).flat_map(|v| v.to_le_bytes()).collect();
    // (what, raw, dtype, k, k2): k2 Some(0) forces format v1, Some(1..=4)
    // format v2 with that escape code width, None lets the encoder choose.
    let mut cases: Vec<(String, Vec<u8>, Dtype, Option<u32>, Option<u32>)> = Vec::new();
    for dtype in [Dtype::Bf16, Dtype::Fp16] {
        for k in 1..=4 {
            cases.push((format!("all {} patterns, v1 k={k}", dtype.name()), all.clone(), dtype, Some(k), Some(0)));
        }
        // Format v2: every (k, k2). With all bit patterns a small k2 leaves
        // most escapes to level 3 (k2 = 1: every escape but one exponent's).
        for k in 1..=4 {
            for k2 in 1..=4 {
                cases.push((
                    format!("all {} patterns, v2 k={k} k2={k2}", dtype.name()),
                    all.clone(),
                    dtype,
                    Some(k),
                    Some(k2),
                ));
            }
        }
        // The same patterns shuffled: a thread's escapes then differ in
        // exponent and level (all patterns in order give 16 equal exponents
        // to each thread).
        let mut order: Vec<u16> = (0..=u16::MAX).collect();
        fastrand::Rng::with_seed(dtype as u64).shuffle(&mut order);
        let shuffled: Vec<u8> = order.iter().flat_map(|v| v.to_le_bytes()).collect();
        for (k, k2) in [(2, 3), (3, 1), (4, 4)] {
            cases.push((
                format!("all {} patterns shuffled, v2 k={k} k2={k2}", dtype.name()),
                shuffled.clone(),
                dtype,
                Some(k),
                Some(k2),
            ));
        }
        for n in [1, 7, 16, 17, 4095, 4096, 4097, 3 * 4096 + 17] {
            let raw = weight_like(n, n as u64, dtype);
            cases.push((format!("{n} weight-like {}", dtype.name()), raw.clone(), dtype, None, None));
            for k2 in [1, 2, 4] {
                cases.push((
                    format!("{n} weight-like {}, v2 k2={k2}", dtype.name()),
                    raw.clone(),
                    dtype,
                    None,
                    Some(k2),
                ));
            }
        }
        // Several blocks, with level-3 escapes in some blocks and not others.
        let raw = weight_like(16 * 4096 + 4001, 99, dtype);
        cases.push((format!("16 blocks + 4001 weight-like {}", dtype.name()), raw.clone(), dtype, None, None));
        for k2 in [1, 3] {
            cases.push((
                format!("16 blocks + 4001 weight-like {}, v2 k2={k2}", dtype.name()),
                raw.clone(),
                dtype,
                None,
                Some(k2),
            ));
        }
    }
    let mut failures = Vec::new();
    let mut versions = [0usize; 3];
    for (what, raw, dtype, k, k2) in &cases {
        let opts = EncodeOptions { threads: 2, max_ratio: 1e9, min_bytes: 0, k: *k, k2: *k2 };
        let Encoded::Coded(buf) = codec::encode(raw, *dtype, &opts).unwrap() else { panic!("{what}: kept raw") };
        // The format the case asked for (auto: either), so each case tests what it says.
        let version = u16::from_le_bytes([buf[4], buf[5]]);
        let want: &[u16] = match k2 {
            Some(0) => &[1],
            Some(_) => &[2],
            None => &[1, 2],
        };
        assert!(want.contains(&version), "{what}: the encoder wrote format v{version}");
        assert!(k2.is_none_or(|k2| k2 == 0 || buf[11] as u32 == k2), "{what}: k2 {} in the header", buf[11]);
        versions[version as usize] += 1;
        let (src, dst) = (dir.join("in"), dir.join("out"));
        std::fs::write(&src, &buf).unwrap();
        for (kernel, exe) in &exes {
            let _ = std::fs::remove_file(&dst);
            let out = Command::new(exe).arg(&src).arg(&dst).output().unwrap();
            let got = if out.status.success() { std::fs::read(&dst).unwrap() } else { Vec::new() };
            if got != *raw {
                let first = got.chunks(2).zip(raw.chunks(2)).position(|(a, b)| a != b);
                failures.push(format!(
                    "{what} (format v{version}, {kernel}): {} first differing value {first:?}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
    }
    println!("{} cases: {} in format v1, {} in format v2", cases.len(), versions[1], versions[2]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "{} of {} runs differ:\n{}",
        failures.len(),
        cases.len() * exes.len(),
        failures.join("\n")
    );
}
