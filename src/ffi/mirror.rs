//! One table per stats/config struct pair: the core's Rust struct and its
//! `#[repr(C)]` mirror, so the two cannot drift.
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
