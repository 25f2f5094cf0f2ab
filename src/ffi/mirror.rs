//! One table per stats/config struct pair: the core's Rust struct and its
//! `#[repr(C)]` mirror, so the two cannot drift. `mirror!` is the output
//! direction (stats, core → C); `config_in!` (below) the input direction
//! (configs: the C defaults from the core's, and C → core).
//!
//! The `#[repr(C)]` struct itself stays written out in its ffi file, with
//! its doc comments: cbindgen reads the source and cannot expand macros, so
//! a macro-generated struct would vanish from include/epmem.h. What the
//! table generates is the conversion, and with it three compile-time checks:
//! - every C field is filled, from a field of the same name and type
//!   (`same`) or from a named path (`mapped`), since the generated struct
//!   literal has no `..` (a C field added without a source does not compile);
//! - every field of the Rust struct is named once, as mirrored or as
//!   `rust_only` (an exhaustive destructuring, so a counter added to the core
//!   without a decision about C does not compile);
//! - the types agree (plain assignments).
//!
//! ```ignore
//! mirror! {
//!     /// ResidencyStats as C sees it.
//!     pub(crate) fn to_c(s: &ResidencyStats) -> EpmResidencyStats {
//!         size: 0;
//!         same { acquires, hits }
//!         mapped { arena_in_use_bytes: arena.in_use_bytes }
//!         rust_only { arena, ring_bytes }
//!     }
//! }
//! ```

macro_rules! mirror {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident(s: &$src:ident) -> $dst:ident {
            size: $size:expr;
            same { $($f:ident),* $(,)? }
            mapped { $($d:ident: $($p:ident).+),* $(,)? }
            rust_only { $($r:ident),* $(,)? }
        }
    ) => {
        $(#[$meta])*
        $vis fn $name(s: &$src) -> $dst {
            // Exhaustive: each field of the Rust struct is mirrored or declared rust_only.
            let $src { $($f: _,)* $($r: _,)* } = s;
            $dst { size: $size, $($f: s.$f,)* $($d: s.$($p).+,)* }
        }
    };
}
pub(crate) use mirror;

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
