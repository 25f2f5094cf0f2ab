//! The budget's books: bytes the resident units, the streaming region and
//! the decode staging take of `budget_bytes`.
//!
//! Invariant ([`Ledger::check`]): the decode staging reserve is
//! `DECODE_STAGING_BUFFERS` × its per-buffer size and leaves part of the
//! budget; resident bytes (units in their own blocks, at their unit's
//! device length, plus the streaming region's capacity) stay within what the
//! reserve leaves; the peak is at least the current figure.

use super::decode::DECODE_STAGING_BUFFERS;

#[derive(Debug)]
pub(super) struct Ledger {
    budget_bytes: usize,
    resident_bytes: usize,
    peak_resident_bytes: usize,
    resident_weights: usize,
    staging_cap: usize,
    staging_reserve: usize,
}

impl Ledger {
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            budget_bytes,
            resident_bytes: 0,
            peak_resident_bytes: 0,
            resident_weights: 0,
            staging_cap: 0,
            staging_reserve: 0,
        }
    }
    /// The bytes weights may take: the budget less the decode staging.
    pub fn budget(&self) -> usize {
        self.budget_bytes - self.staging_reserve
    }
    pub fn resident_bytes(&self) -> usize {
        self.resident_bytes
    }
    pub fn peak_resident_bytes(&self) -> usize {
        self.peak_resident_bytes
    }
    pub fn resident_weights(&self) -> usize {
        self.resident_weights
    }
    /// Bytes per decode staging buffer.
    pub fn staging_cap(&self) -> usize {
        self.staging_cap
    }
    /// Budget bytes the decode staging reserves.
    pub fn staging_reserve(&self) -> usize {
        self.staging_reserve
    }
    /// A unit of `len` bytes paged into its own block.
    pub fn charge_block(&mut self, len: usize) {
        self.resident_bytes += len;
        self.resident_weights += 1;
        self.peak_resident_bytes = self.peak_resident_bytes.max(self.resident_bytes);
    }
    /// A unit of `len` bytes left its own block.
    pub fn credit_block(&mut self, len: usize) {
        self.resident_bytes -= len;
        self.resident_weights -= 1;
    }
    /// A unit paged into the streaming region (whose bytes are charged whole).
    pub fn charge_ring_unit(&mut self) {
        self.resident_weights += 1;
    }
    /// A unit left the streaming region.
    pub fn credit_ring_unit(&mut self) {
        self.resident_weights -= 1;
    }
    /// A streaming region of `cap` bytes was installed.
    pub fn charge_ring(&mut self, cap: usize) {
        self.resident_bytes += cap;
        self.peak_resident_bytes = self.peak_resident_bytes.max(self.resident_bytes);
    }
    /// The streaming region of `cap` bytes went back.
    pub fn credit_ring(&mut self, cap: usize) {
        self.resident_bytes -= cap;
    }
    /// The decode staging is now `cap` bytes per buffer, reserving `reserve`.
    pub fn set_staging(&mut self, cap: usize, reserve: usize) {
        self.staging_cap = cap;
        self.staging_reserve = reserve;
    }

    /// Panics if the invariant in the module docs does not hold.
    // Called after every mutation in debug builds only (and by tests).
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    pub fn check(&self) {
        assert_eq!(self.staging_reserve, DECODE_STAGING_BUFFERS * self.staging_cap, "{self:?}");
        assert!(self.staging_reserve == 0 || self.staging_reserve < self.budget_bytes, "{self:?}");
        assert!(self.resident_bytes <= self.budget(), "resident bytes over the budget: {self:?}");
        assert!(self.resident_bytes <= self.peak_resident_bytes, "{self:?}");
    }
}
