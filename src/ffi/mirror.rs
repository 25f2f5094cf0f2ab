//! The C mirrors of the core's stats and config structs, so the two cannot
//! drift.
//!
//! Stats (core → C): each stats struct is declared once, in its core module,
//! with `crate::stats::declare_stats!`; its `#[repr(C)]` struct and
//! conversion (`stats_to_c`) are generated from that declaration into a
//! committed `src/ffi/*_stats.rs`, since cbindgen reads source and cannot
//! expand macros. The `generated_stats` tests below fail when a committed
//! file differs from its declaration. Every C field is filled, from the
//! field or path its declaration names, and every core field is either seen
//! by C or declared `rust_only`.
//!
//! Configs (C → core): `config_in!` below generates the C defaults from the
//! core's and the conversion.

/// The input direction for config structs: one table per `#[repr(C)]`
/// config and the core config it sets, generating both the C defaults
/// (`epm_*_config_default`) and the conversion, from the core's own
/// defaults, so the two cannot drift. Each C field is named once, by how it
/// crosses:
/// - `copy { c_field: rust.path }`: the same number both ways (a C value
///   that does not fit the Rust type is INVALID_ARGUMENT);
/// - `zero_default { c_field: rust.path }`: the C default is 0, meaning "the
///   core's default"; a nonzero value replaces it;
/// - `flag { c_field: rust.path }`: a `u32`, nonzero for `true`;
/// - `enums { c_field: rust.path { C_CONST => Rust::Variant, ... } }`: the
///   default maps the core's variant to its constant (an exhaustive match,
///   so a variant without a constant does not compile), the conversion the
///   other way (an unknown value is INVALID_ARGUMENT naming the constants);
/// - `manual { c_field: c_default }`: its C default; the caller converts it
///   (required fields like a budget, or bit flags).
///
/// The generated default struct literal has no `..`, so a C field left out
/// of the table does not compile. Which core fields C does not reach is the
/// core's business (its config is larger). tests/header.rs checks that the
/// header's documented defaults are these.
macro_rules! config_in {
    (
        $(#[$dmeta:meta])*
        fn $default:ident() -> $c:ident;
        $(#[$ameta:meta])*
        fn $apply:ident(c: &$c2:ident, r: &mut $r:ty);
        defaults from $dflt:expr;
        manual { $($m:ident: $mv:expr),* $(,)? }
        copy { $($f:ident: $($p:ident).+),* $(,)? }
        zero_default { $($z:ident: $($zp:ident).+),* $(,)? }
        flag { $($b:ident: $($bp:ident).+),* $(,)? }
        enums { $($e:ident: $($ep:ident).+ { $($k:path => $v:path),+ $(,)? }),* $(,)? }
    ) => {
        $(#[$dmeta])*
        fn $default() -> $c {
            let d = $dflt;
            $c {
                size: std::mem::size_of::<$c>(),
                $($m: $mv,)*
                $($f: TryFrom::try_from(d.$($p).+).expect("a core default fits its C field"),)*
                $($z: 0,)*
                $($b: u32::from(d.$($bp).+),)*
                $($e: match d.$($ep).+ { $($v => $k,)+ },)*
            }
        }
        $(#[$ameta])*
        fn $apply(c: &$c2, r: &mut $r) -> $crate::error::Result<()> {
            $(
                r.$($p).+ = TryFrom::try_from(c.$f).map_err(|_| {
                    $crate::error::Error::invalid_argument(format!(
                        "cfg->{} {} is too large", stringify!($f), c.$f
                    ))
                })?;
            )*
            $(
                if c.$z != 0 {
                    r.$($zp).+ = TryFrom::try_from(c.$z).map_err(|_| {
                        $crate::error::Error::invalid_argument(format!(
                            "cfg->{} {} is too large", stringify!($z), c.$z
                        ))
                    })?;
                }
            )*
            $( r.$($bp).+ = c.$b != 0; )*
            $(
                r.$($ep).+ = match c.$e {
                    $($k => $v,)+
                    other => {
                        let known: Vec<String> = vec![$(format!("{} ({})", stringify!($k), $k)),+];
                        $crate::bail!(
                            InvalidArgument,
                            "cfg->{} {} is not one of {}", stringify!($e), other, known.join(", ")
                        )
                    }
                };
            )*
            Ok(())
        }
    };
}
pub(crate) use config_in;

/// The `#[repr(C)]` stats structs generated from their core declarations
/// (`declare_stats!`), committed as source because cbindgen reads source:
/// a test renders each and fails when the committed file differs;
/// `EPM_BLESS=1 cargo test --lib generated_stats` rewrites them (then
/// `EPM_BLESS=1 cargo test --test header` regenerates the header).
#[cfg(test)]
mod generated_stats {
    use crate::stats::CField;

    /// One generated C struct: its file, names, doc and fields.
    struct Spec {
        file: &'static str,
        c_name: &'static str,
        core_path: &'static str,
        core_name: &'static str,
        to_c: &'static str,
        doc: &'static [&'static str],
        fields: Vec<CField>,
    }

    fn specs() -> Vec<Spec> {
        vec![
            Spec {
                file: "src/ffi/residency_stats.rs",
                c_name: "EpmResidencyStats",
                core_path: "crate::residency::ResidencyStats",
                core_name: "ResidencyStats",
                to_c: "stats_to_c",
                doc: &[
                    " Counters of a residency manager, filled by `epm_residency_get_stats`;",
                    " versioned by `size`. Times lag until their events complete: call",
                    " `epm_residency_synchronize` first for final figures.",
                ],
                fields: crate::residency::stats::RESIDENCY_C_FIELDS.to_vec(),
            },
            Spec {
                file: "src/ffi/arena_stats.rs",
                c_name: "EpmArenaStats",
                core_path: "crate::arena::ArenaStats",
                core_name: "ArenaStats",
                to_c: "stats_to_c",
                doc: &[" Counters of an arena, filled by `epm_arena_get_stats`; versioned by `size`."],
                fields: crate::arena::ARENA_C_FIELDS.to_vec(),
            },
            Spec {
                file: "src/ffi/staging_stats.rs",
                c_name: "EpmStagingStats",
                core_path: "crate::staging::StagingStats",
                core_name: "StagingStats",
                to_c: "stats_to_c",
                doc: &[
                    " Counters of a copy engine and its pool (or of a pool alone: then the",
                    " engine fields are 0).",
                    "",
                    " Versioned by size: set `size = sizeof(EpmStagingStats)` first; epmem sets",
                    " it to the number of bytes it filled. Fields are only ever added at the end.",
                ],
                fields: crate::staging::stats::STAGING_C_FIELDS.to_vec(),
            },
            Spec {
                file: "src/ffi/kv_stats.rs",
                c_name: "EpmKvStats",
                core_path: "crate::kv::KvStats",
                core_name: "KvStats",
                to_c: "stats_to_c",
                doc: &[
                    " Ledger and pool statistics, filled by `epm_kv_pool_get_stats`.",
                    " Versioned by size: set `size = sizeof(EpmKvStats)`.",
                ],
                fields: crate::kv::pool::KV_C_FIELDS.to_vec(),
            },
        ]
    }

    fn render(s: &Spec) -> String {
        let mut o = String::new();
        o += &format!(
            "// @generated by `EPM_BLESS=1 cargo test --lib generated_stats` from the declaration of\n\
             // `{}` (`declare_stats!`): edit that, not this file.\n\n",
            s.core_name
        );
        o += &format!("use {};\n\n", s.core_path);
        for d in s.doc {
            o += &format!("///{d}\n");
        }
        o += &format!("#[repr(C)]\n#[derive(Debug, Clone, Copy, Default)]\npub struct {} {{\n", s.c_name);
        o += &format!("    /// In: `sizeof({})`. Out: bytes filled.\n    pub size: usize,\n", s.c_name);
        for f in &s.fields {
            for d in f.doc {
                o += &format!("    ///{d}\n");
            }
            o += &format!("    pub {}: {},\n", f.name, f.ty);
        }
        o += "}\n\n";
        o += &format!("/// `{}` as C sees it (`size` is set by `write_versioned`).\n", s.core_name);
        o += &format!("pub(crate) fn {}(s: &{}) -> {} {{\n", s.to_c, s.core_name, s.c_name);
        o += &format!("    {} {{\n        size: 0,\n", s.c_name);
        for f in &s.fields {
            o += &format!("        {}: s.{},\n", f.name, f.from.replace(' ', ""));
        }
        o += "    }\n}\n";
        o
    }

    #[test]
    fn generated_stats_structs_match_their_declarations() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for s in &specs() {
            let path = root.join(s.file);
            let want = render(s);
            if std::env::var_os("EPM_BLESS").is_some() {
                std::fs::write(&path, &want).unwrap();
                continue;
            }
            let have = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                have == want,
                "{} differs from its declaration: run EPM_BLESS=1 cargo test --lib generated_stats, \
                 then EPM_BLESS=1 cargo test --test header",
                s.file
            );
        }
    }

    /// The C struct holds every declared field in order, after `size`.
    #[test]
    fn residency_c_fields_are_the_c_struct() {
        use crate::ffi::residency_stats::EpmResidencyStats;
        use crate::residency::stats::RESIDENCY_C_FIELDS;
        let n = RESIDENCY_C_FIELDS.len();
        assert_eq!(std::mem::size_of::<EpmResidencyStats>(), 8 * (n + 1));
        assert_eq!(RESIDENCY_C_FIELDS[0].name, "acquires");
        assert_eq!(RESIDENCY_C_FIELDS[n - 1].name, "split_head_bytes");
    }

    /// The stream plan's counters reach C, each from its own field.
    #[test]
    fn plan_counters_reach_c() {
        use crate::ffi::residency_stats::stats_to_c;
        use crate::residency::ResidencyStats;
        let s = ResidencyStats {
            ring_bytes: 1,
            planned_resident_bytes: 2,
            ring_page_ins: 3,
            ring_weights: 4,
            plans: 5,
            dropped_rings: 6,
            split_weights: 7,
            split_head_bytes: 8,
            ..Default::default()
        };
        let c = stats_to_c(&s);
        let got = [
            c.ring_bytes,
            c.planned_resident_bytes,
            c.ring_page_ins,
            c.ring_weights,
            c.plans,
            c.dropped_rings,
            c.split_weights,
            c.split_head_bytes,
        ];
        assert_eq!(got, [1, 2, 3, 4, 5, 6, 7, 8]);
    }

    /// Each generated C struct is `size` and one 8-byte field per declared
    /// C field, in declaration order (so the frozen v1 sizes hold the first
    /// fields, checked by `versioned!` and ffi-tests/test_abi_v1.c).
    #[test]
    fn c_fields_are_the_c_structs() {
        use crate::ffi::{arena_stats::EpmArenaStats, kv_stats::EpmKvStats, staging_stats::EpmStagingStats};
        let cases = [
            (std::mem::size_of::<EpmArenaStats>(), crate::arena::ARENA_C_FIELDS, "driver_alloc_calls", "fragmentation"),
            (
                std::mem::size_of::<EpmStagingStats>(),
                crate::staging::stats::STAGING_C_FIELDS,
                "pinned_alloc_calls",
                "timed_copies",
            ),
            (std::mem::size_of::<EpmKvStats>(), crate::kv::pool::KV_C_FIELDS, "budget_bytes", "hash_hits"),
        ];
        for (size, fields, first, last) in cases {
            assert_eq!(size, 8 * (fields.len() + 1), "{first}..{last}");
            assert_eq!(fields[0].name, first);
            assert_eq!(fields[fields.len() - 1].name, last);
        }
    }

    /// The KV pool's nested snapshots reach C flattened, each C field from
    /// its own source (`fences` from `stream_waits`).
    #[test]
    fn kv_nested_counters_reach_c() {
        use crate::ffi::kv_stats::stats_to_c;
        use crate::kv::KvStats;
        let mut s = KvStats { granule_bytes: 9, batches: 99, mapped_bytes: 10, ..Default::default() };
        s.ledger.budget_bytes = 1;
        s.ledger.refusals = 2;
        s.pool.created = 3;
        s.pool.retained = 4;
        s.counters.cow_granules = 5;
        s.counters.stream_waits = 6;
        s.counters.hash_hits = 7;
        let c = stats_to_c(&s);
        let got = [
            c.budget_bytes,
            c.refusals,
            c.pool_created,
            c.pool_retained,
            c.cow_granules,
            c.fences,
            c.hash_hits,
            c.granule_bytes,
            c.mapped_bytes,
            c.owned_bytes,
        ];
        assert_eq!(got, [1, 2, 3, 4, 5, 6, 7, 9, 10, 0]);
    }
}
