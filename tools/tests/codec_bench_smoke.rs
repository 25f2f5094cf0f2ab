//! CI smoke test of the codec benchmark: `bench_codec --quick` runs on the
//! host device, checks every decode bit-exact and prints a row per tensor.
//! (Figures of record come from a GPU run: docs/BENCHMARKS.md.)

use std::process::Command;

#[test]
fn quick_bench_runs_checks_and_reports_every_tensor() {
    let bin = env!("CARGO_BIN_EXE_bench_codec");
    assert!(std::path::Path::new(bin).is_file(), "{bin} is missing: the smoke test cannot run its bench");
    let json = std::env::temp_dir().join(format!("bench_codec_{}.json", std::process::id()));
    let dir = std::env::temp_dir().join(format!("bench_codec_dump_{}", std::process::id()));
    let out = Command::new(bin)
        .args(["--quick", "--threads", "2", "--json"])
        .arg(&json)
        .arg("--dump")
        .arg(&dir)
        .env("EPM_DEVICE", "host")
        .output()
        .expect("run bench_codec");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("bit patterns, k=1..4, format v1 and v2 with k2=1..4: bit-exact"), "{stdout}");
    assert!(stdout.contains("(a partial last block): bit-exact"), "{stdout}");
    for row in [
        "| normal | bf16 |",
        "| kaiming | bf16 |",
        "| student_t3 | bf16 |",
        "| normal | fp16 |",
        "| student_t3 | fp16 |",
    ] {
        assert!(stdout.contains(row), "no row {row}:\n{stdout}");
    }
    assert!(stdout.contains("all checks passed"), "{stdout}");
    let text = std::fs::read_to_string(&json).expect("JSON written");
    let _ = std::fs::remove_file(&json);
    assert_eq!(text.matches("\"device_decode_gbps\"").count(), 6, "{text}");

    // --dump: every case, in run order, an encoded buffer that decodes to its raw file.
    let list = std::fs::read_to_string(dir.join("cases.txt")).expect("cases.txt written");
    let names: Vec<&str> = list.lines().collect();
    // All bit patterns: 2 dtypes × k 1..=4 × (v1, v2 with k2 1..=4); then the odd lengths and tensors.
    assert_eq!(names.len(), 40 + 2 + 6, "{list}");
    assert_eq!(
        (names[0], names[1], names[39], names[40], names[41], names[42], names[47]),
        (
            "all-bf16-k1",
            "all-bf16-k1-v2k1",
            "all-fp16-k4-v2k4",
            "odd-normal-bf16",
            "odd-normal-fp16",
            "normal-bf16",
            "student_t3-fp16"
        )
    );
    for name in names {
        let buf = std::fs::read(dir.join(format!("{name}.epmz"))).unwrap();
        let raw = std::fs::read(dir.join(format!("{name}.raw"))).unwrap();
        let desc = epmem::codec::parse(&buf, 1).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut out = vec![0u8; desc.raw_len()];
        epmem::codec::decode_with(&desc, &buf, &mut out, 1).unwrap();
        assert!(out == raw, "{name}: the dumped buffer does not decode to the dumped raw bytes");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
