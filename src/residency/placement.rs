//! The streaming plan for a declared cycle of mixed-size weights: a static
//! resident set plus a streaming region (a ring) used in cycle order.
//!
//! Why not farthest-next-use alone: with uneven sizes its choices are not
//! byte-optimal, each eviction frees a block of another size (holes in the
//! arena, evictions the policy did not choose), and a victim whose block
//! does not fit the incoming weight is freed on the host, waiting for its
//! readers (measured on the Llama mixes: 1.22–1.54× the bytes the budget forces, the
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
    pub const ONE: Hold = Hold { width: 1, starts: None };
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
            _ => (0..n).map(|e| (0..w).rev().map(|j| (e + n - j) % n).collect()).collect(),
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
    /// Per cycle position: bytes of a streamed weight kept resident at its
    /// front, its *head* (0: streamed whole, or resident). Only
    /// [`split_plan`] splits weights; the ring then holds tails.
    pub heads: Vec<usize>,
}

impl Plan {
    /// Whether some weight is split into a resident head and a streamed tail.
    pub fn splits(&self) -> bool {
        self.heads.iter().any(|&h| h > 0)
    }
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
pub fn live_sets(streamed: &[bool], hold: &Hold, depth: usize, keep_last: bool) -> Vec<(usize, Vec<usize>)> {
    let n = streamed.len();
    let order: Vec<usize> = (0..n).filter(|&i| streamed[i]).collect();
    let m = order.len();
    let skip = usize::from(!keep_last);
    let mut live: Vec<std::collections::BTreeSet<usize>> = vec![Default::default(); m];
    let rank = |p: usize| order.partition_point(|&q| q < p);
    for win in hold.windows(n) {
        let Some(&e) = win.last() else { continue };
        let held: Vec<usize> = win.iter().skip(skip).copied().filter(|&q| streamed[q]).collect();
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
    order.iter().zip(live).map(|(&p, l)| (p, l.into_iter().collect())).collect()
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
    assign_within(sizes, live, None)
}

/// [`assign`], and with `soft = Some(cap)` each weight also avoids, where the
/// ring of `cap` bytes has room, the streamed weights next to it in cycle
/// order. The weight released just before is not live (its bytes may be
/// handed on behind its read fence), but a copy that lands on it waits on the
/// device for that read: placed beside it instead, the copy runs while it is
/// read. Free ring space buys copy/compute overlap, never bytes.
fn assign_within(sizes: &[usize], live: &[(usize, Vec<usize>)], soft: Option<usize>) -> (Vec<(usize, usize)>, usize) {
    let mut conflicts: std::collections::HashMap<usize, Vec<usize>> = Default::default();
    for (p, l) in live {
        for &q in l {
            conflicts.entry(*p).or_default().push(q);
            conflicts.entry(q).or_default().push(*p);
        }
    }
    let m = live.len();
    let mut at: std::collections::HashMap<usize, (usize, usize)> = Default::default();
    let mut out = Vec::with_capacity(m);
    let mut top = 0;
    for (k, (p, _)) in live.iter().enumerate() {
        let s = up(sizes[*p]);
        let taken: Vec<(usize, usize)> =
            conflicts.get(p).map(|c| c.iter().filter_map(|q| at.get(q).copied()).collect()).unwrap_or_default();
        let fits = |o: usize, t: &[(usize, usize)]| t.iter().all(|&(to, tn)| o + s <= to || to + tn <= o);
        let first_fit = |t: &[(usize, usize)], cap: usize| {
            let mut cands: Vec<usize> = std::iter::once(0).chain(t.iter().map(|&(o, n)| o + n)).collect();
            cands.sort_unstable();
            cands.into_iter().find(|&o| o + s <= cap && fits(o, t))
        };
        let soft_off = soft.and_then(|cap| {
            let mut t = taken.clone();
            if m > 1 {
                let nb = [live[(k + m - 1) % m].0, live[(k + 1) % m].0];
                t.extend(nb.iter().filter(|&&q| q != *p).filter_map(|q| at.get(q).copied()));
            }
            first_fit(&t, cap)
        });
        let off = soft_off.or_else(|| first_fit(&taken, usize::MAX)).unwrap_or(0);
        at.insert(*p, (off, s));
        out.push((*p, off));
        top = top.max(off + s);
    }
    (out, top)
}

/// The fewest bytes per step that any schedule copying each streamed whole
/// weight once per step can copy for `sizes` under `budget`: when a streamed
/// weight of `m` bytes is read, it and every weight never copied are in VRAM,
/// so the weights never copied fit `budget − m`, and a step copies at least
/// `total − budget + m` — with `m` the smallest largest-streamed-weight the
/// budget allows (weights larger than `m` all kept, the rest filled
/// byte-optimally: an exact knapsack in units of the sizes' greatest common
/// divisor, at least `quantum`). `total − budget` alone is reachable only by
/// streaming parts of weights.
pub fn whole_weight_floor(sizes: &[usize], budget: usize) -> usize {
    let total: usize = sizes.iter().sum();
    if total <= budget {
        return 0;
    }
    let g = sizes.iter().fold(0usize, |a, &b| gcd(a, b)).max(1);
    let mut distinct: Vec<usize> = sizes.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let mut best = total;
    for &m in &distinct {
        let kept: usize = sizes.iter().filter(|&&s| s > m).sum();
        let Some(room) = budget.checked_sub(m + kept) else {
            continue;
        };
        let small: Vec<usize> = sizes.iter().copied().filter(|&s| s <= m).collect();
        best = best.min(total - kept - best_static_fill(&small, room / g * g, g));
    }
    best
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The plan for `sizes` (cycle order) under `budget`, or `None` when
/// everything fits or nothing sensible does (then the cyclic policy runs
/// alone). `hold`: how the caller holds weights; `depth`: prefetch depth.
pub fn plan(sizes: &[usize], budget: usize, hold: &Hold, depth: usize) -> Option<Plan> {
    let total: usize = sizes.iter().sum();
    if sizes.is_empty() || total <= budget {
        return None;
    }
    let hard = best_plan(sizes, budget, hold, depth, false)?;
    // Keeping the weight released last costs ring bytes (a second live
    // weight) and buys overlap: without it, a streamed copy landing on the
    // weight just read waits for that read, i.e. for one kernel over that
    // weight — on the H200 ~1% of the copy's time (HBM ~4.8 TB/s against
    // PCIe ~55 GB/s), and `assign_within` already avoids the overlap where the
    // ring has room. So full overlap only when it costs under 1/128 more
    // bytes (at most 2 × largest over the floor, the bound).
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let bound = total - budget + 2 * largest;
    match best_plan(sizes, budget, hold, depth, true) {
        Some(p)
            if p.streamed_bytes <= hard.streamed_bytes + hard.streamed_bytes / 128
                && p.streamed_bytes <= bound.max(hard.streamed_bytes) =>
        {
            Some(p)
        }
        _ => Some(hard),
    }
}

fn best_plan(sizes: &[usize], budget: usize, hold: &Hold, depth: usize, keep_last: bool) -> Option<Plan> {
    let n = sizes.len();
    let largest = up(sizes.iter().copied().max().unwrap_or(0));
    // For a ring target: make every window's live streamed bytes fit it
    // (moving the largest streamed weight of the worst window into the
    // resident set), then fill the rest of the budget byte-optimally.
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
        let rest: Vec<usize> = (0..n).filter(|&i| streamed[i]).collect();
        for i in fill(sizes, &rest, budget - res - target) {
            streamed[i] = false;
            res += up(sizes[i]);
        }
        // The ring takes what the fill left (it only helps overlap).
        let ring = budget - res;
        // Same bytes, streamed weights spaced along the cycle when the ring
        // still fits them (see `spread`).
        let even = spread(sizes, &streamed);
        if even != streamed && assign(sizes, &live_sets(&even, hold, depth, keep_last)).1 <= ring {
            streamed = even;
        }
        let live = live_sets(&streamed, hold, depth, keep_last);
        let (mut offsets, ring_need) = assign(sizes, &live);
        if !streamed.iter().any(|&s| s) || ring_need > ring {
            return None;
        }
        // Same bytes, placed to overlap copies with reads where the ring
        // has room (falls back when the soft choices crowd a hard one out).
        let (soft, soft_need) = assign_within(sizes, &live, Some(ring));
        if soft_need <= ring {
            offsets = soft;
        }
        Some(Plan {
            resident: streamed.iter().map(|&s| !s).collect(),
            offsets: by_position(n, offsets),
            resident_bytes: res,
            ring_bytes: ring,
            streamed_bytes: (0..n).filter(|&i| streamed[i]).map(|i| sizes[i]).sum(),
            hold: hold.clone(),
            full_overlap: keep_last,
            heads: vec![0; n],
        })
    };
    // Streamed bytes are about (total − budget) + target once a target is
    // feasible, so look for the smallest feasible target. The ring need not
    // hold the largest weight: when the smaller weights alone can carry
    // (total − budget), streaming only them needs a ring of one small
    // weight (a Llama-70B shape at 75% streams 3.4% over the floor
    // instead of 22%). So try the natural ring sizes first — each distinct
    // size and each sum of two (a live pair) — then coarse steps of half the
    // largest weight from the smallest up to the first feasible one, then
    // eighths around the best (the fill's leftover makes neighbours
    // differ). Each try costs a cover, O(n) placements: this keeps an
    // 80-layer model's plan near a second.
    let mut distinct: Vec<usize> = sizes.iter().map(|&s| up(s)).collect();
    distinct.sort_unstable();
    distinct.dedup();
    let smallest = distinct[0];
    let mut natural: Vec<usize> = distinct
        .iter()
        .flat_map(|&a| std::iter::once(a).chain(distinct.iter().map(move |&b| a + b)))
        .filter(|&t| t <= budget)
        .collect();
    let coarse = (largest / 2).max(ALIGN);
    let fine = (largest / 8).max(ALIGN);
    let mut t = smallest;
    while t <= budget {
        natural.push(t);
        if eval(t).is_some() {
            natural.push(t + coarse);
            break;
        }
        t += coarse;
    }
    natural.sort_unstable();
    natural.dedup();
    let better = |p: Plan, best: &mut Option<Plan>| {
        if best.as_ref().is_none_or(|b| p.streamed_bytes < b.streamed_bytes) {
            *best = Some(p);
        }
    };
    let mut best: Option<Plan> = None;
    for &t in natural.iter().filter(|&&t| t <= budget) {
        if let Some(p) = eval(t) {
            better(p, &mut best);
        }
    }
    let at = best.as_ref()?.ring_bytes.min(budget);
    let mut t = at.saturating_sub(coarse).max(smallest);
    while t <= (at + coarse).min(budget) {
        if let Some(p) = eval(t) {
            better(p, &mut best);
        }
        t += fine;
    }
    best
}

/// About what farthest-next-use alone streams per cycle of `sizes` under
/// `budget` (weights of about one size): (total − budget) plus one weight.
pub fn farthest_next_use_bytes(sizes: &[usize], budget: usize) -> usize {
    let total: usize = sizes.iter().sum();
    total.saturating_sub(budget) + sizes.iter().copied().max().unwrap_or(0)
}

/// A plan that streams part of each weight, for a caller that acquires
/// around each weight ([`Hold::ONE`]). Weight `i` keeps a *head* of a
/// multiple of `aligns[i]` bytes (itself a multiple of the VMM `granule`:
/// the head is the weight's own memory and its tail is mapped onto the ring,
/// behind one address range) and streams the rest. A whole-weight plan's
/// ring must hold the largest weight it streams (448 MiB for an 8192 × 28672
/// bf16 matrix: 12% over `total − budget` at 75% of the benchmark's large
/// shape); here it holds `slots` tails, and tails are small. Two: one being
/// read and one being copied (raw tails: the copy lands in the ring). One:
/// every tail at the same bytes, each page-in ordered behind the read of the
/// tail before it on the device (compressed tails: the copy lands in the
/// decode staging, and only the decode, microseconds, waits for that read),
/// one tail of ring fewer, so one tail more of heads resident. Tails are
/// proportional to their weights (capped at a slot), so each copy takes as
/// long relative to its weight's compute as every other: a prefill,
/// compute-heavy, overlaps them all alike.
///
/// Searched over the slot size `r` (granules): for each, the smallest
/// fraction whose tails leave heads that fit `budget − slots·r` (bisection:
/// more fraction, longer tails, shorter heads); the plan streaming the
/// fewest bytes wins. `None` when everything fits or no split does.
pub fn split_plan(sizes: &[usize], aligns: &[usize], granule: usize, budget: usize, slots: usize) -> Option<Plan> {
    const ONE: u64 = 1 << 20;
    let n = sizes.len();
    let total: usize = sizes.iter().sum();
    if n < 2 || total <= budget || granule == 0 || aligns.len() != n || !(1..=2).contains(&slots) {
        return None;
    }
    let gup = |x: usize| x.next_multiple_of(granule);
    // The tail of position `i` at fraction `f` (of ONE) with slots of `r`
    // bytes: the shortest whose head is a multiple of the alignment and
    // that is at least `f` of the weight, shortened to fit a slot.
    let tail = |i: usize, f: u64, r: usize| -> usize {
        let s = sizes[i];
        let a = aligns[i].max(granule).next_multiple_of(granule);
        let want = (s as u128 * f as u128).div_ceil(ONE as u128) as usize;
        if want == 0 {
            return 0;
        }
        let mut h = (s - want.min(s)) / a * a;
        if gup(s) - h > r {
            h = (gup(s) - r).next_multiple_of(a);
        }
        s.saturating_sub(h)
    };
    // Bytes position `i` holds for good: the weight (an arena block) when
    // nothing streams, else its head, `s − t`, a multiple of the granule.
    let held = |i: usize, t: usize| if t == 0 { up(sizes[i]) } else { sizes[i] - t };
    let largest = gup(sizes.iter().copied().max().unwrap_or(0));
    let step = granule * (largest / granule).div_ceil(512).max(1);
    let mut best: Option<(usize, usize, u64)> = None; // (streamed, r, f)
    let mut r = step;
    while r <= largest && slots * r < budget {
        let fits = |f: u64| (0..n).map(|i| held(i, tail(i, f, r))).sum::<usize>() + slots * r <= budget;
        if fits(ONE) {
            let (mut lo, mut hi) = (0u64, ONE);
            while hi - lo > 1 {
                let mid = (lo + hi) / 2;
                if fits(mid) { hi = mid } else { lo = mid }
            }
            let streamed: usize = (0..n).map(|i| tail(i, hi, r)).sum();
            if best.is_none_or(|(b, _, _)| streamed < b) {
                best = Some((streamed, r, hi));
            }
        }
        r += step;
    }
    let (streamed_bytes, r, f) = best?;
    let tails: Vec<usize> = (0..n).map(|i| tail(i, f, r)).collect();
    let streamed: Vec<bool> = tails.iter().map(|&t| t > 0).collect();
    // Slots: each tail at a granule-aligned offset (its size rounded to the
    // granule), neighbours in the cycle apart where two slots allow (with
    // one, no tail is live while another is placed: no prefetch window).
    let slot_sizes: Vec<usize> = tails.iter().map(|&t| gup(t)).collect();
    let live = live_sets(&streamed, &Hold::ONE, slots - 1, false);
    let ring = slots * r;
    let (offsets, need) = assign_within(&slot_sizes, &live, Some(ring));
    if need > ring {
        return None;
    }
    Some(Plan {
        resident: streamed.iter().map(|&s| !s).collect(),
        offsets: by_position(n, offsets),
        resident_bytes: (0..n).map(|i| held(i, tails[i])).sum(),
        ring_bytes: ring,
        streamed_bytes,
        hold: Hold::ONE,
        full_overlap: false,
        heads: (0..n).map(|i| if tails[i] > 0 { sizes[i] - tails[i] } else { 0 }).collect(),
    })
}

/// Ring offsets of `assign` as one per position of `n` (`usize::MAX`: resident).
fn by_position(n: usize, offsets: Vec<(usize, usize)>) -> Vec<usize> {
    let mut o = vec![usize::MAX; n];
    for (p, off) in offsets {
        o[p] = off;
    }
    o
}

/// `streamed` with, of each size, the same number of positions streamed
/// but evenly spaced along the cycle. Which weights of a size stream does
/// not change the bytes; it decides what the copy engine overlaps. A copy
/// into the ring runs while the weights before its own compute, so a long
/// run of resident weights is compute the copy engine sits out: the
/// knapsack (`fill`) keeps the first positions of each size, which made the
/// resident set the cycle's first layers and streamed only the last ones
/// (modeled at 0.87 × the PCIe floor for the ORT benchmark's decoder at
/// 75%, measured 0.85 on the H200; spread, 0.94 modeled;
/// tests/residency_mix.rs).
fn spread(sizes: &[usize], streamed: &[bool]) -> Vec<bool> {
    let mut out = vec![false; sizes.len()];
    let mut classes: Vec<usize> = sizes.to_vec();
    classes.sort_unstable();
    classes.dedup();
    for c in classes {
        let pos: Vec<usize> = (0..sizes.len()).filter(|&i| sizes[i] == c).collect();
        let k = pos.iter().filter(|&&i| streamed[i]).count();
        // k ≤ len, so the picks are strictly increasing: k distinct positions.
        for j in 0..k {
            out[pos[(2 * j + 1) * pos.len() / (2 * k)]] = true;
        }
    }
    out
}

/// The members of `cands` (positions) to keep resident in `room` bytes: the
/// most bytes of whole weights (each rounded to [`ALIGN`]) that fit — an exact
/// 0/1 knapsack in units of the sizes' greatest common divisor, coarsened
/// (sizes rounded up, so the choice still fits) when `room` would need more
/// than 2^18 units. A largest-first fill left up to one weight unused:
/// 0.5–1.5% more bytes per step on the Llama mixes of tests/residency_mix.rs.
fn fill(sizes: &[usize], cands: &[usize], room: usize) -> Vec<usize> {
    let g = cands.iter().fold(0, |a, &i| gcd(a, up(sizes[i]))).max(ALIGN);
    let q = g.max((room >> 18).next_multiple_of(g));
    let units: Vec<usize> = cands.iter().map(|&i| up(sizes[i]).div_ceil(q)).collect();
    let cap = room / q;
    // from[c]: the first candidate (index into `cands`) that reached sum c;
    // scanning c downwards, c − u was reached by earlier candidates only, so
    // walking `from` back uses each candidate once.
    let mut from = vec![usize::MAX; cap + 1];
    let mut reach = vec![false; cap + 1];
    reach[0] = true;
    for (k, &u) in units.iter().enumerate() {
        if u == 0 || u > cap {
            continue;
        }
        for c in (u..=cap).rev() {
            if !reach[c] && reach[c - u] {
                reach[c] = true;
                from[c] = k;
            }
        }
    }
    let mut c = reach.iter().rposition(|&r| r).unwrap_or(0);
    let mut out = Vec::new();
    while c > 0 {
        let k = from[c];
        out.push(cands[k]);
        c -= units[k];
    }
    out
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
        (0..blocks).flat_map(|_| [d * d, d * kv, d * kv, d * d, d * ffn, d * ffn, d * ffn]).map(|e| e * 2).collect()
    }

    #[test]
    fn plans_stay_within_the_bound_and_fill_the_budget() {
        for sizes in [llama(256, 688, 256, 6), llama(256, 896, 32, 4), llama(320, 864, 320, 3)] {
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
                    assert!(p.resident_bytes + p.ring_bytes <= budget, "{pct}% d{depth}: {p:?}");
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
                            assert!(a + sizes[*q] <= b || b + sizes[*r] <= a, "{pct}% d{depth}: {q} overlaps live {r}");
                        }
                        assert!(p.offsets[*q] + sizes[*q] <= p.ring_bytes);
                    }
                }
            }
        }
    }

    #[test]
    fn streamed_weights_are_spread_along_the_cycle_at_the_same_bytes() {
        // 20 Llama blocks at 75%: the streamed weights must not all sit in
        // the cycle's last blocks (the knapsack alone put them there).
        let sizes = llama(256, 896, 64, 20);
        let total: usize = sizes.iter().sum();
        for pct in [25, 50, 75] {
            let budget = total * pct / 100;
            let p = plan(&sizes, budget, &Hold::ONE, 1).expect("a plan");
            let streamed: Vec<usize> = (0..sizes.len()).filter(|&i| !p.resident[i]).collect();
            // No stretch of resident weights longer than the cycle over the
            // number of streamed weights, rounded up to whole blocks (+1).
            let mut gaps: Vec<usize> = streamed.windows(2).map(|w| w[1] - w[0]).collect();
            gaps.push(streamed[0] + sizes.len() - streamed[streamed.len() - 1]);
            let most = *gaps.iter().max().unwrap();
            let fair = sizes.len().div_ceil(streamed.len());
            assert!(most <= 2 * fair + 7, "{pct}%: a run of {most} positions between streamed weights (fair {fair})");
            // Spreading keeps the bytes of the knapsack's choice.
            assert_eq!(p.streamed_bytes, streamed.iter().map(|&i| sizes[i]).sum::<usize>());
            assert!(p.streamed_bytes <= total - budget + 2 * *sizes.iter().max().unwrap(), "{pct}%");
        }
        // Per size: the same count either way, evenly placed.
        let st = vec![true, true, false, false, false, false];
        assert_eq!(spread(&[1; 6], &st), vec![false, true, false, false, true, false]);
        assert_eq!(spread(&[1, 2, 1, 2], &[false, true, true, false]), vec![false, false, true, true]);
    }

    #[test]
    fn a_held_block_is_balanced_across_blocks() {
        // Holding 7 positions at once: the ring must hold a block's streamed
        // part, so the plan spreads the streamed bytes over the blocks.
        let sizes = llama(256, 896, 32, 8);
        let total: usize = sizes.iter().sum();
        let budget = total / 2;
        let starts = (0..56).map(|i| i % 7 == 0).collect();
        let p = plan(&sizes, budget, &Hold { width: 7, starts: Some(starts) }, 1).unwrap();
        let per_block: Vec<usize> =
            (0..8).map(|b| (0..7).filter(|&j| !p.resident[b * 7 + j]).map(|j| sizes[b * 7 + j]).sum()).collect();
        let nb = 8.0;
        let floor = (total - budget) as f64 * nb / (nb - 1.0);
        assert!(
            (p.streamed_bytes as f64) <= floor + 2.0 * *sizes.iter().max().unwrap() as f64,
            "{p:?} {per_block:?} floor {floor}"
        );
    }

    /// `whole_weight_floor` against every static resident set of small
    /// random mixes, and the depth-1 plan reaching it.
    #[test]
    fn the_whole_weight_floor_is_exact_and_plans_reach_it() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200 {
            let n = 3 + (x % 8) as usize;
            let sizes: Vec<usize> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    [1, 2, 3, 4, 7][(x % 5) as usize] * 1024
                })
                .collect();
            let total: usize = sizes.iter().sum();
            let budget = (total * (10 + (x % 80) as usize) / 100).max(7 * 1024);
            let mut best = total;
            for mask in 0u32..1 << n {
                let kept: usize = (0..n).filter(|&i| mask >> i & 1 == 1).map(|i| sizes[i]).sum();
                let m = (0..n).filter(|&i| mask >> i & 1 == 0).map(|i| sizes[i]).max().unwrap_or(0);
                if kept + m <= budget {
                    best = best.min(total - kept);
                }
            }
            if total <= budget {
                continue;
            }
            assert_eq!(whole_weight_floor(&sizes, budget), best, "{sizes:?} under {budget}");
            if let Some(p) = plan(&sizes, budget, &Hold::ONE, 1) {
                assert_eq!(p.streamed_bytes, best, "{sizes:?} under {budget}: {p:?}");
            }
        }
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

    /// Split plans on the benchmark's shapes (real sizes, 2 MiB granules,
    /// heads on 2 MiB or on 8 MiB frames): within the budget, heads and
    /// slots on granules, every tail inside the ring; and on the GQA shape
    /// at 75%, fewer bytes than any whole-weight schedule.
    #[test]
    fn split_plans_fit_the_budget_on_granules_and_beat_whole_weights_where_matrices_are_large() {
        let mib = 1usize << 20;
        for (d, kv, blocks) in [(8192, 8192, 8), (8192, 1024, 6)] {
            let sizes = llama(d, 28672, kv, blocks);
            let total: usize = sizes.iter().sum();
            for pct in [25, 50, 75] {
                for al in [2 * mib, 8 * mib] {
                    let budget = total * pct / 100;
                    let p = split_plan(&sizes, &vec![al; sizes.len()], 2 * mib, budget, 2).expect("a split plan");
                    assert!(
                        p.resident_bytes + p.ring_bytes <= budget,
                        "{pct}%: {} + {}",
                        p.resident_bytes,
                        p.ring_bytes
                    );
                    assert!(p.streamed_bytes >= total - budget);
                    let mut tails = Vec::new();
                    for i in 0..sizes.len() {
                        let h = p.heads[i];
                        assert_eq!(h % al, 0, "{pct}%: head {h} off the alignment");
                        if p.resident[i] {
                            assert_eq!(h, 0);
                            continue;
                        }
                        let t = sizes[i] - h;
                        assert!(t > 0 && p.offsets[i] % (2 * mib) == 0, "{pct}%: tail at {}", p.offsets[i]);
                        assert!(
                            p.offsets[i] + t.next_multiple_of(2 * mib) <= p.ring_bytes,
                            "{pct}%: a tail overruns the ring"
                        );
                        tails.push((i, t));
                    }
                    let streamed: usize = tails.iter().map(|&(_, t)| t).sum();
                    assert_eq!(streamed, p.streamed_bytes);
                    if kv == 1024 && pct == 75 {
                        let wwf = whole_weight_floor(&sizes, budget);
                        assert!(
                            p.streamed_bytes < wwf,
                            "gqa 75%: split {} ≥ whole-weight floor {wwf}",
                            p.streamed_bytes
                        );
                    }
                }
            }
        }
    }

    /// One slot (compressed tails): the ring is one slot (smaller tails sit
    /// apart from their neighbours where it has room), every tail inside it; the plan
    /// streams less than the two-slot plan on the 8192-wide shapes (where the
    /// freed slot's bytes become heads: 64–384 MiB a step), no more on the
    /// 4096-wide one (its 8 MiB head alignment leaves 25 and 50% equal).
    #[test]
    fn one_slot_split_plans_share_the_slot_and_stream_less() {
        let mib = 1usize << 20;
        for (d, kv, blocks) in [(8192, 8192, 8), (8192, 1024, 6), (4096, 4096, 16)] {
            let ffn = if d == 4096 { 11008 } else { 28672 };
            let sizes = llama(d, ffn, kv, blocks);
            let total: usize = sizes.iter().sum();
            for pct in [25, 50, 75] {
                let budget = total * pct / 100;
                let two = split_plan(&sizes, &vec![8 * mib; sizes.len()], 2 * mib, budget, 2).expect("two slots");
                let one = split_plan(&sizes, &vec![8 * mib; sizes.len()], 2 * mib, budget, 1).expect("one slot");
                assert!(one.resident_bytes + one.ring_bytes <= budget, "{d}/{kv} {pct}%: over the budget");
                let slot = (0..sizes.len())
                    .filter(|&i| !one.resident[i])
                    .map(|i| (sizes[i] - one.heads[i]).next_multiple_of(2 * mib))
                    .max()
                    .unwrap();
                assert!(
                    one.ring_bytes >= slot && one.ring_bytes < 2 * slot,
                    "{d}/{kv} {pct}%: ring {} for slot {slot}",
                    one.ring_bytes
                );
                assert!(
                    (0..sizes.len()).all(|i| one.resident[i]
                        || one.offsets[i] + (sizes[i] - one.heads[i]).next_multiple_of(2 * mib) <= one.ring_bytes),
                    "{d}/{kv} {pct}%: a tail overruns the ring"
                );
                assert!(
                    one.streamed_bytes < two.streamed_bytes || (d == 4096 && one.streamed_bytes == two.streamed_bytes),
                    "{d}/{kv} {pct}%: one slot streams {} ≥ two slots' {}",
                    one.streamed_bytes,
                    two.streamed_bytes
                );
            }
        }
        assert_eq!(split_plan(&[4, 4], &[1, 1], 1, 4, 3), None, "slots other than 1 or 2 are refused");
    }
}
