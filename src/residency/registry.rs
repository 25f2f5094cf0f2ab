//! The weight registry: what each registered weight is and where it lives.
//!
//! A weight is a host range (pageable or page-locked). Its device copy, when
//! resident, is a [`Fenced`] block from the device arena. Sources can be
//! registered with the device (cuMemHostRegister, read-only) so page-ins copy
//! them directly: either a whole range up front ([`HostRangeId`]), or — by
//! default — each pageable weight's own range on its first page-in, while the
//! locked-memory limit allows.

use super::WeightId;
use super::read_fence::Fenced;
use super::ring::RingSlot;
use crate::device::HostRange;
use crate::error::Result;
use crate::staging::HostRegistration;
use crate::transfer::pinning::Attachment;

/// A whole host range registered once, so the weights inside it bypass staging.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostRangeId(pub u32);

/// When the manager registers a pageable weight's source with the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegisterSources {
    /// Never: pageable sources are always staged.
    Never,
    /// On first page-in, while the registered bytes stay within
    /// RLIMIT_MEMLOCK (the default). Registering costs ~40 ms per GiB once;
    /// DMA from the registered range then runs at the pinned peak (55 GB/s
    /// on the H200) instead of the ~65–70% a staged copy reaches, so a weight
    /// paged in every step repays it within a few steps.
    WithinMemlock,
    /// On first page-in, whatever the limit says; a refusal by the device
    /// still falls back to staging.
    Always,
}

/// Whether a weight's own source has been registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RegState {
    Untried,
    Registered,
    Refused,
}

/// A weight. Small weights adjacent in host memory and in the declared
/// cycle are coalesced into one *unit*, paged in by one copy into one block:
/// the unit's state (block, users, registration, prefetch) lives on its
/// leader, the first member; other members point at it.
#[derive(Debug)]
pub(crate) struct Entry {
    /// The weight's own bytes.
    pub range: HostRange,
    /// The unit this weight belongs to (itself when not coalesced).
    pub leader: WeightId,
    /// Byte offset of this weight in its unit.
    pub offset: usize,
    /// On a leader: what a page-in copies (its own range, or the group's).
    pub unit: HostRange,
    /// On a leader of a group: the other members, in order.
    pub members: Vec<WeightId>,
    /// Bytes `reg` registered.
    pub reg_bytes: usize,
    /// Where the unit's device bytes are (on a leader; `Host` on members).
    pub loc: Loc,
    /// Acquires not yet released.
    pub users: u32,
    pub reg: Option<HostRegistration>,
    pub reg_state: RegState,
    /// Paged in ahead of use and not acquired since.
    pub prefetched: bool,
    /// A compressed weight: `range` and `unit` are its compressed bytes,
    /// held here; a page-in copies them to device staging and decodes them
    /// into the weight's block (`super::decode`).
    pub coded: Option<Coded>,
}

/// Where a unit's device copy lives: one of the three, never two.
#[derive(Debug, Default)]
pub(crate) enum Loc {
    /// Not on the device.
    #[default]
    Host,
    /// In its own arena block, resident (or being paged in).
    Block(Fenced),
    /// At its offset in the streaming region, when a plan streams it.
    Ring(RingSlot),
}

impl Loc {
    /// The arena block, if the unit has one.
    pub fn block(&self) -> Option<&Fenced> {
        match self {
            Loc::Block(b) => Some(b),
            _ => None,
        }
    }
    pub fn is_block(&self) -> bool {
        matches!(self, Loc::Block(_))
    }
    pub fn is_ring(&self) -> bool {
        matches!(self, Loc::Ring(_))
    }
    /// Take the arena block out, leaving `Host`; a ring slot stays.
    pub fn take_block(&mut self) -> Option<Fenced> {
        match std::mem::take(self) {
            Loc::Block(b) => Some(b),
            other => {
                *self = other;
                None
            }
        }
    }
    /// Take the ring slot out, leaving `Host`; an arena block stays.
    pub fn take_ring(&mut self) -> Option<RingSlot> {
        match std::mem::take(self) {
            Loc::Ring(s) => Some(s),
            other => {
                *self = other;
                None
            }
        }
    }
}

/// The host copy of a compressed weight: page-locked and owned by the
/// manager (copied directly, never staged), and its description, parsed
/// (checksum included) or planned at registration.
#[derive(Debug)]
pub(crate) struct Coded {
    /// The frames end to end: each weight is stored in frames of
    /// [`crate::codec::FRAME_VALUES`] values (the last may hold fewer), each
    /// a compressed buffer; a caller's buffer of one frame is kept as given.
    pub buf: crate::device::PinnedBuffer,
    /// The weight as one compressed encoding (for a caller's buffer, the
    /// buffer's own): values, k, table, escapes.
    pub desc: crate::codec::DecodeDesc,
    pub frames: Vec<crate::codec::Frame>,
}

/// Weights by id (ids are never reused) and registered ranges.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    weights: Vec<Option<Entry>>,
    ranges: Vec<Option<RangeReg>>,
    live: usize,
    /// Page-in units: live weights that lead their own unit (coalesced
    /// members are not units). With the ledger's resident unit count it
    /// says, without a walk, whether every unit is on the device.
    units: usize,
}

/// A whole host range the manager copies from directly: registered by it, or
/// a shared registration (made once for several devices) it attached.
#[derive(Debug)]
pub(crate) enum RangeReg {
    Own(HostRegistration),
    Attached(Attachment),
}

impl RangeReg {
    pub fn range(&self) -> HostRange {
        match self {
            RangeReg::Own(r) => r.range(),
            RangeReg::Attached(a) => a.range(),
        }
    }
}

impl Entry {
    /// On the device (in an arena block or in the ring), or being paged in.
    pub fn resident(&self) -> bool {
        !matches!(self.loc, Loc::Host)
    }
    /// Bytes of the unit on the device (its share of the budget): the
    /// decoded length of a compressed weight, else the bytes copied.
    pub fn dev_len(&self) -> usize {
        self.coded.as_ref().map_or(self.unit.len(), |c| c.desc.raw_len())
    }
}

impl Registry {
    pub fn add(&mut self, range: HostRange) -> Result<WeightId> {
        crate::ensure!(
            !range.is_empty() && !range.ptr().is_null(),
            InvalidArgument,
            "a weight must be a non-empty host range (got {:p}, {} bytes)",
            range.ptr(),
            range.len()
        );
        crate::ensure!(self.weights.len() < u32::MAX as usize, OutOfBudget, "too many weights registered");
        let id = WeightId(self.weights.len() as u32);
        self.weights.push(Some(Entry {
            range,
            leader: id,
            offset: 0,
            unit: range,
            members: Vec::new(),
            reg_bytes: 0,
            loc: Loc::Host,
            users: 0,
            reg: None,
            reg_state: RegState::Untried,
            prefetched: false,
            coded: None,
        }));
        self.live += 1;
        self.units += 1;
        Ok(id)
    }
    /// A compressed weight: its copy source is `coded`'s buffer.
    pub fn add_coded(&mut self, coded: Coded) -> Result<WeightId> {
        let id = self.add(coded.buf.range())?;
        let e = self.get_mut(id)?;
        // Page-locked and owned: copied directly, never registered.
        e.reg_state = RegState::Registered;
        e.coded = Some(coded);
        Ok(id)
    }
    pub fn get(&self, w: WeightId) -> Result<&Entry> {
        self.weights.get(w.0 as usize).and_then(Option::as_ref).ok_or_else(|| unknown(w))
    }
    pub fn get_mut(&mut self, w: WeightId) -> Result<&mut Entry> {
        self.weights.get_mut(w.0 as usize).and_then(Option::as_mut).ok_or_else(|| unknown(w))
    }
    /// The leader of `w`'s unit (`w` itself when not coalesced).
    pub fn leader(&self, w: WeightId) -> Result<WeightId> {
        Ok(self.get(w)?.leader)
    }
    pub fn remove(&mut self, w: WeightId) -> Result<Entry> {
        let e = self.weights.get_mut(w.0 as usize).and_then(Option::take).ok_or_else(|| unknown(w))?;
        self.live -= 1;
        if e.leader == w {
            self.units -= 1;
        }
        Ok(e)
    }
    /// Registered weights.
    pub fn len(&self) -> usize {
        self.live
    }
    /// Page-in units (a coalesced group counts once).
    pub fn units(&self) -> usize {
        self.units
    }
    /// `n` weights joined another weight's unit (they were units of their own).
    pub fn note_grouped(&mut self, n: usize) {
        self.units -= n;
    }
    /// `n` members of a unit became units of their own again.
    pub fn note_ungrouped(&mut self, n: usize) {
        self.units += n;
    }
    pub fn ids(&self) -> impl Iterator<Item = WeightId> + '_ {
        self.weights.iter().enumerate().filter(|(_, e)| e.is_some()).map(|(i, _)| WeightId(i as u32))
    }
    pub fn add_range(&mut self, reg: RangeReg) -> HostRangeId {
        self.ranges.push(Some(reg));
        HostRangeId(self.ranges.len() as u32 - 1)
    }
    /// Panics if the units are inconsistent: every member points at a live
    /// leader that lists it, at an offset inside the leader's unit, and has
    /// no device copy, acquisition or prefetch of its own (those live on
    /// the leader).
    // Called after every mutation in debug builds only (and by tests).
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    pub fn check(&self) {
        let leaders =
            self.weights.iter().enumerate().filter(|(i, e)| e.as_ref().is_some_and(|e| e.leader.0 as usize == *i));
        assert_eq!(leaders.count(), self.units, "the unit count disagrees with the leaders");
        for (i, e) in self.weights.iter().enumerate() {
            let Some(e) = e else { continue };
            let w = WeightId(i as u32);
            if e.leader == w {
                for &m in &e.members {
                    assert_eq!(self.get(m).map(|x| x.leader).ok(), Some(w), "member {} of unit {}", m.0, w.0);
                }
                continue;
            }
            let l = self.get(e.leader).unwrap_or_else(|_| panic!("weight {}'s leader is not registered", w.0));
            assert!(l.members.contains(&w), "weight {} is not among its leader's members", w.0);
            assert!(e.offset + e.range.len() <= l.unit.len(), "weight {} lies outside its unit", w.0);
            assert!(matches!(e.loc, Loc::Host) && e.users == 0 && !e.prefetched, "member {} holds unit state", w.0);
        }
    }
    pub fn remove_range(&mut self, id: HostRangeId) -> Result<RangeReg> {
        self.ranges
            .get_mut(id.0 as usize)
            .and_then(Option::take)
            .ok_or_else(|| crate::error::Error::invalid_argument(format!("host range {} is not registered", id.0)))
    }
}

fn unknown(w: WeightId) -> crate::error::Error {
    crate::error::Error::invalid_argument(format!("weight {} is not registered (never, or unregistered)", w.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    static DATA: [u8; 64] = [7; 64];

    #[test]
    fn ids_are_never_reused_and_unknown_ids_are_errors() {
        let mut r = Registry::default();
        let a = r.add(HostRange::from_static(&DATA)).unwrap();
        let b = r.add(HostRange::from_static(&DATA[..8])).unwrap();
        r.remove(a).unwrap();
        let c = r.add(HostRange::from_static(&DATA)).unwrap();
        assert!(c != a && c != b);
        assert_eq!(r.get(a).unwrap_err().status(), crate::EpmStatus::InvalidArgument);
        assert_eq!(r.remove(a).unwrap_err().status(), crate::EpmStatus::InvalidArgument);
        assert_eq!(r.len(), 2);
        assert_eq!(r.ids().collect::<Vec<_>>(), vec![b, c]);
        assert!(r.add(HostRange::from_static(&DATA[..0])).is_err());
    }
}
