//! Keeps the witness's `compile_fail` doctests honest.
//!
//! Stable rustdoc does not check the error code of a `compile_fail` block
//! (only nightly does), so a block could "pass" by failing for an unrelated
//! reason — a typo, a renamed import. What rules that out is structure: each
//! `compile_fail` block is a copy of a compiling block with exactly one line
//! changed, and the compiling block really runs. This test enforces that
//! structure so an edit cannot quietly break it.

/// Code blocks of the `//!` docs in `src`: (info string, lines).
fn blocks(src: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut cur: Option<(String, Vec<String>)> = None;
    for line in src.lines() {
        let Some(doc) = line.trim_start().strip_prefix("//!") else {
            continue;
        };
        let doc = doc.strip_prefix(' ').unwrap_or(doc);
        if let Some(info) = doc.strip_prefix("```") {
            match cur.take() {
                None => cur = Some((info.to_string(), Vec::new())),
                Some(b) => out.push(b),
            }
        } else if let Some((_, lines)) = cur.as_mut() {
            lines.push(doc.to_string());
        }
    }
    out
}

fn check(name: &str, src: &str, expected_fails: usize) {
    let bs = blocks(src);
    let twin = bs.iter().find(|(info, _)| info.is_empty()).unwrap_or_else(|| panic!("{name}: no compiling block"));
    let fails: Vec<_> = bs.iter().filter(|(info, _)| info.starts_with("compile_fail")).collect();
    assert_eq!(fails.len(), expected_fails, "{name}: compile_fail blocks");
    for (info, lines) in fails {
        let code =
            info.strip_prefix("compile_fail,E").unwrap_or_else(|| panic!("{name}: `{info}` names no error code"));
        assert!(code.len() == 4 && code.bytes().all(|b| b.is_ascii_digit()), "{name}: `{info}`");
        assert_eq!(lines.len(), twin.1.len(), "{name} {info}: not a copy of the compiling block");
        let changed: Vec<_> = lines.iter().zip(&twin.1).filter(|(a, b)| a != b).collect();
        assert_eq!(changed.len(), 1, "{name} {info}: differs from its compiling twin in {changed:?}");
    }
}

#[test]
fn each_fence_compile_fail_is_one_line_from_its_compiling_twin() {
    check("device/fence.rs", include_str!("../src/device/fence.rs"), 8);
}

#[test]
fn each_pool_compile_fail_is_one_line_from_its_compiling_twin() {
    check("staging/pool.rs", include_str!("../src/staging/pool.rs"), 3);
}
