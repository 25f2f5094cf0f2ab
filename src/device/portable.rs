//! Portable registrations of the whole process: what CUDA's
//! `CU_MEMHOSTREGISTER_PORTABLE` means ("pinned for every context, not just
//! the one that registered it"), kept as a table so every device of a kind
//! answers `host_is_page_locked` for them, refuses a second registration of
//! the same bytes, and guards a read-only one against D2H writes. The host
//! device needs the table to behave like CUDA; the CUDA device needs it
//! because its own table only knows what it registered itself.
//!
//! The registrations themselves (`SharedHostRegistration`) are in
//! `transfer/pinning.rs`; this table is what the devices consult, so it lives
//! in the device layer.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::device::DeviceKind;

#[derive(Debug, Clone, Copy)]
struct Entry {
    len: usize,
    read_only: bool,
    kind: DeviceKind,
    /// Which device instance registered it (only it may unregister it).
    owner: u64,
}

static TABLE: Mutex<BTreeMap<usize, Entry>> = Mutex::new(BTreeMap::new());

fn table() -> std::sync::MutexGuard<'static, BTreeMap<usize, Entry>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Entries of `kind` overlapping `[p, end)`, last first.
fn overlapping(t: &BTreeMap<usize, Entry>, kind: DeviceKind, p: usize, end: usize) -> Vec<(usize, Entry)> {
    t.range(..end)
        .rev()
        .take_while(|(s, e)| *s + e.len > p)
        .filter(|(_, e)| e.kind == kind)
        .map(|(s, e)| (*s, *e))
        .collect()
}

/// Record a portable registration; refused if it overlaps another.
pub fn insert(kind: DeviceKind, owner: u64, p: usize, len: usize, read_only: bool) -> crate::Result<()> {
    let end = p.checked_add(len).ok_or_else(|| crate::Error::invalid_argument("host range wraps around"))?;
    let mut t = table();
    crate::ensure!(
        overlapping(&t, kind, p, end).is_empty(),
        InvalidState,
        "host range {p:#x}+{len} overlaps a portable registration already made (by any {} device)",
        kind.name()
    );
    t.insert(p, Entry { len, read_only, kind, owner });
    Ok(())
}

/// Forget the registration at `p` made by `owner`; false if there is none.
pub fn remove(kind: DeviceKind, owner: u64, p: usize) -> bool {
    let mut t = table();
    if t.get(&p).is_some_and(|e| e.kind == kind && e.owner == owner) {
        t.remove(&p);
        true
    } else {
        false
    }
}

/// Whether one portable registration of `kind` holds all of `[p, p+len)`.
pub fn contains(kind: DeviceKind, p: usize, len: usize) -> bool {
    let Some(end) = p.checked_add(len.max(1)) else { return false };
    p != 0 && table().range(..=p).next_back().is_some_and(|(s, e)| e.kind == kind && end <= s + e.len)
}

/// Whether `[p, p+len)` overlaps any portable registration of `kind`.
pub fn overlaps(kind: DeviceKind, p: usize, len: usize) -> bool {
    !overlapping(&table(), kind, p, p.saturating_add(len.max(1))).is_empty()
}

/// Whether `[p, p+len)` overlaps a read-only portable registration of `kind`.
pub fn overlaps_read_only(kind: DeviceKind, p: usize, len: usize) -> bool {
    overlapping(&table(), kind, p, p.saturating_add(len.max(1))).iter().any(|(_, e)| e.read_only)
}
