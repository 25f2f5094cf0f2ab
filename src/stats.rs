//! One declaration per stats struct: [`declare_stats!`] turns a list of
//! fields into the core's snapshot struct, optionally its plain counters
//! struct, and (in tests) the field list of its `#[repr(C)]` mirror, from
//! which `src/ffi/mirror.rs` generates and checks the committed
//! `src/ffi/*_stats.rs` (the C struct and its conversion: cbindgen reads
//! source, so the C struct cannot be macro output).
//!
//! Each module keeps and reports its own counters; this module holds only
//! the generator.

/// One field of a stats struct as C sees it: its name, its Rust type, the
/// path it is read from in the core's struct, and its doc lines.
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CField {
    pub name: &'static str,
    pub ty: &'static str,
    pub from: &'static str,
    pub doc: &'static [&'static str],
}

/// Declares a stats struct once. Each field is one line, with a kind that
/// says where it lives:
/// - `field`: a field of the snapshot and of the C struct;
/// - `counter`: a `field` that is also one of the plain counters (only in
///   the form that declares a counters struct);
/// - `raw`: a plain counter the snapshot converts (nanoseconds to
///   milliseconds): the counters struct only;
/// - `rust_only`: the snapshot only (C may see parts of it through `c_only`);
/// - `c_only name: type = path`: a C field read from a path of the snapshot.
///
/// The fields C sees appear in the C struct in declaration order, so a new
/// one goes at the end (docs/ABI.md). The snapshot derives `Debug, Clone,
/// Copy, Default, PartialEq` (more derives may be added with its
/// attributes).
///
/// ```ignore
/// declare_stats! {
///     /// A snapshot of one arena.
///     pub struct ArenaStats;
///     /// The fields of `EpmArenaStats` after `size`, in C order.
///     const ARENA_C_FIELDS;
///     {
///         /// Physical allocations made by the arena.
///         field driver_alloc_calls: u64,
///     }
/// }
/// ```
///
/// With `pub(crate) struct Counters;` after the snapshot's name, the
/// `counter` and `raw` fields also make a plain counters struct.
macro_rules! declare_stats {
    (
        $(#[$smeta:meta])*
        pub struct $S:ident;
        $(#[$cmeta:meta])*
        pub(crate) struct $C:ident;
        $(#[$fmeta:meta])*
        const $F:ident;
        { $($body:tt)* }
    ) => {
        $crate::stats::declare_stats!(@munch [$(#[$smeta])* $S] [$(#[$cmeta])* $C] [$(#[$fmeta])* $F]
            [] [] [] $($body)*);
    };
    (
        $(#[$smeta:meta])*
        pub struct $S:ident;
        $(#[$fmeta:meta])*
        const $F:ident;
        { $($body:tt)* }
    ) => {
        $crate::stats::declare_stats!(@munch [$(#[$smeta])* $S] [] [$(#[$fmeta])* $F] [] [] [] $($body)*);
    };
    (@munch $s:tt [$($c:tt)+] $f:tt [$($sf:tt)*] [$($cf:tt)*] [$($m:tt)*]
        $(#[doc = $d:literal])* counter $n:ident: $t:ty, $($rest:tt)*) => {
        $crate::stats::declare_stats!(@munch $s [$($c)+] $f [$($sf)* $(#[doc = $d])* pub $n: $t,]
            [$($cf)* pub $n: $t,]
            [$($m)* $crate::stats::CField {
                name: stringify!($n), ty: stringify!($t), from: stringify!($n), doc: &[$($d),*]
            },]
            $($rest)*);
    };
    (@munch $s:tt $c:tt $f:tt [$($sf:tt)*] [$($cf:tt)*] [$($m:tt)*]
        $(#[doc = $d:literal])* field $n:ident: $t:ty, $($rest:tt)*) => {
        $crate::stats::declare_stats!(@munch $s $c $f [$($sf)* $(#[doc = $d])* pub $n: $t,] [$($cf)*]
            [$($m)* $crate::stats::CField {
                name: stringify!($n), ty: stringify!($t), from: stringify!($n), doc: &[$($d),*]
            },]
            $($rest)*);
    };
    (@munch $s:tt [$($c:tt)+] $f:tt [$($sf:tt)*] [$($cf:tt)*] [$($m:tt)*]
        $(#[doc = $d:literal])* raw $n:ident: $t:ty, $($rest:tt)*) => {
        $crate::stats::declare_stats!(@munch $s [$($c)+] $f [$($sf)*] [$($cf)* $(#[doc = $d])* pub $n: $t,]
            [$($m)*] $($rest)*);
    };
    (@munch $s:tt $c:tt $f:tt [$($sf:tt)*] [$($cf:tt)*] [$($m:tt)*]
        $(#[doc = $d:literal])* rust_only $n:ident: $t:ty, $($rest:tt)*) => {
        $crate::stats::declare_stats!(@munch $s $c $f [$($sf)* $(#[doc = $d])* pub $n: $t,] [$($cf)*]
            [$($m)*] $($rest)*);
    };
    (@munch $s:tt $c:tt $f:tt [$($sf:tt)*] [$($cf:tt)*] [$($m:tt)*]
        $(#[doc = $d:literal])* c_only $n:ident: $t:ty = $($p:ident).+, $($rest:tt)*) => {
        $crate::stats::declare_stats!(@munch $s $c $f [$($sf)*] [$($cf)*]
            [$($m)* $crate::stats::CField {
                name: stringify!($n), ty: stringify!($t), from: stringify!($($p).+), doc: &[$($d),*]
            },]
            $($rest)*);
    };
    (@munch [$(#[$smeta:meta])* $S:ident] [$($c:tt)*] [$(#[$fmeta:meta])* $F:ident]
        [$($sf:tt)*] [$($cf:tt)*] [$($m:tt)*]) => {
        $(#[$smeta])*
        #[derive(Debug, Clone, Copy, Default, PartialEq)]
        pub struct $S { $($sf)* }

        $crate::stats::declare_stats!(@counters [$($c)*] { $($cf)* });

        $(#[$fmeta])*
        #[cfg(test)]
        pub(crate) const $F: &[$crate::stats::CField] = &[$($m)*];
    };
    (@counters [] { }) => {};
    (@counters [$(#[$cmeta:meta])* $C:ident] { $($cf:tt)* }) => {
        $(#[$cmeta])*
        #[derive(Debug, Default, Clone, Copy)]
        pub(crate) struct $C { $($cf)* }
    };
}
pub(crate) use declare_stats;
