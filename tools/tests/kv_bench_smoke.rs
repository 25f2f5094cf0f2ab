//! bench_kv --quick runs end to end (CI smoke on the host device) and its
//! figures are the ones the arithmetic predicts: bytes saved by sharing and
//! admitted requests come from the ledger, so they are exact even on the host.

use std::process::Command;

#[test]
fn bench_kv_quick_reports_ledger_figures() {
    let exe = env!("CARGO_BIN_EXE_bench_kv");
    // A missing binary is a failure, not a skip: this test exists to run it.
    // (scripts/gpu-check.sh does not run the *_bench_smoke tests; the GPU
    // machine runs the benches themselves.)
    assert!(std::path::Path::new(exe).is_file(), "{exe} is missing: the smoke test cannot run its bench");
    let json = std::env::temp_dir().join(format!("bench_kv_smoke_{}.json", std::process::id()));
    let out = Command::new(exe).arg("--quick").arg("--json").arg(&json).output().expect("run bench_kv");
    let md = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench_kv failed: {}\n{md}", String::from_utf8_lossy(&out.stderr));
    // qwen2.5-0.5b, 512 tokens = 6 MiB: 2 and 4 sharers save 6 and 18 MiB.
    assert!(md.contains("| qwen2.5-0.5b | 512 | 2 | 6 | 6 |"), "{md}");
    assert!(md.contains("| qwen2.5-0.5b | 512 | 4 | 18 | 18 |"), "{md}");
    // 50/50 split on 4 unshared requests' worth: 4 -> 7 measured, the shorthand 1+⌊(B−P)/Q⌋ says 8.
    assert!(md.contains("| 4 / 4 | 7 / 7 | 8 |"), "{md}");
    let j = std::fs::read_to_string(&json).expect("bench_kv wrote its JSON");
    let _ = std::fs::remove_file(&json);
    assert!(j.contains("\"bench\":\"kv\"") && j.contains("ours_cow/1") && j.contains("floor_map/4"), "{j}");
}
