//! The committed header is exactly what the pinned cbindgen generates, and it
//! compiles alone as C11 and as C++17 with every warning an error.
//!
//! `EPM_BLESS=1 cargo test --test header` rewrites include/epmem.h.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The C surface is src/ffi/ (and the status enum in src/error.rs), nothing
/// else: a `pub const` elsewhere in the crate must not leak into the header,
/// and C types belong in src/ffi/.
fn generate() -> String {
    let config = cbindgen::Config::from_file(root().join("cbindgen.toml")).expect("read cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_src(root().join("src/ffi/mod.rs"))
        .with_src(root().join("src/error.rs"))
        .with_config(config)
        .generate()
        .expect("cbindgen failed on the crate");
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("header is UTF-8")
}

#[test]
fn committed_header_is_up_to_date() {
    let generated = generate();
    let path = root().join("include/epmem.h");
    if std::env::var_os("EPM_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let first = committed.lines().zip(generated.lines()).position(|(a, b)| a != b);
        panic!(
            "include/epmem.h is stale (first difference at line {}); run EPM_BLESS=1 cargo test --test header",
            first.map_or(committed.lines().count().min(generated.lines().count()) + 1, |i| i + 1)
        );
    }
}

fn compile(compiler: &str, std: &str, ext: &str) {
    let dir = std::env::temp_dir().join(format!("epmem-header-{}-{ext}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join(format!("only_header.{ext}"));
    std::fs::write(&src, "#include \"epmem.h\"\nint main(void) { return epm_version() == EPM_VERSION ? 0 : 1; }\n")
        .unwrap();
    let out = Command::new(compiler)
        .args([std, "-Wall", "-Wextra", "-Werror", "-pedantic", "-c", "-o"])
        .arg(dir.join("o.o"))
        .arg("-I")
        .arg(root().join("include"))
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("{compiler} not runnable: {e}"));
    assert!(
        out.status.success(),
        "{compiler} {std} rejects include/epmem.h:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn header_compiles_alone_as_c11() {
    compile("gcc", "-std=c11", "c");
}

#[test]
fn header_compiles_alone_as_cpp17() {
    compile("g++", "-std=c++17", "cpp");
}

/// Every status in the header has the value and name the library reports.
#[test]
fn header_status_values_match_library_names() {
    let header = std::fs::read_to_string(root().join("include/epmem.h")).unwrap();
    let mut seen = 0;
    for line in header.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("EPM_STATUS_") else { continue };
        let (name, value) = rest.split_once(" = ").expect("status constants carry explicit values");
        let value: i32 = value.trim_end_matches(',').parse().unwrap();
        let c = epmem::ffi::status::epm_status_name(value);
        // SAFETY: epm_status_name returns a static NUL-terminated string.
        let lib = unsafe { std::ffi::CStr::from_ptr(c) }.to_str().unwrap();
        assert_eq!(lib, format!("EPM_STATUS_{name}"));
        seen += 1;
    }
    assert_eq!(seen, epmem::ffi::status::ALL_STATUSES.len());
}

/// The version macros in the header match Cargo.toml.
#[test]
fn header_version_macros_match_cargo_toml() {
    let header = std::fs::read_to_string(root().join("include/epmem.h")).unwrap();
    for (name, want) in [
        ("EPM_VERSION_MAJOR", env!("CARGO_PKG_VERSION_MAJOR")),
        ("EPM_VERSION_MINOR", env!("CARGO_PKG_VERSION_MINOR")),
        ("EPM_VERSION_PATCH", env!("CARGO_PKG_VERSION_PATCH")),
    ] {
        let line = header.lines().find(|l| l.starts_with(&format!("#define {name} "))).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(line.split_whitespace().nth(2), Some(want), "{line}");
    }
    let _ = Path::new("");
}

/// Every exported function carries a doc comment into the header, and the
/// comment says how it behaves across threads (the ABI promises that for all).
#[test]
fn every_function_is_documented() {
    let header = std::fs::read_to_string(root().join("include/epmem.h")).unwrap();
    let lines: Vec<&str> = header.lines().collect();
    let mut functions = 0;
    for (i, line) in lines.iter().enumerate() {
        let Some(open) = line.find("epm_").filter(|_| line.contains('(') && !line.starts_with(' ')) else { continue };
        if line.starts_with("typedef") || line.starts_with(" *") || line.starts_with("#") {
            continue;
        }
        let name: String = line[open..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        functions += 1;
        assert!(i > 0 && lines[i - 1].trim() == "*/", "{name} has no doc comment in the header");
        let start = lines[..i].iter().rposition(|l| l.trim() == "/**").expect("doc comment start");
        let doc = lines[start..i].join("\n").to_lowercase();
        assert!(doc.contains("thread"), "{name}'s doc comment says nothing about threading");
    }
    assert!(functions >= 30, "only {functions} functions found: the header parser is wrong");
}
