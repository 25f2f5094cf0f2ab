//! Every function of include/epmem.h has at least one misuse case in
//! ffi-tests/test_misuse*.c: a call inside a checking macro (MU_EXPECT,
//! BAD_HANDLES, BAD_DESTROY, BAD_HANDLES_X, CHECK, CHECK_STATUS). A new
//! function without one fails this test, naming it.

use std::collections::BTreeSet;
use std::path::Path;

const CHECKERS: [&str; 6] = ["MU_EXPECT", "BAD_HANDLES_X", "BAD_HANDLES", "BAD_DESTROY", "CHECK_STATUS", "CHECK"];

/// `epm_*` names declared as functions in the header (a name followed by `(`
/// on a declaration line, i.e. one that does not start inside a comment).
fn header_functions(header: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in header.lines() {
        let t = line.trim_start();
        if t.starts_with('*') || t.starts_with("/*") || t.starts_with("//") || t.starts_with('#') {
            continue;
        }
        out.extend(epm_calls(t));
    }
    out
}

/// Every `epm_name(` in `text`.
fn epm_calls(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("epm_") {
        let start = i + at;
        let mut end = start + 4;
        while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'_') {
            end += 1;
        }
        let word_start = start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
        if word_start && end < b.len() && b[end] == b'(' {
            out.push(text[start..end].to_string());
        }
        i = end;
    }
    out
}

/// The argument text of every invocation of a checking macro in `src`.
fn checked_text(src: &str) -> Vec<&str> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let hit = CHECKERS.iter().find(|m| {
            src[i..].starts_with(&format!("{m}("))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        });
        let Some(m) = hit else {
            i += 1;
            continue;
        };
        let open = i + m.len();
        let mut depth = 0;
        let mut j = open;
        while j < b.len() {
            match b[j] {
                b'(' => depth += 1,
                b')' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
            j += 1;
        }
        out.push(&src[open..j.min(b.len())]);
        i = open;
    }
    out
}

#[test]
fn every_header_function_has_a_misuse_case() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = std::fs::read_to_string(root.join("include/epmem.h")).unwrap();
    let funcs = header_functions(&header);
    assert!(funcs.len() >= 80, "parsed only {} functions from the header: {funcs:?}", funcs.len());

    let mut covered = BTreeSet::new();
    let mut files = 0;
    for entry in std::fs::read_dir(root.join("ffi-tests")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("test_misuse") && name.ends_with(".c") {
            files += 1;
            let src = std::fs::read_to_string(&path).unwrap();
            for args in checked_text(&src) {
                covered.extend(epm_calls(args));
            }
        }
    }
    assert!(files >= 1, "no ffi-tests/test_misuse*.c found");
    let missing: Vec<_> = funcs.difference(&covered).collect();
    assert!(
        missing.is_empty(),
        "functions of include/epmem.h with no misuse case in ffi-tests/test_misuse*.c \
         (call each inside MU_EXPECT / BAD_HANDLES / BAD_DESTROY / CHECK): {missing:?}"
    );
}

#[test]
fn the_parsers_see_what_they_should() {
    let h = "/**\n * epm_not_this(x)\n */\nenum EpmStatus epm_a_b(int x,\n    int y);\nconst char *epm_c(void);\n";
    assert_eq!(header_functions(h).into_iter().collect::<Vec<_>>(), ["epm_a_b", "epm_c"]);
    let c = "x(epm_a_b(1));\nMU_EXPECT(epm_c(f(1), g(2)), X, \"k\");\nBAD_HANDLES(T, h, w, d,\n  epm_a_b(h));";
    let got: Vec<String> = checked_text(c).into_iter().flat_map(epm_calls).collect();
    assert_eq!(got, ["epm_c", "epm_a_b"]);
}
