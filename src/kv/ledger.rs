//! The KV ledger: a budget over physical bytes.
//!
//! Two axes share one budget:
//! - `owned`: physical granules with at least one reference. A granule is
//!   charged when its reference count goes 0→1 and credited on 1→0, so a
//!   granule mapped into N sequences is counted once.
//! - `promised`: bytes admitted sequences may still claim (their worst-case
//!   private granules not yet committed). Admission moves budget into
//!   `promised`; committing a granule for an admitted sequence moves it from
//!   `promised` to `owned`, so an admitted sequence never runs out of budget
//!   half-way through its decode.
//!
//! Invariant: `owned + promised <= budget`, neither axis ever negative, and a
//! granule is never charged twice. A violation is a bug in epmem and returns
//! [`EpmStatus::Internal`](crate::EpmStatus::Internal) instead of corrupting the books.

use std::collections::HashMap;

use crate::error::Result;

/// Identifies one physical granule for the ledger's double-count check.
pub type GranuleKey = u32;

/// A snapshot of the ledger.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerStats {
    pub budget_bytes: u64,
    /// Physical bytes of granules with at least one reference.
    pub owned_bytes: u64,
    /// Budget admitted sequences may still claim.
    pub promised_bytes: u64,
    /// Highest `owned_bytes` seen.
    pub peak_owned_bytes: u64,
    /// Granules currently charged.
    pub owned_granules: u64,
    /// 0→1 transitions (charges) and 1→0 transitions (credits), monotonic.
    pub charges: u64,
    pub credits: u64,
    /// Requests refused with OutOfBudget.
    pub refusals: u64,
}

#[derive(Debug)]
pub struct Ledger {
    budget: u64,
    owned: u64,
    promised: u64,
    peak: u64,
    charges: u64,
    credits: u64,
    refusals: u64,
    /// Bytes charged per granule: proves "never twice" and "credit = charge".
    charged: HashMap<GranuleKey, u64>,
}

impl Ledger {
    pub fn new(budget: u64) -> Self {
        Self { budget, owned: 0, promised: 0, peak: 0, charges: 0, credits: 0, refusals: 0, charged: HashMap::new() }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Budget not yet owned or promised.
    pub fn headroom(&self) -> u64 {
        self.budget.saturating_sub(self.owned + self.promised)
    }

    /// Count a refusal and build its OutOfBudget error.
    pub fn refuse(&mut self, what: &str, bytes: u64) -> crate::Error {
        self.refusals += 1;
        crate::Error::new(
            crate::EpmStatus::OutOfBudget,
            format!(
                "KV ledger cannot hold {what} of {bytes} bytes: budget {}, owned {}, promised {}",
                self.budget, self.owned, self.promised
            ),
        )
    }

    /// Set aside `bytes` for an admitted sequence, or refuse with OutOfBudget.
    pub fn promise(&mut self, bytes: u64) -> Result<()> {
        if bytes > self.headroom() {
            return Err(self.refuse("an admission", bytes));
        }
        self.promised += bytes;
        Ok(())
    }

    /// Return unused promised bytes (a sequence ended or its need shrank).
    pub fn unpromise(&mut self, bytes: u64) -> Result<()> {
        crate::ensure!(
            bytes <= self.promised,
            Internal,
            "ledger: returning {bytes} promised bytes but only {} are promised",
            self.promised
        );
        self.promised -= bytes;
        Ok(())
    }

    /// Whether `bytes` more can be charged; `from_promise` bytes of them come
    /// out of an existing promise.
    pub fn can_charge(&self, bytes: u64, from_promise: u64) -> bool {
        let fresh = bytes.saturating_sub(from_promise);
        from_promise <= self.promised && fresh <= self.headroom()
    }

    /// Charge granule `key` (its 0→1 transition). `from_promise` says whether
    /// the bytes come out of an admitted sequence's promise.
    pub fn charge(&mut self, key: GranuleKey, bytes: u64, from_promise: bool) -> Result<()> {
        crate::ensure!(!self.charged.contains_key(&key), Internal, "ledger: granule {key} charged twice");
        if from_promise {
            crate::ensure!(
                bytes <= self.promised,
                Internal,
                "ledger: charging {bytes} bytes from a promise of {}",
                self.promised
            );
            self.promised -= bytes;
        } else if bytes > self.headroom() {
            return Err(self.refuse("a granule", bytes));
        }
        self.charged.insert(key, bytes);
        self.owned += bytes;
        self.peak = self.peak.max(self.owned);
        self.charges += 1;
        Ok(())
    }

    /// Credit granule `key` (its 1→0 transition).
    pub fn credit(&mut self, key: GranuleKey) -> Result<u64> {
        let Some(bytes) = self.charged.remove(&key) else {
            crate::bail!(Internal, "ledger: crediting granule {key}, which is not charged");
        };
        crate::ensure!(bytes <= self.owned, Internal, "ledger: crediting {bytes} bytes with only {} owned", self.owned);
        self.owned -= bytes;
        self.credits += 1;
        Ok(bytes)
    }

    pub fn stats(&self) -> LedgerStats {
        LedgerStats {
            budget_bytes: self.budget,
            owned_bytes: self.owned,
            promised_bytes: self.promised,
            peak_owned_bytes: self.peak,
            owned_granules: self.charged.len() as u64,
            charges: self.charges,
            credits: self.credits,
            refusals: self.refusals,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EpmStatus;

    #[test]
    fn charges_once_and_credits_exactly() {
        let mut l = Ledger::new(10);
        l.charge(1, 4, false).unwrap();
        assert_eq!(l.charge(1, 4, false).unwrap_err().status(), EpmStatus::Internal);
        assert_eq!(l.stats().owned_bytes, 4);
        assert_eq!(l.credit(1).unwrap(), 4);
        assert_eq!(l.credit(1).unwrap_err().status(), EpmStatus::Internal);
        assert_eq!(l.stats().owned_bytes, 0);
        assert_eq!((l.stats().charges, l.stats().credits), (1, 1));
    }

    #[test]
    fn budget_covers_owned_plus_promised() {
        let mut l = Ledger::new(10);
        l.promise(6).unwrap();
        assert_eq!(l.charge(1, 5, false).unwrap_err().status(), EpmStatus::OutOfBudget);
        l.charge(2, 4, false).unwrap();
        assert_eq!(l.promise(1).unwrap_err().status(), EpmStatus::OutOfBudget);
        // Promised bytes turn into owned bytes without touching the headroom.
        l.charge(3, 6, true).unwrap();
        assert_eq!(l.stats().promised_bytes, 0);
        assert_eq!(l.stats().owned_bytes, 10);
        assert_eq!(l.stats().refusals, 2);
        assert_eq!(l.unpromise(1).unwrap_err().status(), EpmStatus::Internal);
        assert!(!l.can_charge(1, 0));
    }
}
