//! The streaming plan for a declared cycle of mixed-size weights: a static
//! resident set plus a streaming region (a ring) used in cycle order.
//!
//! Why not farthest-next-use alone: with uneven sizes its choices are not
//! byte-optimal, each eviction frees a block of another size (holes in the
//! arena, evictions the policy did not choose), and a victim whose block
//! does not fit the incoming weight is freed on the host, waiting for its
//! readers (issue 12 measured 1.22–1.54× the bytes the budget forces and the
//! host blocked 4.6 s of an 8 s run). A plan fixes the bytes up front:
//!
//! - the *streaming region* of `ring_bytes` holds the weights that are not
//!   resident; it must hold the live ones at once (`need`, below);
//! - the *resident set* fills the rest of the budget (a size-aware greedy
//!   fill, largest first), so streamed bytes per step are
//!   `total − resident = (total − budget) + ring_bytes`.
//!
//! Live streamed weights, for a caller that holds `width` consecutive cycle
//! positions at once (1: acquire/release around each weight; 7: a Llama
//! block acquired together) and prefetches `depth` streamed weights ahead:
//! after releasing the first of a window ending at `e`, the other `width−1`
//! are still held and `depth` more are being copied. The weight just
//! released need not stay: the next copy into its bytes is ordered on the
//! device behind its read fence (a wait on the device, not the host), which
//! costs overlap (that copy starts when that kernel ends), not bytes. So the
//! ring needs `max_e(streamed(e−width+1..e−1) + next depth streamed)` and at
//! least `max_e streamed(e−width+1..=e)`; it gets whatever the resident fill
//! leaves over (less than one weight), and `full_overlap` plans also keep the
//! weight just released when that stays within the bound.

/// Arena allocation unit: ring offsets are multiples of it.
pub const ALIGN: usize = 256;

/// How a caller holds weights: at most `width` consecutive cycle positions
/// acquired at once; with `starts`, holds begin only at the positions marked
/// (a block hook: windows are the blocks, as observed), otherwise anywhere
/// (sliding windows, the conservative reading).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub width: usize,
    pub starts: Option<Vec<bool>>,
}

impl Hold {
    /// Acquire and release around each weight.
    pub const ONE: Hold = Hold {
        width: 1,
        starts: None,
    };
    /// The runs of positions held together (each in cycle order).
    fn windows(&self, n: usize) -> Vec<Vec<usize>> {
        let w = self.width.clamp(1, n.max(1));
        match &self.starts {
            Some(st) if st.len() == n && st.iter().any(|&b| b) => {
                let starts: Vec<usize> = (0..n).filter(|&i| st[i]).collect();
                starts
                    .iter()
                    .enumerate()
                    .map(|(k, &s)| {
                        let next = starts[(k + 1) % starts.len()];
                        let len = (next + n - s - 1) % n + 1;
                        (0..len.min(w)).map(|j| (s + j) % n).collect()
                    })
                    .collect()
            }
            _ => (0..n)
                .map(|e| (0..w).rev().map(|j| (e + n - j) % n).collect())
                .collect(),
        }
    }
}

/// A plan over the cycle's units (positions in cycle order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Per cycle position: resident for good (true) or streamed through the ring.
    pub resident: Vec<bool>,
    /// Per cycle position: the streamed weight's fixed offset in the ring
    /// (`usize::MAX` for resident ones).
    pub offsets: Vec<usize>,
    /// Bytes of the resident set (each size rounded to [`ALIGN`]).
    pub resident_bytes: usize,
    /// Bytes of the streaming region.
    pub ring_bytes: usize,
    /// Streamed bytes per cycle (exact sizes).
    pub streamed_bytes: usize,
    /// How the caller holds weights, as the plan assumed.
    pub hold: Hold,
    /// The ring also keeps the weight released last (full copy/compute overlap).
    pub full_overlap: bool,
}

fn up(n: usize) -> usize {
    n.next_multiple_of(ALIGN)
}

/// For each streamed position `p`, the streamed positions that must stay
/// intact in the ring while `p` is placed: when `p` is one of the first
/// `depth` streamed after a hold window ends, it is prefetched while that
/// window is still held (less its first position, released first, unless
/// `keep_last`) and the prefetches before it are pending; otherwise it is
/// paged in on demand while its own window is acquired, and the earlier
/// streamed positions of that window are held.
pub fn live_sets(
    streamed: &[bool],
    hold: &Hold,
    depth: usize,
    keep_last: bool,
) -> Vec<(usize, Vec<usize>)> {
    let n = streamed.len();
    let order: Vec<usize> = (0..n).filter(|&i| streamed[i]).collect();
    let m = order.len();
    let skip = usize::from(!keep_last);
    let mut live: Vec<std::collections::BTreeSet<usize>> = vec![Default::default(); m];
    let rank = |p: usize| order.partition_point(|&q| q < p);
    for win in hold.windows(n) {
        let Some(&e) = win.last() else { continue };
        let held: Vec<usize> = win
            .iter()
            .skip(skip)
            .copied()
            .filter(|&q| streamed[q])
            .collect();
        // The first `depth` streamed after e (cyclically), in order.
        let first = rank((e + 1) % n) % m.max(1);
        let ahead: Vec<usize> = (0..depth.min(m)).map(|j| order[(first + j) % m]).collect();
        for (j, &p) in ahead.iter().enumerate() {
            let r = rank(p);
            live[r].extend(held.iter().copied().filter(|&q| q != p));
            live[r].extend(ahead[..j].iter().copied());
        }
        // Demand: each streamed position of the window while the earlier
        // ones are held.
        let full: Vec<usize> = win.iter().copied().filter(|&q| streamed[q]).collect();
        for (j, &p) in full.iter().enumerate() {
            live[rank(p)].extend(full[..j].iter().copied());
        }
    }
    order
        .iter()
        .zip(live)
        .map(|(&p, l)| (p, l.into_iter().collect()))
        .collect()
}

/// The largest live set with the weight being placed (positions).
fn worst_live(sizes: &[usize], live: &[(usize, Vec<usize>)]) -> Vec<usize> {
    let mut best = (0, Vec::new());
    for (p, l) in live {
        let bytes = up(sizes[*p]) + l.iter().map(|&q| up(sizes[q])).sum::<usize>();
        if bytes > best.0 {
            let mut members = l.clone();
            members.push(*p);
            best = (bytes, members);
        }
    }
    best.1
}

/// Static placement of the streamed weights in the ring: a fixed offset per
/// weight, the same every cycle, such that no weight overlaps one that is
/// live while it is placed, or one that is placed while it is live (first
/// fit in cycle order over that conflict graph, as static memory planners
/// do). Returns (position, offset) per streamed weight and the ring bytes.
pub fn assign(sizes: &[usize], live: &[(usize, Vec<usize>)]) -> (Vec<(usize, usize)>, usize) {
    let mut conflicts: std::collections::HashMap<usize, Vec<usize>> = Default::default();
    for (p, l) in live {
        for &q in l {
            conflicts.entry(*p).or_default().push(q);
            conflicts.entry(q).or_default().push(*p);
        }
    }
    let mut at: std::collections::HashMap<usize, (usize, usize)> = Default::default();
    let mut out = Vec::with_capacity(live.len());
    let mut top = 0;
    for (p, _) in live {
        let s = up(sizes[*p]);
        let taken: Vec<(usize, usize)> = conflicts
            .get(p)
            .map(|c| c.iter().filter_map(|q| at.get(q).copied()).collect())
            .unwrap_or_default();
        let mut cands: Vec<usize> = std::iter::once(0)
            .chain(taken.iter().map(|&(o, n)| o + n))
            .collect();
        cands.sort_unstable();
        let off = cands
            .into_iter()
            .find(|&o| taken.iter().all(|&(to, tn)| o + s <= to || to + tn <= o))
            .unwrap_or(0);
        at.insert(*p, (off, s));
        out.push((*p, off));
        top = top.max(off + s);
    }
    (out, top)
}

/// The plan for `sizes` (cycle order) under `budget`, or `None` when
/// everything fits or nothing sensible does (then the cyclic policy runs
/// alone). `hold`: how the caller holds weights; `depth`: prefetch depth.
pub fn plan(sizes: &[usize], budget: usize, hold: &Hold, depth: usize) -> Option<Plan> {
    let total: usize = sizes.iter().sum();
    if sizes.is_empty() || total <= budget {
        return None;
    }
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let bound = total - budget + 2 * largest;
    let hard = best_plan(sizes, budget, hold, depth, false)?;
    // Full overlap when it stays within (total − budget) + 2 × largest.
    match best_plan(sizes, budget, hold, depth, true) {
        Some(p) if p.streamed_bytes <= bound.max(hard.streamed_bytes) => Some(p),
        _ => Some(hard),
    }
}

fn best_plan(
    sizes: &[usize],
    budget: usize,
    hold: &Hold,
    depth: usize,
    keep_last: bool,
) -> Option<Plan> {
    let n = sizes.len();
    let largest = up(sizes.iter().copied().max().unwrap_or(0));
    let mut by_size: Vec<usize> = (0..n).collect();
    by_size.sort_by_key(|&i| std::cmp::Reverse(sizes[i]));
    // For a ring target: make every window's live streamed bytes fit it
    // (moving the largest streamed weight of the worst window into the
    // resident set), then fill the rest of the budget largest first.
    let eval = |target: usize| -> Option<Plan> {
        let mut streamed = vec![true; n];
        let mut res = 0usize;
        loop {
            // Placement (first fit) can need more than the largest live set.
            let live = live_sets(&streamed, hold, depth, keep_last);
            if assign(sizes, &live).1 <= target {
                break;
            }
            let worst = worst_live(sizes, &live);
            // The worst window's largest streamed member.
            let &i = worst.iter().max_by_key(|&&i| sizes[i])?;
            streamed[i] = false;
            res += up(sizes[i]);
            if res + target > budget {
                return None;
            }
        }
        for &i in &by_size {
            if streamed[i] && res + up(sizes[i]) + target <= budget {
                streamed[i] = false;
                res += up(sizes[i]);
            }
        }
        // The ring takes what the fill left (it only helps overlap).
        let ring = budget - res;
        let (offsets, ring_need) = assign(sizes, &live_sets(&streamed, hold, depth, keep_last));
        if !streamed.iter().any(|&s| s) || ring_need > ring {
            return None;
        }
        let mut o = vec![usize::MAX; n];
        for (p, off) in offsets {
            o[p] = off;
        }
        Some(Plan {
            resident: streamed.iter().map(|&s| !s).collect(),
            offsets: o,
            resident_bytes: res,
            ring_bytes: ring,
            streamed_bytes: (0..n).filter(|&i| streamed[i]).map(|i| sizes[i]).sum(),
            hold: hold.clone(),
            full_overlap: keep_last,
        })
    };
    // Streamed bytes are about (total − budget) + target once a target is
    // feasible, so look for the smallest feasible target: coarse steps of
    // half a weight from one weight up, then eighths around the first hit
    // (the fill's leftover makes neighbours differ). Each try costs a
    // cover, O(n) placements: coarse-then-fine keeps an 80-layer model's
    // plan well under a second.
    let coarse = (largest / 2).max(ALIGN);
    let fine = (largest / 8).max(ALIGN);
    let mut target = largest.min(budget);
    let first = loop {
        if target > budget {
            return None;
        }
        if eval(target).is_some() {
            break target;
        }
        target += coarse;
    };
    let mut best: Option<Plan> = None;
    let mut t = first.saturating_sub(coarse - fine).max(largest.min(budget));
    while t <= (first + coarse).min(budget) {
        if let Some(p) = eval(t)
            && best.as_ref().is_none_or(|b| p.streamed_bytes < b.streamed_bytes)
        {
            best = Some(p);
        }
        t += fine;
    }
    best
}

/// The byte-optimal static resident set for a cyclic scan: the most bytes
/// of whole weights that fit `capacity` (exact 0/1 knapsack over sizes in
/// units of `quantum` bytes; every size must be a multiple of it). A
/// static set streams `total − that` per step, so this is the offline
/// optimum any static-set plan with a streaming region of `budget −
/// capacity` bytes is compared with.
pub fn best_static_fill(sizes: &[usize], capacity: usize, quantum: usize) -> usize {
    let cap = capacity / quantum;
    let mut reach = vec![false; cap + 1];
    reach[0] = true;
    for &s in sizes {
        let q = s / quantum;
        for c in (q..=cap).rev() {
            if reach[c - q] {
                reach[c] = true;
            }
        }
    }
    reach.iter().rposition(|&r| r).unwrap_or(0) * quantum
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama(d: usize, ffn: usize, kv: usize, blocks: usize) -> Vec<usize> {
        (0..blocks)
            .flat_map(|_| [d * d, d * kv, d * kv, d * d, d * ffn, d * ffn, d * ffn])
            .map(|e| e * 2)
            .collect()
    }

    #[test]
    fn plans_stay_within_the_bound_and_fill_the_budget() {
        for sizes in [
            llama(256, 688, 256, 6),
            llama(256, 896, 32, 4),
            llama(320, 864, 320, 3),
        ] {
            let total: usize = sizes.iter().sum();
            let largest = *sizes.iter().max().unwrap();
            for pct in (10..100).step_by(10) {
                let budget = total * pct / 100;
                for depth in 1..=4 {
                    // A deep window may not fit a small budget at all (then
                    // farthest-next-use runs alone); depth 1 always does.
                    let Some(p) = plan(&sizes, budget, &Hold::ONE, depth) else {
                        assert!(depth > 1, "{pct}% d{depth}: no plan");
                        continue;
                    };
                    assert!(
                        p.resident_bytes + p.ring_bytes <= budget,
                        "{pct}% d{depth}: {p:?}"
                    );
                    if depth == 1 {
                        assert!(
                            p.streamed_bytes <= total - budget + 2 * largest,
                            "{pct}%: streams {} > bound {}",
                            p.streamed_bytes,
                            total - budget + 2 * largest
                        );
                    }
                    let streamed: Vec<bool> = p.resident.iter().map(|&r| !r).collect();
                    let live = live_sets(&streamed, &Hold::ONE, depth, p.full_overlap);
                    // No live weight overlaps the one placed.
                    for (q, l) in &live {
                        for r in l {
                            let (a, b) = (p.offsets[*q], p.offsets[*r]);
                            assert!(
                                a + sizes[*q] <= b || b + sizes[*r] <= a,
                                "{pct}% d{depth}: {q} overlaps live {r}"
                            );
                        }
                        assert!(p.offsets[*q] + sizes[*q] <= p.ring_bytes);
                    }
                }
            }
        }
    }

    #[test]
    fn a_held_block_is_balanced_across_blocks() {
        // Holding 7 positions at once: the ring must hold a block's streamed
        // part, so the plan spreads the streamed bytes over the blocks.
        let sizes = llama(256, 896, 32, 8);
        let total: usize = sizes.iter().sum();
        let budget = total / 2;
        let starts = (0..56).map(|i| i % 7 == 0).collect();
        let p = plan(
            &sizes,
            budget,
            &Hold {
                width: 7,
                starts: Some(starts),
            },
            1,
        )
        .unwrap();
        let per_block: Vec<usize> = (0..8)
            .map(|b| {
                (0..7)
                    .filter(|&j| !p.resident[b * 7 + j])
                    .map(|j| sizes[b * 7 + j])
                    .sum()
            })
            .collect();
        let nb = 8.0;
        let floor = (total - budget) as f64 * nb / (nb - 1.0);
        assert!(
            (p.streamed_bytes as f64) <= floor + 2.0 * *sizes.iter().max().unwrap() as f64,
            "{p:?} {per_block:?} floor {floor}"
        );
    }

    #[test]
    fn the_knapsack_is_exact() {
        assert_eq!(best_static_fill(&[5, 4, 3], 7, 1), 7);
        assert_eq!(best_static_fill(&[5, 4, 3], 6, 1), 5);
        assert_eq!(best_static_fill(&[4, 4], 100, 1), 8);
    }

    #[test]
    fn nothing_to_plan_when_everything_fits() {
        assert_eq!(plan(&[10, 20], 30, &Hold::ONE, 1), None);
    }
}
