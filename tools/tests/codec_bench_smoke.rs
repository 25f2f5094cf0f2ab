//! CI smoke test of the codec benchmark: `bench_codec --quick` runs on the
//! host device, checks every decode bit-exact and prints a row per tensor.
//! (The figures are the H200 run's business, not this test's.)

use std::process::Command;

#[test]
fn quick_bench_runs_checks_and_reports_every_tensor() {
    let bin = env!("CARGO_BIN_EXE_bench_codec");
    assert!(std::path::Path::new(bin).is_file(), "{bin} is missing: the smoke test cannot run its bench");
    let json = std::env::temp_dir().join(format!("bench_codec_{}.json", std::process::id()));
    let out = Command::new(bin)
        .args(["--quick", "--threads", "2", "--json"])
        .arg(&json)
        .env("EPM_DEVICE", "host")
        .output()
        .expect("run bench_codec");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("bit patterns, k=1..4: bit-exact"), "{stdout}");
    for row in ["| normal | bf16 |", "| kaiming | bf16 |", "| student_t3 | bf16 |", "| normal | fp16 |", "| student_t3 | fp16 |"] {
        assert!(stdout.contains(row), "no row {row}:\n{stdout}");
    }
    assert!(stdout.contains("all checks passed"), "{stdout}");
    let text = std::fs::read_to_string(&json).expect("JSON written");
    let _ = std::fs::remove_file(&json);
    assert_eq!(text.matches("\"device_decode_gbps\"").count(), 6, "{text}");
}
