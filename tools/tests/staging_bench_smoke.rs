//! CI smoke test of the staging benchmark: `bench_staging --quick` runs on
//! the host device, prints its table and writes JSON with every scenario the
//! report needs. (Figures of record come from a GPU run: docs/BENCHMARKS.md.)

use std::process::Command;

#[test]
fn quick_bench_runs_and_reports_every_scenario() {
    let bin = env!("CARGO_BIN_EXE_bench_staging");
    // A missing binary is a failure, not a skip: this test exists to run it.
    // (scripts/gpu-check.sh does not run the *_bench_smoke tests; the GPU
    // machine runs the benches themselves.)
    assert!(std::path::Path::new(bin).is_file(), "{bin} is missing: the smoke test cannot run its bench");
    let json = std::env::temp_dir().join(format!("bench_staging_{}.json", std::process::id()));
    let out = Command::new(bin).args(["--quick", "--json"]).arg(&json).output().expect("run bench_staging");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&json).expect("JSON written");
    let _ = std::fs::remove_file(&json);
    for name in [
        "a_alloc_free/2MiB",
        "b_pooled_sync/2MiB",
        "c_ours/8MiB",
        "d_direct/8MiB",
        "e_peak/8MiB",
        "e_peak_registered/8MiB",
        "d_direct_device/8MiB",
        "e_peak_registered_device/8MiB",
        "f_fill_ceiling/8MiB",
        "acquire_release",
        "steady_state_pinned_allocs",
        "c_threads2/k4",
    ] {
        assert!(text.contains(&format!("\"name\":\"{name}\"")), "JSON lacks {name}");
    }
    assert!(!text.contains("\"value\":null"), "a scenario has no value:\n{text}");
    assert!(stdout.contains("| (a) alloc+free |") && stdout.contains("### Targets"), "{stdout}");
    assert!(stdout.contains("| size | e'/e, device time | d/e', wall time |"), "{stdout}");
    assert!(stdout.contains("steady-state pinned_alloc_calls = 0: 0 "), "{stdout}");
}
