//! The residency manager: acquire/release around each use, eviction under a
//! byte budget, prefetch along the declared cycle.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::config::ResidencyConfig;
use super::ledger::Ledger;
use super::plan_state::PlanState;
use super::read_fence::Reused;
use super::registry::{Entry, HostRangeId, Loc, RangeReg, RegState, RegisterSources, Registry};
use super::stats::{Counters, HARVEST_BATCH, ResidencyStats, StallTimer};
use super::{Policy, WeightId, new_policy};
use crate::arena::{Arena, ArenaConfig, DeviceArena};
use crate::device::rlimit::memlock_limit;
use crate::device::{Device, Event, HostRange, RawStream, Stream};
use crate::error::{Error, Result};
use crate::staging::background::Hint;
use crate::staging::{BackgroundFill, Copier, CopyEngine, Fence, PinnedStagingPool};
use crate::transfer::pinning::SharedHostRegistration;

/// Why a unit is paged in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Need {
    /// An acquire needs it now: evict what the policy says, or fail.
    Demand,
    /// The first missing unit ahead: may evict only units needed later.
    Prefetch,
    /// Further ahead in the prefetch window: only into room nothing has to
    /// leave for.
    PrefetchIntoFree,
}

impl Need {
    pub(super) fn demand(self) -> bool {
        self == Need::Demand
    }
}

/// What making room for a page-in produced.
pub(super) enum Room {
    /// The budget has room: allocate from the arena.
    Fits,
    /// A victim's block, handed on behind its readers.
    Reuse(Reused),
    /// A prefetch that would have to evict something needed sooner.
    No,
}

#[derive(Debug)]
pub(super) struct State {
    pub(super) reg: Registry,
    pub(super) policy: Box<dyn Policy>,
    /// The declared cycle, the holds seen, and the plan installed for them.
    pub(super) plan: PlanState,
    /// The budget's books (resident bytes, decode staging reserve).
    pub(super) ledger: Ledger,
    pub(super) c: Counters,
    pub(super) stalls: StallTimer,
    /// Spent release events, reused so a release creates none in steady state.
    pub(super) spare: Vec<Event>,
    pub(super) memlock: Option<u64>,
    /// Gates page-ins into reused blocks behind their readers (see
    /// [`Fenced::reuse_after`]).
    pub(super) order: Stream,
    /// Issues staged prefetches off the caller's thread (started on the
    /// first one; see `staging::background`).
    pub(super) fill: Option<BackgroundFill>,
    /// A weight prefetch may not evict: the one just released (see `release`).
    pub(super) shield: Option<WeightId>,
    /// Device staging of compressed page-ins (from the first compressed
    /// registration; its size is in the ledger).
    pub(super) dec: Option<super::decode::DecodeStaging>,
    /// Timing events around decodes.
    pub(super) decode_timer: StallTimer,
}

impl State {
    /// Every unit is on the device (in a block or the ring): the ledger
    /// counts resident units, the registry all of them.
    pub(super) fn all_resident(&self) -> bool {
        self.ledger.resident_weights() >= self.reg.units()
    }
    /// Panics if an invariant of the state does not hold: each part's own
    /// (the ledger's, the registry's, the cycle and plan's), and that they
    /// agree: the ledger's resident bytes are the units in their own blocks
    /// (at their device length) plus the streaming region, its resident
    /// units those with a device copy; ring occupants exist only with a ring
    /// and are streamed units; the plan state's `held` counts the units
    /// acquired.
    // Called after every mutation in debug builds only (and by tests).
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    pub(super) fn check(&self) {
        self.ledger.check();
        self.reg.check();
        self.plan.check();
        let (mut bytes, mut units, mut held) = (self.plan.ring().map_or(0, |r| r.charged()), 0, 0);
        for w in self.reg.ids() {
            let Ok(e) = self.reg.get(w) else { continue };
            match &e.loc {
                Loc::Host => {}
                Loc::Block(_) => {
                    bytes += e.dev_len();
                    units += 1;
                }
                Loc::Ring(_) => {
                    assert!(self.plan.streams(w), "weight {} in a ring slot", w.0);
                    units += 1;
                }
            }
            held += (e.users > 0) as usize;
        }
        assert_eq!(bytes, self.ledger.resident_bytes(), "the ledger's resident bytes are not the units'");
        assert_eq!(units, self.ledger.resident_weights(), "the ledger's resident units are not the registry's");
        assert_eq!(held, self.plan.held(), "the units held are not the number of units acquired");
    }
}

/// The locked state; checks its invariants when dropped, in debug builds.
pub(super) struct Checked<'a>(MutexGuard<'a, State>);

impl std::ops::Deref for Checked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.0
    }
}
impl std::ops::DerefMut for Checked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.0
    }
}
impl Drop for Checked<'_> {
    fn drop(&mut self) {
        #[cfg(debug_assertions)]
        if !std::thread::panicking() {
            self.0.check();
        }
    }
}

/// Keeps registered weights resident on the device within a byte budget.
/// Thread-safe: every call takes one internal lock.
#[derive(Debug)]
pub struct ResidencyManager {
    pub(super) dev: Arc<dyn Device>,
    pub(super) cfg: ResidencyConfig,
    pub(super) arena: Arc<DeviceArena>,
    pub(super) engine: Arc<CopyEngine>,
    pub(super) state: Mutex<State>,
    /// Idle streams of [`Self::acquire_host`] and [`Self::release_host`],
    /// kept for the next host use: making one per call cost a thread spawn
    /// and join on the host device (~130 µs a weight) and a
    /// `cuStreamCreate`/`cuStreamDestroy` pair on CUDA.
    host_streams: Mutex<Vec<Stream>>,
}

/// Idle host-use streams kept at most; more concurrent host uses make and
/// drop their own.
const HOST_STREAMS_KEPT: usize = 8;

impl ResidencyManager {
    pub fn new(dev: &Arc<dyn Device>, mut cfg: ResidencyConfig) -> Result<Self> {
        if cfg.fill_ahead_chunks == super::FILL_AHEAD_ALL_SLOTS {
            cfg.fill_ahead_chunks = cfg.engine.slots;
        }
        crate::ensure!(cfg.budget_bytes > 0, InvalidArgument, "residency budget of 0 bytes");
        crate::ensure!(
            cfg.fill_ahead_chunks <= cfg.engine.slots,
            InvalidConfig,
            "fill_ahead_chunks {} exceeds the staging slots ({}): chunks filled ahead hold slots \
             (FILL_AHEAD_ALL_SLOTS, the default, fills as many as there are slots)",
            cfg.fill_ahead_chunks,
            cfg.engine.slots
        );
        // Slack over the budget absorbs the arena's bin rounding and holes
        // left by uneven sizes, so eviction follows the policy rather than
        // fragmentation.
        // Rounded up to whole chunks here: the arena's bound is its capacity
        // (to the granule), and the manager's documented reservation
        // (`budget_bytes` in include/epmem.h) is whole chunks.
        let chunk = crate::arena::chunk_size(cfg.arena_chunk_bytes, dev.vmm_granularity())?;
        let capacity = cfg
            .budget_bytes
            .checked_add(cfg.budget_bytes / 8 + 2 * dev.vmm_granularity())
            .and_then(|c| c.checked_next_multiple_of(chunk))
            .filter(|&c| c <= crate::arena::MAX_CAPACITY)
            .ok_or_else(|| {
                crate::error::Error::invalid_argument(format!(
                    "budget_bytes {} is too large: its device arena (budget + 1/8 + 2 granules, in whole chunks \
                     of {chunk} bytes) would exceed the arena limit of {} bytes",
                    cfg.budget_bytes,
                    crate::arena::MAX_CAPACITY
                ))
            })?;
        let arena = Arc::new(DeviceArena::new(
            dev,
            ArenaConfig { capacity, chunk_bytes: cfg.arena_chunk_bytes, max_allocs: 64 * 1024 },
        )?);
        let pool = PinnedStagingPool::new(dev, cfg.pool)?;
        let engine = Arc::new(CopyEngine::new(&pool, cfg.engine)?);
        Ok(Self {
            dev: dev.clone(),
            cfg,
            arena,
            engine,
            state: Mutex::new(State {
                reg: Registry::default(),
                policy: new_policy(cfg.policy),
                plan: PlanState::default(),
                ledger: Ledger::new(cfg.budget_bytes),
                c: Counters::default(),
                stalls: StallTimer::default(),
                spare: Vec::new(),
                memlock: memlock_limit(),
                order: Stream::new(dev)?,
                fill: None,
                shield: None,
                dec: None,
                decode_timer: StallTimer::default(),
            }),
            host_streams: Mutex::new(Vec::new()),
        })
    }

    pub fn config(&self) -> &ResidencyConfig {
        &self.cfg
    }
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }
    /// The device arena resident weights live in.
    pub fn arena(&self) -> &Arc<DeviceArena> {
        &self.arena
    }

    /// The state, its invariants ([`State::check`]) checked in debug builds
    /// when the guard is dropped: after every operation, failed ones too.
    pub(super) fn lock(&self) -> Checked<'_> {
        Checked(self.lock_unchecked())
    }

    fn lock_unchecked(&self) -> MutexGuard<'_, State> {
        // Every mutation completes before the next fallible call, so a
        // poisoned lock still guards consistent state.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    // ---- registry ---------------------------------------------------------

    /// Register a weight: `range` must stay readable and unmodified until the
    /// weight is unregistered (and any page-in of it has completed).
    pub fn register(&self, range: HostRange) -> Result<WeightId> {
        let mut st = self.lock();
        crate::ensure!(
            range.len() <= self.budget(&st),
            OutOfBudget,
            "a weight of {} bytes can never be resident under a budget of {} bytes{}",
            range.len(),
            self.cfg.budget_bytes,
            if st.ledger.staging_reserve() > 0 {
                format!(" less {} bytes of decode staging for compressed weights", st.ledger.staging_reserve())
            } else {
                String::new()
            }
        );
        st.reg.add(range)
    }

    /// Unregister a weight. It must not be acquired; if resident, waits for
    /// its fences and frees its device memory. It leaves the declared cycle.
    pub fn unregister(&self, w: WeightId) -> Result<()> {
        let mut st = self.lock();
        let u = st.reg.leader(w)?;
        let e = st.reg.get(u)?;
        if e.users > 0 {
            // Acquisitions are counted per page-in unit: with coalescing,
            // `w` may be idle while another weight of its unit is acquired.
            crate::bail!(InvalidState, "{}", acquired_message(&st, u, "unregister", w)?);
        }
        self.ungroup(&mut st, u)?;
        if st.reg.get(w)?.resident() {
            self.evict(&mut st, w)?;
        }
        // Its bytes (or a coalesced unit's around them) may be freed or
        // reused once this returns: nothing filled ahead from them may be read
        // again or used.
        self.engine.forget_ahead();
        let e = st.reg.remove(w)?;
        st.c.registered_bytes -= e.reg_bytes as u64;
        if let Some(k) = e.coded.as_ref() {
            // The manager owns these bytes: no copy may still read them
            // when they are freed below.
            st.c.compressed_weights -= 1;
            st.c.compressed_host_bytes -= k.buf.len() as u64;
            st.c.compressed_raw_bytes -= k.desc.raw_len() as u64;
            self.engine.synchronize()?;
        }
        if st.plan.pos(w).is_some() {
            // No longer the order declared.
            let order: Vec<WeightId> = st.plan.cycle().iter().copied().filter(|&x| x != w).collect();
            Self::set_cycle(&mut st, &order, false)?;
        }
        drop(st);
        drop(e); // a per-weight registration synchronizes the device when dropped
        Ok(())
    }

    /// Register a whole host range once (read-only), so every weight inside
    /// it is copied directly. `range` must outlive the registration.
    pub fn register_host_range(&self, range: HostRange) -> Result<HostRangeId> {
        let r = self.engine.register(range)?;
        let mut st = self.lock();
        st.c.registered_bytes += range.len() as u64;
        Ok(st.reg.add_range(RangeReg::Own(r)))
    }

    /// Use a registration made once for several devices
    /// ([`SharedHostRegistration`]): weights inside it are copied directly
    /// from the same host bytes every attached manager reads, with no
    /// registration by this manager. Undo with
    /// [`Self::unregister_host_range`]; the bytes stay registered until the
    /// last holder lets go. Counted in `attached_bytes`, not `registered_bytes`.
    pub fn attach_host_registration(&self, reg: &SharedHostRegistration) -> Result<HostRangeId> {
        let a = reg.attach(&self.dev)?;
        let mut st = self.lock();
        st.c.attached_bytes += a.range().len() as u64;
        Ok(st.reg.add_range(RangeReg::Attached(a)))
    }

    /// Undo [`Self::register_host_range`] (synchronizes the device first).
    /// Weights inside it stay registered and are staged from now on.
    pub fn unregister_host_range(&self, id: HostRangeId) -> Result<()> {
        let r = {
            let mut st = self.lock();
            let r = st.reg.remove_range(id)?;
            match &r {
                RangeReg::Own(_) => st.c.registered_bytes -= r.range().len() as u64,
                RangeReg::Attached(_) => st.c.attached_bytes -= r.range().len() as u64,
            }
            r
        };
        drop(r);
        Ok(())
    }

    /// Bytes of a registered weight on the device (a compressed weight's
    /// decoded length).
    pub fn weight_len(&self, w: WeightId) -> Result<usize> {
        let st = self.lock();
        let e = st.reg.get(w)?;
        Ok(e.coded.as_ref().map_or(e.range.len(), |k| k.desc.raw_len()))
    }
    /// Whether `w` is stored compressed (decoded on the device at page-in).
    pub fn is_compressed(&self, w: WeightId) -> Result<bool> {
        Ok(self.lock().reg.get(w)?.coded.is_some())
    }
    pub fn is_resident(&self, w: WeightId) -> Result<bool> {
        let st = self.lock();
        Ok(st.reg.get(st.reg.leader(w)?)?.resident())
    }

    // ---- the cycle and prefetch -----------------------------------------

    /// Declare the cyclic order of a decode step. The policy evicts by it
    /// and `release` prefetches up to `prefetch_depth` weights ahead along it.
    ///
    /// Small weights adjacent in host memory and in `order` are coalesced
    /// into one unit (see [`ResidencyConfig::coalesce_below_bytes`]); a
    /// previous grouping is undone first, evicting coalesced units, so no
    /// weight may be acquired during the call.
    pub fn declare_cycle(&self, order: &[WeightId]) -> Result<()> {
        let mut st = self.lock();
        let mut seen = std::collections::HashSet::with_capacity(order.len());
        for &w in order {
            st.reg.get(w)?;
            crate::ensure!(seen.insert(w), InvalidArgument, "weight {} appears twice in the cyclic order", w.0);
        }
        // A caller may declare the same order every step (a framework hook):
        // keep the grouping and the plan rather than redo them (planning an
        // 80-layer model takes up to a second; regrouping evicts units).
        if !order.is_empty() && st.plan.declared() == order {
            return Ok(());
        }
        let leaders: Vec<WeightId> =
            st.reg.ids().filter(|&w| st.reg.get(w).is_ok_and(|e| !e.members.is_empty())).collect();
        // Regrouping evicts every coalesced unit, so none may be acquired
        // (a weight that is not coalesced may be). Check them all before
        // undoing any, so a refusal changes nothing.
        for &u in &leaders {
            if st.reg.get(u)?.users > 0 {
                crate::bail!(InvalidState, "{}", acquired_message(&st, u, "declare a cycle", u)?);
            }
        }
        for u in leaders {
            self.ungroup(&mut st, u)?;
        }
        self.group(&mut st, order)?;
        Self::set_cycle(&mut st, order, true)?;
        // A new cycle wants a plan. A plan evicts what it does not keep: with
        // weights held, it waits for the cycle to wrap with nothing held
        // (see `acquire`).
        if st.plan.held() == 0 {
            self.install_plan(&mut st)?;
        }
        Ok(())
    }

    /// Page in `weights` ahead of use, in order, as far as the budget allows
    /// without evicting anything needed sooner. Returns how many page-ins
    /// were issued. Never waits for a copy.
    pub fn prefetch(&self, weights: &[WeightId]) -> Result<usize> {
        let mut st = self.lock();
        let mut n = 0;
        for &w in weights {
            let w = st.reg.leader(w)?;
            if !st.reg.get(w)?.resident() {
                if !self.page_in(&mut st, w, Need::Prefetch)? {
                    break;
                }
                n += 1;
            }
        }
        Ok(n)
    }

    // ---- acquire / release ----------------------------------------------

    /// Make weight `w` usable by work queued on `stream` from now on, and
    /// return its device address. On a miss the page-in is issued and
    /// `stream` is made to wait on its fence; on a hit (or a completed
    /// prefetch) the host never waits. Pair with [`Self::release`], which
    /// also prefetches the next weights of the declared cycle.
    ///
    /// Errors: an unknown weight is `InvalidArgument`; when making room would
    /// mean evicting a weight that is acquired and not released, `AllInUse`.
    pub fn acquire(&self, w: WeightId, stream: RawStream) -> Result<u64> {
        let mut st = self.lock();
        let st = &mut *st;
        self.harvest(st, HARVEST_BATCH)?;
        let offset = st.reg.get(w)?.offset as u64;
        let w = st.reg.leader(w)?;
        self.replan_if_idle(st, w)?;
        let e = st.reg.get_mut(w)?;
        let hit = e.resident() && !e.prefetched;
        if std::mem::take(&mut e.prefetched) {
            st.c.pending_prefetches -= 1;
        }
        if !e.resident() {
            self.page_in(st, w, Need::Demand)?;
        }
        st.c.acquires += 1;
        st.c.hits += hit as u64;
        st.policy.accessed(w);
        let e = st.reg.get_mut(w)?;
        e.users += 1;
        if e.users == 1 {
            st.plan.note_hold(w);
        }
        let r = (|| {
            let e = st.reg.get_mut(w)?;
            let (addr, done, fence) = match &mut e.loc {
                Loc::Block(b) => (b.addr(), b.page_in_done()?, b.page_in()),
                Loc::Ring(s) => (s.addr(), s.page_in_done()?, s.page_in()),
                Loc::Host => return Err(Error::internal("acquired weight has no block")),
            };
            let addr = addr + offset;
            if !done {
                if let Some(f) = fence {
                    if self.cfg.sync_page_in {
                        let t = Instant::now();
                        f.wait()?;
                        st.c.host_stall_ns += t.elapsed().as_nanos() as u64;
                    } else {
                        if f.is_pending() {
                            // The background fill is behind: the host waits
                            // for the copy to be enqueued (never a stream
                            // waiting on an event not yet recorded).
                            let t = Instant::now();
                            f.ready()?;
                            st.c.background_wait_ns += t.elapsed().as_nanos() as u64;
                            st.c.background_waits += 1;
                        }
                        st.stalls.around(&self.dev, stream, || f.make_wait(stream))?;
                    }
                }
            }
            Ok(addr)
        })();
        // A failed acquire must not leave the weight acquired: the caller
        // will not release it, and it could never be evicted (found by
        // tests/fault_injection.rs with an injected event fault).
        if r.is_err()
            && let Ok(e) = st.reg.get_mut(w)
        {
            e.users -= 1;
            if e.users == 0 {
                st.plan.note_release();
            }
        }
        r
    }

    /// Acquire `w` for a use from the host (synchronous calls, CPU kernels on
    /// the host device): as [`Self::acquire`], but the calling thread waits
    /// until the page-in (if any) has landed, so everything issued after this
    /// returns, on any stream or synchronously, sees the weight's bytes. End
    /// the use with [`Self::release_host`].
    ///
    /// The wait is queued on an idle stream of the manager's own and that
    /// stream synchronized, so the host waits for the page-in and nothing
    /// else; the stream is kept for the next host use.
    pub fn acquire_host(&self, w: WeightId) -> Result<u64> {
        let s = self.host_stream()?;
        let addr = match self.acquire(w, s.raw()) {
            Ok(a) => a,
            Err(e) => {
                self.keep_host_stream(s);
                return Err(e);
            }
        };
        if let Err(e) = s.synchronize() {
            // Not acquired after all: the caller will not release it. The
            // stream is dropped, not kept: it may hold the failed work.
            let _ = self.release(w, s.raw());
            return Err(e);
        }
        self.keep_host_stream(s);
        Ok(addr)
    }

    /// End a host use of `w` begun by [`Self::acquire_host`]: the caller's
    /// host-side reads have returned, so the read fence is recorded on an idle
    /// stream of the manager's own, complete at once.
    pub fn release_host(&self, w: WeightId) -> Result<()> {
        let s = self.host_stream()?;
        let r = self.release(w, s.raw());
        self.keep_host_stream(s);
        r
    }

    fn host_stream(&self) -> Result<Stream> {
        let kept = self.host_streams.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match kept {
            Some(s) => Ok(s),
            None => Stream::new(&self.dev),
        }
    }

    fn keep_host_stream(&self, s: Stream) {
        let mut kept = self.host_streams.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() < HOST_STREAMS_KEPT {
            kept.push(s);
        }
    }

    /// End a use of `w` on `stream`: records the read fence. The weight stays
    /// resident and may be evicted once the work queued on `stream` so far
    /// has completed — never before.
    ///
    /// While every unit is resident (a budget that holds them all) a unit
    /// in its own block is released without an event: nothing is about to
    /// be evicted, and its eviction, if it comes, synchronizes the device
    /// first (`Fenced::note_unfenced_read`). That keeps a driver call off
    /// every release of the common all-resident case.
    pub fn release(&self, w: WeightId, stream: RawStream) -> Result<()> {
        let mut st = self.lock();
        let st = &mut *st;
        let w = st.reg.leader(w)?;
        let e = st.reg.get(w)?;
        crate::ensure!(e.users > 0, InvalidState, "weight {} released more often than acquired", w.0);
        // Every unit resident: a unit in its own block is fenced by a device
        // synchronize instead of an event (see above).
        let ev = if st.all_resident() && e.loc.is_block() {
            None
        } else {
            let ev = match st.spare.pop() {
                Some(ev) => ev,
                None => Event::new(&self.dev, false)?,
            };
            ev.record_raw(stream)?;
            Some(ev)
        };
        let e = st.reg.get_mut(w)?;
        e.users -= 1;
        if e.users == 0 {
            st.plan.note_release();
        }
        match (&mut e.loc, ev) {
            (Loc::Block(b), ev) => {
                let spent = b.prune()?;
                match ev {
                    Some(ev) => b.push(ev),
                    None => b.note_unfenced_read(),
                }
                st.spare.extend(spent);
            }
            (Loc::Ring(s), Some(ev)) => {
                let spent = s.prune()?;
                s.push(ev);
                st.spare.extend(spent);
            }
            _ => {}
        }
        // Prefetch here, not in acquire: the caller's kernel for `w` is queued
        // by now, so whatever the host spends on the next page-ins (a staged
        // fill, a slot wait) overlaps that kernel instead of delaying its
        // launch. `w` itself is shielded: it was in use when acquire would
        // have prefetched, so the choices are the same as there.
        st.shield = Some(w);
        let r = self.prefetch_ahead(st, w);
        st.shield = None;
        // The release itself is done: failing it now would tell the caller
        // the weight is still acquired when it is not (tests/fault_injection.rs).
        // The prefetch is only ahead of demand; the next acquire pages in on
        // demand and reports a device error that persists.
        if let Err(e) = r {
            log::warn!("epmem: prefetch after releasing weight {} failed: {e}", w.0);
        }
        Ok(())
    }

    // ---- internals ------------------------------------------------------

    /// Who issues unit `w`'s page-in: a prefetch that
    /// [`Self::fills_in_background`] goes to the background filler, so the
    /// caller's thread — the one launching kernels — does not spend the fill;
    /// everything else is issued on the caller's thread.
    pub(super) fn copier<'s>(&'s self, st: &'s mut State, w: WeightId, demand: bool) -> Result<Copier<'s>> {
        if demand || !self.fills_in_background(st, w) {
            return Ok(Copier::Caller(&self.engine));
        }
        let State { fill, c, .. } = st;
        if fill.is_none() {
            *fill = Some(BackgroundFill::new(&self.engine, self.cfg.fill_ahead_chunks)?);
        }
        c.background_page_ins += 1;
        let next = self.fill_ahead_hint(st, w);
        match st.fill.as_ref() {
            Some(f) => Ok(Copier::Background(f, next)),
            None => Err(Error::internal("background filler missing")),
        }
    }

    /// The unit the filler may fill ahead after `w`'s page-in: the next unit
    /// along the declared cycle that is not resident, if its page-in would go
    /// to the filler too (the one the next `release` is expected to
    /// prefetch). None with `fill_ahead_chunks` 0.
    fn fill_ahead_hint(&self, st: &State, w: WeightId) -> Option<Hint> {
        if self.cfg.fill_ahead_chunks == 0 {
            return None;
        }
        let p = st.plan.pos(w)?;
        let cycle = st.plan.cycle();
        let n = cycle.len();
        let x = (1..n).map(|k| cycle[(p + k) % n]).find(|&x| st.reg.get(x).is_ok_and(|e| !e.resident()))?;
        // Taken under the manager's lock, which `unregister` holds when it
        // calls `forget_ahead`: `x`'s source is readable while the ticket is.
        if !self.fills_in_background(st, x) {
            return None;
        }
        // A split unit copies its tail (its head went in once).
        let unit = st.reg.get(x).ok()?.unit;
        let from = st.plan.split_of(x).map_or(0, |(head, _)| head);
        let src = unit.slice(from, unit.len().checked_sub(from)?).ok()?;
        Some(Hint { src, ticket: self.engine.ahead_ticket() })
    }

    /// Whether a page-in of unit `w` would go to the background filler: a
    /// prefetch from a source that will be staged (not page-locked, and not
    /// about to be registered on this page-in).
    pub(super) fn fills_in_background(&self, st: &State, w: WeightId) -> bool {
        if self.cfg.caller_fills || self.cfg.sync_page_in {
            return false;
        }
        st.reg.get(w).is_ok_and(|e| {
            let will_register = e.reg_state == RegState::Untried && self.cfg.register_sources != RegisterSources::Never;
            !will_register && self.engine.stages(e.unit)
        })
    }

    /// Whether a prefetch of `target` must leave `v` alone because it is the
    /// unit just released (see `release`). A raw copy ordered on the device
    /// waits for that read anyway, so the next acquire's demand page-in loses
    /// nothing by waiting too — unless part of the page-in can run before the
    /// read ends:
    /// - a staged page-in issued now is filled by the background thread while
    ///   the read runs; issued on demand it is filled by the caller, in series
    ///   with everything else;
    /// - a compressed page-in's copy goes into the decode staging, not into
    ///   `v`'s bytes: only its decode waits for the read (`compressed_in`),
    ///   so issued now its copy overlaps the read, and on demand it would
    ///   start only when the host reaches the next acquire (a one-slot ring of
    ///   compressed tails pages every tail in that way).
    ///
    /// So such a prefetch may overwrite the unit just released, except a
    /// coalesced unit (its next member is acquired next).
    pub(super) fn shielded(&self, st: &State, v: WeightId, target: WeightId) -> bool {
        if Some(v) != st.shield {
            return false;
        }
        let coalesced = st.reg.get(v).map_or(true, |e| !e.members.is_empty());
        let early = self.fills_in_background(st, target) || st.reg.get(target).is_ok_and(|e| e.coded.is_some());
        coalesced || !early
    }

    /// Issue the page-in copy of unit `w`, whose device bytes start at
    /// `dst`, from its byte `from` on (0: all of it; a split unit's tail
    /// starts on a frame when compressed), after the order stream when
    /// `ordered`, through [`Self::copier`].
    pub(super) fn copy_in(
        &self,
        st: &mut State,
        w: WeightId,
        dst: u64,
        from: usize,
        ordered: bool,
        demand: bool,
    ) -> Result<Fence> {
        let range = st.reg.get(w)?.unit;
        let order = ordered.then(|| st.order.raw());
        if st.reg.get(w)?.coded.is_some() {
            return self.compressed_in(st, w, dst, from, order);
        }
        let src = range.slice(from, range.len().saturating_sub(from))?;
        self.copier(st, w, demand)?.htod_after(dst + from as u64, src, order)
    }

    /// Read the timers' completed measurements into the counters, each
    /// timer once `batch` are pending (0: whatever has completed). The hot
    /// path passes [`HARVEST_BATCH`]: its stats lag until then, or until
    /// `stats`/`synchronize` read them all.
    fn harvest(&self, st: &mut State, batch: usize) -> Result<()> {
        st.c.device_stall_ms += st.stalls.harvest_batch(batch)?;
        st.c.decode_ms += st.decode_timer.harvest_batch(batch)?;
        Ok(())
    }

    /// Wait for every page-in and read fence, so the stats are final.
    pub fn synchronize(&self) -> Result<()> {
        // Copies still queued for the background filler are on no stream yet.
        if let Some(f) = self.lock().fill.as_ref() {
            f.drain();
        }
        self.engine.synchronize()?;
        self.dev.synchronize()?;
        let mut st = self.lock();
        self.harvest(&mut st, 0)
    }

    /// A snapshot of the counters (times lag until their events complete;
    /// call [`Self::synchronize`] first for final figures).
    pub fn stats(&self) -> ResidencyStats {
        let mut st = self.lock();
        let _ = self.harvest(&mut st, 0);
        let s = self.engine.stats();
        let c = st.c;
        let host_stall_ms = c.host_stall_ns as f64 / 1e6;
        ResidencyStats {
            acquires: c.acquires,
            hits: c.hits,
            hit_rate: if c.acquires == 0 { 0.0 } else { c.hits as f64 / c.acquires as f64 },
            page_ins: c.page_ins,
            prefetch_page_ins: c.prefetch_page_ins,
            pending_prefetches: c.pending_prefetches,
            wasted_prefetches: c.wasted_prefetches,
            evictions: c.evictions,
            eviction_waits: c.eviction_waits,
            ordered_reuses: c.ordered_reuses,
            coalesced_weights: c.coalesced_weights,
            bypassed_page_ins: s.bypassed,
            staged_page_ins: s.copies - s.bypassed,
            source_registrations: c.source_registrations,
            register_refusals: c.register_refusals,
            registered_bytes: c.registered_bytes,
            attached_bytes: c.attached_bytes,
            htod_bytes: s.htod_bytes,
            pinned_alloc_calls: s.pinned_alloc_calls,
            pinned_reuses: s.pinned_reuses,
            fill_ms: s.fill_ms,
            htod_ms: s.htod_ms,
            stall_ms: c.device_stall_ms + host_stall_ms,
            device_stall_ms: c.device_stall_ms,
            host_stall_ms,
            ring_bytes: st.plan.ring().map_or(0, |r| r.cap() as u64),
            planned_resident_bytes: st.plan.plan().map_or(0, |p| p.resident_bytes as u64),
            ring_page_ins: c.ring_page_ins,
            plans: c.plans,
            dropped_rings: c.dropped_rings,
            split_weights: st.plan.plan().map_or(0, |p| p.heads.iter().filter(|&&h| h > 0).count() as u64),
            split_head_bytes: st.plan.plan().map_or(0, |p| p.heads.iter().sum::<usize>() as u64),
            background_page_ins: c.background_page_ins,
            background_waits: c.background_waits,
            background_wait_ms: c.background_wait_ns as f64 / 1e6,
            fill_ahead_bytes: s.ahead_bytes,
            fill_ahead_used_bytes: s.ahead_used_bytes,
            slot_wait_ms: s.slot_wait_ms,
            background_busy_ms: st.fill.as_ref().map_or(0.0, |f| f.busy().as_secs_f64() * 1e3),
            ring_weights: c.ring_weights,
            compressed_weights: c.compressed_weights,
            compressed_host_bytes: c.compressed_host_bytes,
            compressed_raw_bytes: c.compressed_raw_bytes,
            decode_staging_bytes: st.ledger.staging_reserve() as u64,
            compressed_htod_bytes: c.compressed_htod_bytes,
            decoded_bytes: c.decoded_bytes,
            decodes: c.decodes,
            decode_ms: c.decode_ms,
            resident_bytes: st.ledger.resident_bytes() as u64,
            peak_resident_bytes: st.ledger.peak_resident_bytes() as u64,
            resident_weights: st.ledger.resident_weights() as u64,
            registered_weights: st.reg.len() as u64,
            budget_bytes: self.cfg.budget_bytes as u64,
            arena: self.arena.stats(),
        }
    }

    /// Registered weights.
    pub fn weights(&self) -> Vec<WeightId> {
        self.lock().reg.ids().collect()
    }
}

impl Drop for ResidencyManager {
    fn drop(&mut self) {
        // Resident blocks wait for their fences when dropped (Fenced::drop);
        // drop them before the engine and arena go.
        let mut st = self.lock_unchecked();
        // Every queued background copy onto a stream first, so the device
        // synchronizes below cover them; nothing read ahead after it.
        if let Some(f) = st.fill.as_ref() {
            f.drain();
        }
        self.engine.forget_ahead();
        // Compressed weights' host bytes are the manager's: no copy may read
        // them once freed. If the copies cannot be observed, leak them.
        if let Err(e) = self.engine.synchronize() {
            log::error!("epmem: leaking compressed weights' host copies: copies could not be observed ({e})");
            let ids: Vec<WeightId> = st.reg.ids().collect();
            for w in ids {
                if let Ok(e) = st.reg.get_mut(w) {
                    std::mem::forget(e.coded.take());
                }
            }
        }
        let ids: Vec<WeightId> = st.reg.ids().collect();
        for w in ids {
            if let Ok(e) = st.reg.remove(w) {
                let Entry { loc, reg, .. } = e;
                drop(loc);
                drop(reg);
            }
        }
        // The streaming region synchronizes the device before its memory goes.
        drop(st.plan.release());
        st.dec = None;
    }
}

/// Why `what` is refused while page-in unit `u` (containing `w`) is
/// acquired, naming the weights: acquisitions count per unit, so with
/// coalescing the acquired weight may be another member than `w`.
fn acquired_message(st: &State, u: WeightId, what: &str, w: WeightId) -> Result<String> {
    let e = st.reg.get(u)?;
    if e.members.is_empty() {
        return Ok(format!("cannot {what}: weight {} is acquired {} time(s): release it first", w.0, e.users));
    }
    let unit: Vec<String> = std::iter::once(u).chain(e.members.iter().copied()).map(|m| m.0.to_string()).collect();
    Ok(format!(
        "cannot {what}: weight {} is coalesced into one page-in with weights {{{}}}, which is acquired {} time(s) \
         (through one of those weights): release it first",
        w.0,
        unit.join(", "),
        e.users
    ))
}
