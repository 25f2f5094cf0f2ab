//! CI smoke test of the residency benchmark: `bench_residency --quick` runs
//! on the host device, prints its tables and writes JSON with every case the
//! report needs. (Figures of record come from a GPU run: docs/BENCHMARKS.md.)

use std::process::Command;

#[test]
fn quick_bench_runs_and_reports_every_case() {
    let bin = env!("CARGO_BIN_EXE_bench_residency");
    // A missing binary is a failure, not a skip: this test exists to run it.
    // (scripts/gpu-check.sh does not run the *_bench_smoke tests; the GPU
    // machine runs the benches themselves.)
    assert!(std::path::Path::new(bin).is_file(), "{bin} is missing: the smoke test cannot run its bench");
    let json = std::env::temp_dir().join(format!("bench_residency_{}.json", std::process::id()));
    let out = Command::new(bin).args(["--quick", "--json"]).arg(&json).output().expect("run bench_residency");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&json).expect("JSON written");
    let _ = std::fs::remove_file(&json);
    for name in [
        "peak_pinned_h2d",
        "a_naive_pageable",
        "b_seed_sync_lru",
        "c_ours_registered",
        "c_ours_unregistered",
        "compute_only/step",
        "c_ours_registered/steady_driver_allocs",
        "depth1/step_over_max",
        "depth1/hit_over_belady",
        "best_step_over_max",
        "llama7b/50/plan/hold1/bytes_over_floor",
        "llama70b/25/farthest-next-use/hold7/step",
        "mixed_plan_bytes_over_bound",
    ] {
        assert!(text.contains(&format!("\"name\":\"{name}\"")), "JSON lacks {name}");
    }
    assert!(!text.contains("\"value\":null"), "a scenario has no value:\n{text}");
    assert!(stdout.contains("| (a) naive pageable memcpy |") && stdout.contains("### Targets"), "{stdout}");
    assert!(stdout.contains("in steady state (ours) | 0 | PASS"), "steady-state driver allocations: {stdout}");
    // The plan's mixed-size rows: within the bound, no host waits.
    assert!(stdout.contains("| no host waits on eviction in steady state | 0 | PASS"), "{stdout}");
    // LRU on a cyclic scan above the budget hits nothing, exactly.
    assert!(stdout.contains("| b_seed_sync_lru |") && stdout.contains("LRU baseline hit rate: 0.000"), "{stdout}");
}
