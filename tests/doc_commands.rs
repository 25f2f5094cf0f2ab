//! Every command the docs show exists as shown: in the ```sh blocks of
//! README.md and docs/*.md, each `make TARGET` is a Makefile rule, each
//! `scripts/...` path exists and each `--flag` given to one of its Python or
//! shell scripts is one that script parses, each bench or test binary
//! (`.carry/bin/NAME`, `target/release/NAME`, `.carry/tests/NAME`, `cargo
//! test --test NAME`, `cargo bench --bench NAME`) has its source, and its
//! flags are ones it reads.
//!
//!   cargo test --test doc_commands

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// The commands of the ```sh / ```bash / ```console blocks of one markdown
/// file: continuation lines joined, comments dropped, split at `&&`, `;`
/// and `|`. Each with its 1-based line number.
fn commands(md: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_block = false;
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in md.lines().enumerate() {
        let t = line.trim_start();
        if let Some(lang) = t.strip_prefix("```") {
            in_block = !in_block && matches!(lang.trim(), "sh" | "bash" | "console");
            continue;
        }
        if !in_block {
            continue;
        }
        let code = match line.find(" #") {
            Some(p) => &line[..p],
            None if t.starts_with('#') => "",
            None => line,
        };
        let (start, mut text) = pending.take().unwrap_or((i + 1, String::new()));
        text.push(' ');
        text.push_str(code.trim());
        if let Some(cont) = text.strip_suffix('\\') {
            pending = Some((start, cont.to_string()));
            continue;
        }
        for part in text.split("&&").flat_map(|p| p.split(';')).flat_map(|p| p.split('|')) {
            let part = part.trim();
            if !part.is_empty() {
                out.push((start, part.to_string()));
            }
        }
    }
    out
}

fn makefile_targets() -> Vec<String> {
    read(&root().join("Makefile"))
        .lines()
        .filter_map(|l| {
            let name = l.split(':').next()?;
            (!name.is_empty()
                && !l.starts_with(['\t', ' ', '#'])
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
            .then(|| name.to_string())
        })
        .collect()
}

/// The `--flags` of a command's arguments after `from` (stopping at a bare
/// `--`, whose rest belongs to another program).
fn flags(words: &[&str], from: usize) -> Vec<String> {
    words[from..]
        .iter()
        .take_while(|w| **w != "--")
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.split('=').next().unwrap().to_string())
        .collect()
}

/// Does the source of a program parse this flag? Python: `"--flag"` in an
/// add_argument; shell: a `--flag)` case; Rust: `"--flag"` or lexopt's
/// `Long("flag")` (the benches' shared ones are in tools/src/bench.rs).
fn parses(src: &str, flag: &str) -> bool {
    let bare = &flag[2..];
    src.contains(&format!("\"{flag}\""))
        || src.contains(&format!("'{flag}'"))
        || src.contains(&format!("{flag})"))
        || src.contains(&format!("Long(\"{bare}\")"))
}

fn check_file(rel: &str, targets: &[String], problems: &mut Vec<String>) {
    let r = root();
    let bench_rs = read(&r.join("tools/src/bench.rs"));
    for (line, cmd) in commands(&read(&r.join(rel))) {
        let words: Vec<&str> = cmd.split_whitespace().collect();
        let mut bad = |what: String| problems.push(format!("{rel}:{line}: `{cmd}`: {what}"));
        for (i, w) in words.iter().enumerate() {
            let w = w.trim_matches(|c| c == '`' || c == '"' || c == '\'' || c == '(' || c == ')');
            if let Some(script) = w.find("scripts/").map(|p| &w[p..]) {
                let path = r.join(script);
                if !path.is_file() {
                    bad(format!("{script} does not exist"));
                } else if script.ends_with(".py") || script.ends_with(".sh") {
                    let src = read(&path);
                    for f in flags(&words, i + 1) {
                        if !parses(&src, &f) {
                            bad(format!("{script} has no option {f}"));
                        }
                    }
                }
            }
            for prefix in [".carry/bin/", "target/release/"] {
                if let Some(name) = w.strip_prefix(prefix).or_else(|| w.find(prefix).map(|p| &w[p + prefix.len()..])) {
                    if name.starts_with("lib") || name.is_empty() {
                        continue;
                    }
                    let src = r.join("tools/src/bin").join(format!("{name}.rs"));
                    if !src.is_file() {
                        bad(format!("no program {name} (tools/src/bin/{name}.rs)"));
                        continue;
                    }
                    let src = read(&src) + &bench_rs;
                    for f in flags(&words, i + 1) {
                        if !parses(&src, &f) {
                            bad(format!("{name} has no option {f}"));
                        }
                    }
                }
            }
            if let Some(name) = w.strip_prefix(".carry/tests/") {
                if !r.join("tests").join(format!("{name}.rs")).is_file() {
                    bad(format!("no integration test tests/{name}.rs"));
                }
            }
        }
        if words.first() == Some(&"make") || words.iter().any(|w| *w == "make") && words[0].contains('=') {
            let at = words.iter().position(|w| *w == "make").unwrap();
            for t in words[at + 1..].iter().filter(|w| !w.contains('=') && !w.starts_with('-')) {
                if !targets.iter().any(|x| x == t) {
                    bad(format!("no Makefile target {t}"));
                }
            }
        }
        if let Some(at) = words.iter().position(|w| *w == "cargo") {
            let sub = words.get(at + 1).copied().unwrap_or("");
            let pkg_tools = words.windows(2).any(|p| p == ["-p", "epmem-tools"]);
            for (i, w) in words.iter().enumerate().skip(at) {
                let Some(name) = words.get(i + 1) else { continue };
                match (sub, *w) {
                    ("test", "--test") => {
                        let dir = if pkg_tools { "tools/tests" } else { "tests" };
                        if !r.join(dir).join(format!("{name}.rs")).is_file() {
                            bad(format!("no test {dir}/{name}.rs"));
                        }
                    }
                    ("bench", "--bench") => {
                        let here = r.join("benches").join(format!("{name}.rs")).is_file();
                        let tools = r.join("tools/benches").join(format!("{name}.rs")).is_file();
                        if !(here || tools && pkg_tools) {
                            bad(format!(
                                "no bench {name} in the package this selects (tools/ benches need `-p epmem-tools`)"
                            ));
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

fn doc_files() -> Vec<String> {
    let mut files = vec!["README.md".to_string()];
    let mut docs: Vec<String> = std::fs::read_dir(root().join("docs"))
        .expect("read docs/")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

#[test]
fn every_command_in_the_docs_exists() {
    let targets = makefile_targets();
    assert!(targets.iter().any(|t| t == "test") && targets.len() > 10, "Makefile targets misread: {targets:?}");
    let files = doc_files();
    let n: usize = files.iter().map(|f| commands(&read(&root().join(f))).len()).sum();
    assert!(n > 30, "found only {n} commands in the docs: the block parser is wrong");
    let mut problems = Vec::new();
    for f in &files {
        check_file(f, &targets, &mut problems);
    }
    assert!(problems.is_empty(), "commands in the docs that do not exist as shown:\n{}", problems.join("\n"));
}

#[test]
fn the_check_refuses_what_does_not_exist() {
    let md = "```sh\nmake no-such-target\npython3 scripts/bench_torch.py --shapes big \\\n  --no-such-flag\n\
              cargo bench --bench micro\n.carry/bin/bench_kv --json x --nope\n```\n";
    // check_file reads relative to the crate root: write the probe there under target/.
    let rel = format!("target/doc_commands_probe_{}.md", std::process::id());
    std::fs::write(root().join(&rel), md).unwrap();
    let mut problems = Vec::new();
    check_file(&rel, &makefile_targets(), &mut problems);
    let _ = std::fs::remove_file(root().join(&rel));
    let all = problems.join("\n");
    for want in [
        "no Makefile target no-such-target",
        "has no option --no-such-flag",
        "no bench micro",
        "bench_kv has no option --nope",
    ] {
        assert!(all.contains(want), "missed {want:?} in:\n{all}");
    }
    assert!(
        !all.contains("no option --shapes") && !all.contains("no option --json"),
        "a real flag was refused:\n{all}"
    );
}
