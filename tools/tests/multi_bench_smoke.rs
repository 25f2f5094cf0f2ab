//! CI smoke test of the two-device benchmark: `bench_multi --quick` runs on
//! two host-device instances, checks its own "no second registration"
//! claim (it exits 1 otherwise) and writes JSON with every scenario. Figures
//! need two GPUs (docs/BENCHMARKS.md).

use std::process::Command;

#[test]
fn quick_bench_runs_and_reports_every_scenario() {
    let bin = env!("CARGO_BIN_EXE_bench_multi");
    assert!(std::path::Path::new(bin).is_file(), "{bin} is missing: the smoke test cannot run its bench");
    let json = std::env::temp_dir().join(format!("bench_multi_{}.json", std::process::id()));
    let out = Command::new(bin)
        .args(["--quick", "--json"])
        .arg(&json)
        .env("EPM_DEVICE", "host")
        .output()
        .expect("run bench_multi");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&json).expect("JSON written");
    let _ = std::fs::remove_file(&json);
    for name in ["single/dev0", "single/dev1", "both/aggregate", "both/vs_2x_single", "host/memcpy_read"] {
        assert!(text.contains(&format!("\"name\":\"{name}\"")), "JSON lacks {name}:\n{text}");
    }
    assert!(!text.contains("\"value\":null"), "a scenario has no value:\n{text}");
    assert!(stdout.contains("device 1: host_register_calls +0, staged page-ins 0"), "{stdout}");
}
