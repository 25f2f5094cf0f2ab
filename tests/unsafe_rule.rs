//! The unsafe rule, checked on the source: `unsafe` appears only in the
//! layers that are allowed it (device/, transfer/, ffi/, ort/). The core
//! modules are also `forbid(unsafe_code)` in lib.rs, which the compiler
//! enforces; this test catches what that cannot: a new top-level module
//! without the attribute. That every `unsafe` block and `unsafe impl` has a
//! `// SAFETY:` comment is clippy's `undocumented_unsafe_blocks`, denied in
//! Cargo.toml's `[lints.clippy]` and run by `make lint`.

use std::path::{Path, PathBuf};

/// The folders of src/ that may hold `unsafe` (README, "Layers").
const ALLOWED: &[&str] = &["device", "transfer", "ffi", "ort"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a line: what precedes a `//` comment (string literals holding
/// `//` do not occur next to `unsafe` in this crate).
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

fn has_unsafe_word(s: &str) -> bool {
    s.match_indices("unsafe").any(|(i, _)| {
        let before = s[..i].chars().next_back();
        let after = s[i + 6..].chars().next();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
            && !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

#[test]
fn unsafe_only_in_allowed_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    assert!(files.len() > 50, "found only {} files under {}", files.len(), src.display());
    let (mut outside, mut uses) = (Vec::new(), 0usize);
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let top = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
        let allowed = ALLOWED.contains(&top.as_str());
        let text = std::fs::read_to_string(f).unwrap();
        for (i, l) in text.lines().enumerate() {
            if !has_unsafe_word(code(l)) {
                continue;
            }
            uses += 1;
            if !allowed {
                outside.push(format!("src/{}:{}: {}", rel.display(), i + 1, l.trim()));
            }
        }
    }
    assert!(outside.is_empty(), "`unsafe` outside {ALLOWED:?}:\n{}", outside.join("\n"));
    // The crate has hundreds of uses; finding few means the scan is broken.
    assert!(uses > 100, "the scan found only {uses} uses of `unsafe`");
}

#[test]
fn the_scan_sees_what_it_must_refuse() {
    assert!(has_unsafe_word("    unsafe { p.write(0) };"));
    assert!(has_unsafe_word("unsafe impl Send for Job {}"));
    assert!(has_unsafe_word("unsafe fn f()"));
    assert!(!has_unsafe_word("let not_unsafe_code = 1;"));
    assert_eq!(code("x // unsafe here"), "x ");
}
