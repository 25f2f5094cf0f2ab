//! Typed KV ids: [`SeqId`], [`PrefixId`], [`BatchId`].
//!
//! Each id is a generational u64 (slot index in the low 32 bits, generation
//! ≥ 1 in the high 32, so 0 is never an id) in its own type: a prefix id
//! where a sequence id is expected is a compile error, not a lookup that
//! might find a live sequence with the same bits
//! (tests/compile_fail/kv_ids/ proves it). C sees none of these: its
//! handles (`EpmKvSeq`, `EpmKvPrefix`, `EpmKvBatch`) are typed by the handle
//! table and hold the id inside.

use std::fmt;

/// What every KV id type is: a name for messages, and its packed bits.
pub trait KvId: Copy + Eq + std::hash::Hash + fmt::Debug + fmt::LowerHex {
    /// The object's name in messages ("KV sequence").
    const WHAT: &'static str;
    /// The packed (generation << 32 | slot) bits.
    fn bits(self) -> u64;
    /// An id from packed bits. Only the slab mints ids it hands out; an id
    /// made from arbitrary bits is looked up like any other (a clean
    /// InvalidHandle when nothing lives there).
    fn from_bits(bits: u64) -> Self;
}

macro_rules! kv_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(u64);

        impl KvId for $name {
            const WHAT: &'static str = $what;
            fn bits(self) -> u64 {
                self.0
            }
            fn from_bits(bits: u64) -> Self {
                Self(bits)
            }
        }

        impl $name {
            /// The packed bits (for logs and for tests of stale ids).
            pub fn bits(self) -> u64 {
                self.0
            }
            /// An id from packed bits; looking up one nothing lives at is
            /// a clean InvalidHandle.
            pub fn from_bits(bits: u64) -> Self {
                Self(bits)
            }
        }

        impl fmt::LowerHex for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::LowerHex::fmt(&self.0, f)
            }
        }
    };
}

kv_id!(
    /// A sequence of a [`super::KvPool`] (its own reservation or a batch slot).
    SeqId,
    "KV sequence"
);
kv_id!(
    /// A pinned (or still shared) prefix of a [`super::KvPool`].
    PrefixId,
    "KV prefix"
);
kv_id!(
    /// A batch reservation of a [`super::KvPool`].
    BatchId,
    "KV batch"
);
