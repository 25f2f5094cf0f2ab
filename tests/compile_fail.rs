//! The witnesses' and the typed ids' refusals, proven by the compiler's own error messages.
//!
//! Each file in tests/compile_fail/ is a program that compiles against
//! epmem, with one line marked `// @slot`, and a list of cases:
//! `// @case E0XXX | message fragment | replacement line`. For every case the
//! harness replaces the slot with the line, type-checks the result with
//! rustc (`--emit=metadata`: no codegen, so a case costs a fraction of a
//! second), and asserts that it fails with that error code and no other,
//! and that the diagnostic (its message or labels) names the expected item. The
//! unmodified program must compile, so a case cannot pass by failing for an
//! unrelated reason (a typo, a renamed import): it is one line away from
//! code that builds. (Doctest `compile_fail` blocks cannot do this: stable
//! rustdoc ignores their error codes.)
//!
//! rustc is the one on PATH, or `$RUSTC`; the epmem rlib is the newest
//! `libepmem.rlib` (or `libepmem-HASH.rlib`) next to this test binary, which cargo has just built for
//! it. A mismatch there (another toolchain, a stale rlib) makes the
//! compiling twin fail, loudly.

use std::path::{Path, PathBuf};
use std::process::Command;

struct Case {
    code: String,
    fragment: String,
    line: String,
}

fn parse(src: &str) -> (Vec<Case>, usize) {
    let lines: Vec<&str> = src.lines().collect();
    let slots: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].trim_end().ends_with("// @slot")).collect();
    assert_eq!(slots.len(), 1, "exactly one `// @slot` line");
    let cases = lines
        .iter()
        .filter_map(|l| l.trim_start().strip_prefix("// @case "))
        .map(|spec| {
            let parts: Vec<&str> = spec.splitn(3, " | ").collect();
            assert_eq!(parts.len(), 3, "`// @case CODE | fragment | line`: {spec}");
            let code = parts[0].trim().to_string();
            assert!(
                code.len() == 5 && code.starts_with('E') && code[1..].bytes().all(|b| b.is_ascii_digit()),
                "{spec}"
            );
            Case { code, fragment: parts[1].to_string(), line: parts[2].to_string() }
        })
        .collect();
    (cases, slots[0])
}

/// `src` with the slot line replaced (indentation kept).
fn with_line(src: &str, slot: usize, line: &str) -> String {
    let mut out = String::new();
    for (i, l) in src.lines().enumerate() {
        if i == slot {
            let indent = &l[..l.len() - l.trim_start().len()];
            out.push_str(indent);
            out.push_str(line);
        } else {
            out.push_str(l);
        }
        out.push('\n');
    }
    out
}

fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().expect("deps dir").to_path_buf()
}

fn epmem_rlib(deps: &Path) -> PathBuf {
    let mut rlibs: Vec<_> = std::fs::read_dir(deps)
        .expect("read deps dir")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n == "libepmem.rlib" || (n.starts_with("libepmem-") && n.ends_with(".rlib")))
        })
        .collect();
    rlibs.sort_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
    rlibs.pop().unwrap_or_else(|| panic!("no libepmem.rlib in {}", deps.display()))
}

/// Type-check `src`; (success, stderr).
fn check(name: &str, src: &str) -> (bool, String) {
    let deps = deps_dir();
    let dir = deps.join("../compile-fail").join(name);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let file = dir.join("main.rs");
    std::fs::write(&file, src).expect("write case");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let out = Command::new(rustc)
        .args(["--edition", "2024", "--crate-type", "bin", "--emit=metadata", "--color", "never"])
        .arg("--crate-name")
        .arg(name.replace(['-', '.'], "_"))
        .arg("--out-dir")
        .arg(&dir)
        .arg("-L")
        .arg(format!("dependency={}", deps.display()))
        .arg("--extern")
        .arg(format!("epmem={}", epmem_rlib(&deps).display()))
        .arg(&file)
        .output()
        .expect("run rustc");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The error lines of a rustc run (not the closing summary).
fn errors(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.starts_with("error")).filter(|l| !l.starts_with("error: aborting due to")).collect()
}

fn run_file(stem: &str, src: &str) {
    let (cases, slot) = parse(src);
    assert!(!cases.is_empty(), "{stem}: no cases");
    let (ok, stderr) = check(&format!("{stem}-twin"), src);
    assert!(ok, "{stem}: the compiling twin does not compile:\n{stderr}");
    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = cases
            .chunks(cases.len().div_ceil(2))
            .enumerate()
            .map(|(part, chunk)| {
                s.spawn(move || {
                    let mut bad = Vec::new();
                    for (i, c) in chunk.iter().enumerate() {
                        let name = format!("{stem}-{part}-{i}");
                        let (ok, stderr) = check(&name, &with_line(src, slot, &c.line));
                        let errs = errors(&stderr);
                        let want = format!("error[{}]", c.code);
                        let why = if ok {
                            Some("compiled".to_string())
                        } else if errs.is_empty() || !errs.iter().all(|e| e.starts_with(&want)) {
                            Some(format!("errors other than {want}: {errs:?}"))
                        } else if !stderr.contains(&c.fragment) {
                            Some(format!("the errors do not say `{}`: {errs:?}", c.fragment))
                        } else {
                            None
                        };
                        if let Some(why) = why {
                            bad.push(format!("{stem}: `{}`: {why}\n{stderr}", c.line));
                        }
                    }
                    bad
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("case thread")).collect()
    });
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

#[test]
fn the_staging_witness_refuses_what_it_must() {
    run_file("staging", include_str!("compile_fail/staging.rs"));
}

#[test]
fn the_read_fence_witness_refuses_what_it_must() {
    run_file("residency", include_str!("compile_fail/residency.rs"));
}

#[test]
fn the_harness_itself_rejects_a_case_with_the_wrong_code_or_name() {
    // A case that fails for a reason other than the one it names must be
    // reported: same program, a wrong code, then a wrong fragment.
    let src = "fn main() {\n    let note = (); // @slot\n    let _ = note;\n}\n";
    let (ok, stderr) = check("harness-twin", src);
    assert!(ok, "{stderr}");
    let (ok, stderr) = check("harness-case", &with_line(src, 1, "let note: u8 = \"x\";"));
    assert!(!ok);
    let errs = errors(&stderr);
    assert!(errs.iter().all(|e| e.starts_with("error[E0308]")), "{errs:?}");
    assert!(!errs.iter().all(|e| e.starts_with("error[E0599]")), "a wrong code would be caught");
    assert!(!stderr.contains("`CopyCompleted`"), "a wrong fragment would be caught");
}

#[test]
fn the_kv_ids_do_not_mix() {
    run_file("kv_ids", include_str!("compile_fail/kv_ids.rs"));
}
