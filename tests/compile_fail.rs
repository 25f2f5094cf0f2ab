//! The witnesses' and the typed ids' refusals, proven by the compiler's own
//! error messages (trybuild).
//!
//! Each folder under tests/compile_fail/ holds `ok.rs`, a program that
//! compiles and runs against epmem, and cases `NN_E0XXX.rs`, each that
//! program with one line replaced, which must fail with exactly the
//! diagnostic in its `.stderr` beside it. A case cannot pass by failing for
//! an unrelated reason: its twin `ok.rs` builds, and the expected output is
//! the whole diagnostic. The code in a case's name is checked against its
//! `.stderr` too, so a re-blessed snapshot (`TRYBUILD=overwrite cargo test
//! --test compile_fail`) cannot quietly change which error a case proves.

const FOLDERS: [&str; 3] = ["staging", "residency", "kv_ids"];

#[test]
fn the_witnesses_and_ids_refuse_what_they_must() {
    let t = trybuild::TestCases::new();
    for f in FOLDERS {
        t.pass(format!("tests/compile_fail/{f}/ok.rs"));
        t.compile_fail(format!("tests/compile_fail/{f}/[0-9]*.rs"));
    }
}

/// Every case's expected errors are the code its name gives, and nothing
/// else; and each folder has cases.
#[test]
fn each_case_fails_with_the_code_it_names() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compile_fail");
    for f in FOLDERS {
        let mut cases = 0;
        for e in std::fs::read_dir(root.join(f)).unwrap() {
            let p = e.unwrap().path();
            let Some(name) = p.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".rs")) else {
                continue;
            };
            if name == "ok" {
                continue;
            }
            let code = name.split('_').nth(1).unwrap_or_else(|| panic!("{f}/{name}.rs: name it NN_E0XXX"));
            let stderr = std::fs::read_to_string(p.with_extension("stderr"))
                .unwrap_or_else(|e| panic!("{f}/{name}.stderr: {e} (TRYBUILD=overwrite writes it)"));
            let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
            let want = format!("error[{code}]");
            assert!(
                !errors.is_empty() && errors.iter().all(|l| l.starts_with(&want)),
                "{f}/{name}: expected only {want}, the snapshot has {errors:?}"
            );
            cases += 1;
        }
        assert!(cases > 0, "{f}: no cases");
    }
}
