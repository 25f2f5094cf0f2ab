//! Admission arithmetic: how many requests a budget holds.
//!
//! With budget `B`, a shared prefix of `P` physical bytes and `Q` private
//! bytes per request, N requests cost `P + N·Q` with sharing and `N·(P + Q)`
//! without. So the admissible concurrency is `floor((B − P) / Q)` with sharing
//! (equivalently `1 + floor((B − P − Q) / Q)`: the first request brings the
//! prefix, every further one costs only its private bytes) and
//! `floor(B / (P + Q))` without.
//!
//! A common shorthand states the shared figure as
//! `1 + floor((B − P) / Q)`, which counts one request more than fits: with
//! B = 3.0 GiB and P = Q = 0.375 GiB it gives 8, but 8 requests need
//! 0.375 + 8 × 0.375 = 3.375 GiB. We report that figure as
//! `over_admitting_formula` (C: `EpmKvAdmission.seed_formula`, its published
//! name) for comparison and admit by the ledger, which is what actually holds.

use super::layout::KvLayout;

/// Admissible concurrency for (budget, prefix, private).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// `floor(B / (P + Q))`: every request holds its own copy of the prefix.
    pub without_sharing: u64,
    /// `floor((B − P) / Q)`: one physical prefix, private bytes per request.
    pub with_sharing: u64,
    /// `1 + floor((B − P) / Q)`, the shorthand that admits one too many (see
    /// module docs).
    pub over_admitting_formula: u64,
}

/// Pure arithmetic over bytes. `private` of 0 is unbounded and saturates.
pub fn admissible(budget: u64, prefix: u64, private: u64) -> Admission {
    let div = |a: u64, b: u64| a.checked_div(b).unwrap_or(u64::MAX);
    let without = div(budget, prefix.saturating_add(private));
    let (with, over) = if budget < prefix {
        (0, 0)
    } else {
        let n = div(budget - prefix, private);
        (n, n.saturating_add(1))
    };
    Admission { without_sharing: without, with_sharing: with, over_admitting_formula: over }
}

/// Physical bytes a request costs in granules, for a sequence of
/// `max_tokens` whose first `prefix_tokens` are shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestCost {
    /// Granule bytes of the shared prefix (full granules plus the boundary).
    pub prefix_bytes: u64,
    /// Granule bytes one sharer must own: everything past the prefix's full
    /// granules, including its copy-on-write of the boundary granule.
    pub private_bytes: u64,
    /// Granule bytes of the same request without sharing.
    pub unshared_bytes: u64,
}

/// Granule-rounded cost of a request on `layout`.
pub fn request_cost(layout: &KvLayout, granule: u64, prefix_tokens: u64, max_tokens: u64) -> RequestCost {
    let bpt = layout.bytes_per_token();
    let slots = |bytes: u64| bytes.div_ceil(granule);
    let total = slots(max_tokens.saturating_mul(bpt));
    let prefix_slots = slots(prefix_tokens.saturating_mul(bpt));
    let full = prefix_tokens.saturating_mul(bpt) / granule;
    let private = if max_tokens <= prefix_tokens { total.saturating_sub(prefix_slots) } else { total - full };
    RequestCost {
        prefix_bytes: prefix_slots * granule,
        private_bytes: private * granule,
        unshared_bytes: total * granule,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::layout::KvShape;

    const GIB: u64 = 1 << 30;

    #[test]
    fn fifty_fifty_split_on_three_gib() {
        let q = 3 * GIB / 8; // P = Q = 0.375 GiB: 4 unshared requests fill 3 GiB
        let a = admissible(3 * GIB, q, q);
        assert_eq!(a.without_sharing, 4);
        assert_eq!(a.with_sharing, 7);
        assert_eq!(a.over_admitting_formula, 8);
        // The with-sharing figure really fits and one more does not.
        assert!(q + 7 * q <= 3 * GIB && q + 8 * q > 3 * GIB);
    }

    #[test]
    fn degenerate_inputs_do_not_panic() {
        assert_eq!(admissible(1, 2, 1).with_sharing, 0);
        assert_eq!(admissible(10, 0, 0).without_sharing, u64::MAX);
    }

    #[test]
    fn qwen14b_2048_prefix_is_192_granules() {
        let l = KvLayout::token_major(KvShape { layers: 48, kv_heads: 8, head_dim: 128, elem_bytes: 2 }).unwrap();
        let g = 2 << 20;
        let c = request_cost(&l, g, 2048, 4096);
        assert_eq!(c.prefix_bytes, 192 * g);
        assert_eq!(c.private_bytes, 192 * g);
        assert_eq!(c.unshared_bytes, 384 * g);
        // A prefix ending mid-granule: the boundary is shared, then copied.
        let c = request_cost(&l, g, 11, 64);
        assert_eq!(c.prefix_bytes, 2 * g); // 11 × 196,608 B = 1.03 granules
        assert_eq!(c.private_bytes, (6 - 1) * g);
    }
}
