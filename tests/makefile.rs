//! Make targets whose failure modes CI relies on.

use std::process::Command;

/// `make test-valgrind` must fail, not pass with a note, when valgrind is
/// missing: CI installs it, and a run that checked nothing must not read as
/// a pass. `CARGO=false` keeps make from building anything should the target
/// get past its check (so the test stays fast and fails on the message).
#[test]
fn test_valgrind_fails_when_valgrind_is_missing() {
    let out = Command::new("make")
        .args(["-s", "test-valgrind", "VALGRIND_BIN=/nonexistent/valgrind", "CARGO=false"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .env_remove("MAKELEVEL")
        .output()
        .expect("run make (CI has it)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "make test-valgrind passed without valgrind:\n{stdout}\n{stderr}");
    assert!(
        stderr.contains("/nonexistent/valgrind not found"),
        "make test-valgrind failed for another reason than the missing valgrind:\n{stdout}\n{stderr}"
    );
}
