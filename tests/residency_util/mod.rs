//! Helpers shared by the residency tests (a directory, so cargo does not build
//! it as a test crate of its own).
#![allow(dead_code)]

use epmem::device::{HostRange, checksum_host};
use epmem::residency::{ResidencyManager, WeightId};

/// Page-aligned host weights of pseudo-random bytes.
pub struct Weights {
    pub buf: Vec<u8>,
    /// (offset in `buf`, length) of each weight.
    pub spans: Vec<(usize, usize)>,
}

impl Weights {
    pub fn new(sizes: &[usize], seed: u64) -> Self {
        let page = 4096;
        let total: usize = sizes.iter().map(|s| s.next_multiple_of(page)).sum::<usize>() + page;
        let mut buf = vec![0u8; total];
        fastrand::Rng::with_seed(seed).fill(&mut buf);
        let mut off = buf.as_ptr().align_offset(page);
        let mut spans = Vec::new();
        for &n in sizes {
            spans.push((off, n));
            off += n.next_multiple_of(page);
        }
        Self { buf, spans }
    }

    pub fn range(&self, i: usize) -> HostRange {
        let (o, n) = self.spans[i];
        // SAFETY: the span lies inside `buf`, which outlives every manager in
        // these tests and is written only where no manager has it registered.
        unsafe { HostRange::new(self.buf.as_ptr().add(o), n) }
    }

    pub fn checksum(&self, i: usize) -> u64 {
        let (o, n) = self.spans[i];
        checksum_host(&self.buf[o..o + n])
    }

    pub fn register_all(&self, m: &ResidencyManager) -> Vec<WeightId> {
        (0..self.spans.len()).map(|i| m.register(self.range(i)).unwrap()).collect()
    }
}
