//! Allocator options: what `CreateSharedAllocator(..., options)` may pass.
//!
//! Keys in epmem's namespace (`epmem.`) are checked: an unknown one or a
//! value we cannot parse is an error naming the key and the accepted forms,
//! never silently ignored (a typo in a memory limit should not become "no
//! limit"). ORT's arena keys (`arena.`) are refused. Any other key is ORT's
//! own bookkeeping (ORT 1.32 adds `ep_instance_id` to session allocators)
//! and is left alone.

use crate::error::Result;

/// The byte limit of one allocator.
pub const OPT_ARENA_BYTES: &str = "epmem.arena_bytes";

const EPMEM_PREFIX: &str = "epmem.";

/// ORT's own arena keys: refused with a pointer to ours, because epmem
/// brings its own arena and ORT's BFC settings would not mean anything here.
const ORT_ARENA_PREFIX: &str = "arena.";

/// Parsed allocator options.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorOptions {
    /// Most bytes this allocator may have in use at once (None: the
    /// memory's own size). Allocations past it fail (Alloc returns NULL).
    pub arena_bytes: Option<u64>,
}

impl AllocatorOptions {
    /// Parse ORT's key-value entries.
    pub fn parse(entries: &[(String, String)]) -> Result<Self> {
        let mut o = Self::default();
        for (k, v) in entries {
            match k.as_str() {
                OPT_ARENA_BYTES => {
                    let n = parse_bytes(v).map_err(|why| {
                        crate::error::Error::invalid_argument(format!(
                            "allocator option {OPT_ARENA_BYTES}={v:?}: {why}; expected a positive byte count such as 268435456, 256MiB or 1GiB"
                        ))
                    })?;
                    o.arena_bytes = Some(n);
                }
                k if k.starts_with(ORT_ARENA_PREFIX) => crate::bail!(
                    InvalidArgument,
                    "allocator option {k:?} is an ONNX Runtime arena setting; epmem brings its own arena, size it with {OPT_ARENA_BYTES}"
                ),
                k if k.starts_with(EPMEM_PREFIX) => {
                    crate::bail!(InvalidArgument, "unknown allocator option {k:?}; epmem accepts {OPT_ARENA_BYTES}")
                }
                _ => {}
            }
        }
        Ok(o)
    }
}

/// "1048576", "64KiB", "256MiB", "2GiB" (also K/M/G, KB/MB/GB as binary units).
pub(crate) fn parse_bytes(s: &str) -> std::result::Result<u64, &'static str> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err("not a number");
    }
    let n: u64 = num.parse().map_err(|_| "number too large")?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err("unknown unit"),
    };
    let bytes = n.checked_mul(1u64 << shift).ok_or("number too large")?;
    if bytes == 0 {
        return Err("must be greater than zero");
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::EpmStatus;

    fn kv(k: &str, v: &str) -> Vec<(String, String)> {
        vec![(k.to_string(), v.to_string())]
    }

    #[test]
    fn accepts_byte_counts_with_units() {
        assert_eq!(AllocatorOptions::parse(&[]).unwrap().arena_bytes, None);
        assert_eq!(AllocatorOptions::parse(&kv(OPT_ARENA_BYTES, "4096")).unwrap().arena_bytes, Some(4096));
        assert_eq!(AllocatorOptions::parse(&kv(OPT_ARENA_BYTES, "256MiB")).unwrap().arena_bytes, Some(256 << 20));
        assert_eq!(AllocatorOptions::parse(&kv(OPT_ARENA_BYTES, " 2g ")).unwrap().arena_bytes, Some(2 << 30));
    }

    #[test]
    fn rejects_bad_values_with_the_key_in_the_message() {
        for bad in ["", "lots", "0", "-5", "12XB", "99999999999999999999", "1.5GiB", "16777216TiB"] {
            let e = AllocatorOptions::parse(&kv(OPT_ARENA_BYTES, bad)).unwrap_err();
            assert_eq!(e.status(), EpmStatus::InvalidArgument, "{bad}");
            assert!(e.message().contains(OPT_ARENA_BYTES), "{bad}: {e}");
        }
    }

    #[test]
    fn rejects_unknown_and_ort_arena_keys() {
        let e = AllocatorOptions::parse(&kv("epmem.arena_size", "1")).unwrap_err();
        assert!(e.message().contains("unknown allocator option \"epmem.arena_size\""), "{e}");
        let e = AllocatorOptions::parse(&kv("arena.max_mem", "1")).unwrap_err();
        assert!(e.message().contains("brings its own arena"), "{e}");
    }

    #[test]
    fn leaves_ort_bookkeeping_keys_alone() {
        let o =
            AllocatorOptions::parse(&[("ep_instance_id".into(), "3".into()), (OPT_ARENA_BYTES.into(), "1KiB".into())])
                .unwrap();
        assert_eq!(o.arena_bytes, Some(1024));
    }
}
