//! docs/ABI.md's "Index of the header" names every function, type and
//! constant of include/epmem.h and include/epmem_testing.h, each once, with a
//! line saying what it is; and it names nothing the headers lack. A new
//! exported name fails here with the exact line to add and the heading to add
//! it under.
//!
//!   cargo test --test header_index

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

const BEGIN: &str = "<!-- header-index:begin -->";
const END: &str = "<!-- header-index:end -->";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"))
}

fn ident_at(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The first sentence of the `/** ... */` comment that ends on the line
/// before `decl` (empty when there is none).
fn doc_before(lines: &[&str], decl: usize) -> String {
    let mut text = Vec::new();
    let mut i = decl;
    while i > 0 {
        i -= 1;
        let t = lines[i].trim();
        if t == "*/" {
            continue;
        }
        if t.starts_with("/**") {
            break;
        }
        if !t.starts_with('*') {
            return String::new();
        }
        text.push(t.trim_start_matches('*').trim());
    }
    text.reverse();
    let joined = text.join(" ");
    let joined = joined.trim();
    let end = joined.find(". ").map(|i| i + 1).unwrap_or(joined.len());
    joined[..end].to_string()
}

/// Every exported name of one generated header, with the first sentence of
/// its comment: functions (`epm_*`), types (`Epm*`: structs, enums,
/// handles, typedefs, callbacks) and constants (`#define EPM_*`).
fn header_names(rel: &str) -> BTreeMap<String, String> {
    let src = read(rel);
    let lines: Vec<&str> = src.lines().collect();
    let mut out = BTreeMap::new();
    for (i, line) in lines.iter().enumerate() {
        if let Some(rest) = line.strip_prefix("#define ") {
            let name = ident_at(rest);
            if name.starts_with("EPM_") {
                out.entry(name.to_string()).or_insert_with(|| doc_before(&lines, i));
            }
            continue;
        }
        if line.starts_with([' ', '\t', '/', '*', '#']) || line.is_empty() {
            continue;
        }
        if line.starts_with("typedef") {
            let name = if let Some(p) = line.find("(*") {
                ident_at(&line[p + 2..]).to_string()
            } else if line.trim_end().ends_with('{') {
                // `typedef struct EpmX {` / `typedef enum EpmX {`
                line.split_whitespace().nth(2).unwrap_or("").to_string()
            } else {
                // `typedef struct EpmX EpmX;`, `typedef uint64_t EpmX;`
                let decl = line.trim_end().trim_end_matches(';');
                decl.rsplit(' ').next().unwrap_or("").to_string()
            };
            if name.starts_with("Epm") {
                out.entry(name).or_insert_with(|| doc_before(&lines, i));
            }
            continue;
        }
        // A function declaration starts at column 0; its name is the `epm_`
        // identifier followed by `(`.
        let mut rest = *line;
        while let Some(p) = rest.find("epm_") {
            let name = ident_at(&rest[p..]);
            if rest[p + name.len()..].starts_with('(')
                && (p == 0 || !rest[..p].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_'))
            {
                out.entry(name.to_string()).or_insert_with(|| doc_before(&lines, i));
                break;
            }
            rest = &rest[p + name.len().max(4)..];
        }
    }
    out
}

/// One index entry: the name, its heading and its description.
struct Entry {
    name: String,
    heading: String,
    text: String,
}

/// The entries between the markers of docs/ABI.md: lines `- \`name\` — text`
/// under `### heading` lines.
fn index_entries(abi_md: &str) -> Vec<Entry> {
    let begin = abi_md.find(BEGIN).expect("docs/ABI.md has no `<!-- header-index:begin -->` marker");
    let end = abi_md.find(END).expect("docs/ABI.md has no `<!-- header-index:end -->` marker");
    assert!(begin < end, "docs/ABI.md: the header-index markers are out of order");
    let mut heading = String::new();
    let mut out = Vec::new();
    for line in abi_md[begin..end].lines() {
        if let Some(h) = line.strip_prefix("### ") {
            heading = h.trim().to_string();
        } else if let Some(rest) = line.strip_prefix("- `") {
            let close =
                rest.find('`').unwrap_or_else(|| panic!("docs/ABI.md index line without a closing backtick: {line}"));
            let text = rest[close + 1..].trim_start().trim_start_matches('—').trim().to_string();
            out.push(Entry { name: rest[..close].to_string(), heading: heading.clone(), text });
        }
    }
    out
}

/// The heading a new name most likely belongs under, by its prefix.
fn suggested_heading(name: &str, testing: bool) -> &'static str {
    let n = name.to_ascii_lowercase();
    let has = |p: &str| n.starts_with(p);
    if testing {
        "Test machinery (`include/epmem_testing.h`)"
    } else if has("epm_version")
        || has("epm_status")
        || has("epm_last_error")
        || has("epm_set_log")
        || has("epmlog")
        || has("epmstatus")
    {
        "Version, status and logging"
    } else if has("epm_device_alloc")
        || has("epm_device_free")
        || has("epm_memcpy")
        || has("epm_memset")
        || has("epmdeviceptr")
    {
        "Device memory and copies"
    } else if has("epm_device") || has("epmdevice") || has("epm_pci") {
        "Devices"
    } else if has("epm_stream") || has("epm_event") || has("epmstream") || has("epmevent") {
        "Streams and events"
    } else if has("epm_arena") || has("epmarena") {
        "Arenas"
    } else if has("epm_staging")
        || has("epm_copy_engine")
        || has("epm_fence")
        || has("epm_host_registration")
        || has("epmstaging")
        || has("epmcopyengine")
        || has("epmfence")
        || has("epmhostregistration")
    {
        "Staging pool, copy engine and fences"
    } else if has("epm_residency")
        || has("epm_shared_host")
        || has("epm_policy")
        || has("epm_register")
        || has("epm_fill_ahead")
        || has("epmresidency")
        || has("epmweightid")
        || has("epmhostrangeid")
        || has("epmsharedhost")
    {
        "Weight residency"
    } else if has("epm_kv_batch") || has("epmkvbatch") {
        "KV batches"
    } else if has("epm_kv") || has("epmkv") {
        "KV pool, sequences and prefixes"
    } else {
        "the concept it belongs to (add a `### heading` if it is a new one)"
    }
}

/// What the index lacks and what it names that no header has, as the
/// message the test prints; `None` when they agree.
fn compare(headers: &[(&str, BTreeMap<String, String>)], entries: &[Entry]) -> Option<String> {
    let mut msg = String::new();
    let indexed: BTreeSet<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    let mut missing: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (rel, names) in headers {
        let testing = rel.ends_with("epmem_testing.h");
        for (name, doc) in names {
            if !indexed.contains(name.as_str()) {
                let text = if doc.is_empty() { "<what it is, in one line>".to_string() } else { doc.clone() };
                missing.entry(suggested_heading(name, testing)).or_default().push(format!("- `{name}` — {text}"));
            }
        }
    }
    if !missing.is_empty() {
        let n: usize = missing.values().map(Vec::len).sum();
        msg.push_str(&format!(
            "docs/ABI.md's header index lacks {n} exported name(s). Add each line below under its `### heading`, \
             between `{BEGIN}` and `{END}` (shorten the description to one line if it is long):\n"
        ));
        for (heading, lines) in &missing {
            msg.push_str(&format!("\n### {heading}\n"));
            for l in lines {
                msg.push_str(l);
                msg.push('\n');
            }
        }
    }
    let all: BTreeSet<&str> = headers.iter().flat_map(|(_, m)| m.keys().map(String::as_str)).collect();
    let stale: Vec<&str> = indexed.iter().copied().filter(|n| !all.contains(n)).collect();
    if !stale.is_empty() {
        msg.push_str(&format!(
            "\ndocs/ABI.md's header index names {} name(s) neither header declares (renamed or removed? \
             update or delete their lines): {}\n",
            stale.len(),
            stale.join(", ")
        ));
    }
    let mut seen = BTreeSet::new();
    for e in entries {
        if !seen.insert(e.name.as_str()) {
            msg.push_str(&format!(
                "\ndocs/ABI.md's header index lists `{}` twice (keep it under one heading)\n",
                e.name
            ));
        }
        if e.text.is_empty() {
            msg.push_str(&format!("\ndocs/ABI.md's header index line for `{}` has no description\n", e.name));
        }
        if e.heading.is_empty() {
            msg.push_str(&format!(
                "\ndocs/ABI.md's header index line for `{}` comes before any `### heading`\n",
                e.name
            ));
        }
    }
    (!msg.is_empty()).then_some(msg)
}

fn headers() -> Vec<(&'static str, BTreeMap<String, String>)> {
    ["include/epmem.h", "include/epmem_testing.h"].into_iter().map(|h| (h, header_names(h))).collect()
}

#[test]
fn every_exported_name_is_in_the_abi_index() {
    let headers = headers();
    let (main, testing) = (&headers[0].1, &headers[1].1);
    // The parser must see the header as it is, or this test could pass on nothing.
    let functions = main.keys().filter(|n| n.starts_with("epm_")).count();
    assert!(functions >= 100, "parsed only {functions} functions from include/epmem.h: the parser is wrong");
    for name in [
        "epm_device_open",
        "EpmResidencyConfig",
        "EpmLogCallback",
        "EpmDevicePtr",
        "EpmKvPool",
        "EPM_VERSION",
        "EPM_KV_BATCH_ANY_SLOT",
    ] {
        assert!(main.contains_key(name), "the parser missed {name} in include/epmem.h");
    }
    assert!(
        testing.contains_key("epm_gate_open") && testing.contains_key("EpmGate"),
        "the parser missed the testing header's names"
    );
    assert!(!main.contains_key("epm_gate_open"), "a testing function leaked into include/epmem.h");
    assert!(main["epm_device_open"].starts_with("Open device"), "doc parsing broke: {:?}", main["epm_device_open"]);

    let entries = index_entries(&read("docs/ABI.md"));
    if let Some(msg) = compare(&headers, &entries) {
        panic!("{msg}");
    }
}

#[test]
fn the_check_reports_a_missing_name_with_its_line_and_heading() {
    let headers = headers();
    let abi = read("docs/ABI.md");
    let without: String =
        abi.lines().filter(|l| !l.starts_with("- `epm_residency_prefetch`")).map(|l| format!("{l}\n")).collect();
    let msg = compare(&headers, &index_entries(&without)).expect("removing an index line must fail the check");
    assert!(
        msg.contains("### Weight residency\n- `epm_residency_prefetch` — Page in `weights`"),
        "unhelpful message:\n{msg}"
    );

    let extra = abi.replacen(END, &format!("- `epm_no_such_function` — gone\n{END}"), 1);
    let msg = compare(&headers, &index_entries(&extra)).expect("a name no header has must fail the check");
    assert!(msg.contains("epm_no_such_function"), "unhelpful message:\n{msg}");
}
