//! The unsafe rule, checked on the source: `unsafe` appears only in the
//! layers that are allowed it (device/, transfer/, ffi/, ort/), and every
//! `unsafe { .. }` block and `unsafe impl` has a `// SAFETY:` line just above
//! it (or on its line). The core modules are also `forbid(unsafe_code)` in
//! lib.rs, which the compiler enforces; this test catches what that cannot:
//! a new top-level module without the attribute, and a block whose
//! justification was forgotten.

use std::path::{Path, PathBuf};

/// The folders of src/ that may hold `unsafe` (README, "Layers").
const ALLOWED: &[&str] = &["device", "transfer", "ffi", "ort"];
/// How far above an `unsafe` block its SAFETY comment may start (a comment
/// of several lines, or a block opened inside a multi-line expression).
const WINDOW: usize = 8;

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
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_') && !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

/// An `unsafe` block or impl (not an `unsafe fn` declaration, whose contract
/// is its `# Safety` doc section, nor `unsafe extern`).
fn opens_unsafe_block(s: &str) -> bool {
    s.match_indices("unsafe").any(|(i, _)| {
        let rest = s[i + 6..].trim_start();
        has_unsafe_word(&s[i..]) && (rest.starts_with('{') || rest.starts_with("impl") || rest.is_empty())
    })
}

#[test]
fn unsafe_only_in_allowed_layers_and_every_block_justified() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    assert!(files.len() > 50, "found only {} files under {}", files.len(), src.display());
    let (mut outside, mut unjustified, mut blocks) = (Vec::new(), Vec::new(), 0usize);
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let top = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
        let allowed = ALLOWED.contains(&top.as_str());
        let text = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let c = code(l);
            if !has_unsafe_word(c) {
                continue;
            }
            if !allowed {
                outside.push(format!("src/{}:{}: {}", rel.display(), i + 1, l.trim()));
            }
            if opens_unsafe_block(c) {
                blocks += 1;
                if !lines[i.saturating_sub(WINDOW)..=i].iter().any(|w| w.contains("SAFETY:")) {
                    unjustified.push(format!("src/{}:{}: {}", rel.display(), i + 1, l.trim()));
                }
            }
        }
    }
    assert!(outside.is_empty(), "`unsafe` outside {ALLOWED:?}:\n{}", outside.join("\n"));
    assert!(unjustified.is_empty(), "unsafe blocks with no `// SAFETY:` line within {WINDOW} lines above:\n{}", unjustified.join("\n"));
    // The crate has hundreds of blocks; finding none means the scan is broken.
    assert!(blocks > 100, "the scan found only {blocks} unsafe blocks");
}

#[test]
fn the_scan_sees_what_it_must_refuse() {
    assert!(opens_unsafe_block("    unsafe { p.write(0) };"));
    assert!(opens_unsafe_block("unsafe impl Send for Job {}"));
    assert!(opens_unsafe_block("    let r = unsafe {"));
    assert!(!opens_unsafe_block("pub unsafe fn copy(dst: *mut u8) {"));
    assert!(!opens_unsafe_block("pub unsafe extern \"C\" fn epm_x() {"));
    assert!(has_unsafe_word("unsafe fn f()"));
    assert!(!has_unsafe_word("let not_unsafe_code = 1;"));
    assert_eq!(code("x // unsafe here"), "x ");
}
