//! The residency manager: acquire/release around each use, eviction under a
//! byte budget, prefetch along the declared cycle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::config::ResidencyConfig;
use super::fence::{DeviceBlock, Fenced, Retire};
use super::registry::{memlock_limit, Entry, HostRangeId, RegState, RegisterSources, Registry};
use super::stats::{Counters, ResidencyStats, StallTimer};
use super::{new_policy, Policy, WeightId};
use crate::arena::{Arena, ArenaConfig, DeviceArena};
use crate::device::{Device, Event, HostRange, RawStream};
use crate::error::{EpmStatus, Error, Result};
use crate::staging::{CopyEngine, PinnedStagingPool};

#[derive(Debug)]
struct State {
    reg: Registry,
    policy: Box<dyn Policy>,
    /// The declared cycle and each weight's position in it.
    cycle: Vec<WeightId>,
    cycle_pos: HashMap<WeightId, usize>,
    resident_bytes: usize,
    peak_resident_bytes: usize,
    resident_weights: usize,
    c: Counters,
    stalls: StallTimer,
    /// Spent release events, reused so a release creates none in steady state.
    spare: Vec<Event>,
    memlock: Option<u64>,
}

/// Keeps registered weights resident on the device within a byte budget.
/// Thread-safe: every call takes one internal lock.
#[derive(Debug)]
pub struct ResidencyManager {
    dev: Arc<dyn Device>,
    cfg: ResidencyConfig,
    arena: Arc<DeviceArena>,
    engine: CopyEngine,
    state: Mutex<State>,
}

impl ResidencyManager {
    pub fn new(dev: &Arc<dyn Device>, cfg: ResidencyConfig) -> Result<Self> {
        crate::ensure!(cfg.budget_bytes > 0, InvalidArgument, "residency budget of 0 bytes");
        // Slack over the budget absorbs the arena's bin rounding and holes
        // left by uneven sizes, so eviction follows the policy rather than
        // fragmentation.
        let capacity = cfg.budget_bytes + cfg.budget_bytes / 8 + 2 * dev.vmm_granularity();
        let arena = Arc::new(DeviceArena::new(
            dev,
            ArenaConfig { capacity, chunk_bytes: cfg.arena_chunk_bytes, max_allocs: 64 * 1024 },
        )?);
        let pool = PinnedStagingPool::new(dev, cfg.pool)?;
        let engine = CopyEngine::new(&pool, cfg.engine)?;
        Ok(Self {
            dev: dev.clone(),
            cfg,
            arena,
            engine,
            state: Mutex::new(State {
                reg: Registry::default(),
                policy: new_policy(cfg.policy),
                cycle: Vec::new(),
                cycle_pos: HashMap::new(),
                resident_bytes: 0,
                peak_resident_bytes: 0,
                resident_weights: 0,
                c: Counters::default(),
                stalls: StallTimer::default(),
                spare: Vec::new(),
                memlock: memlock_limit(),
            }),
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

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every mutation completes before the next fallible call, so a
        // poisoned lock still guards consistent state.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    // ---- registry ---------------------------------------------------------

    /// Register a weight: `range` must stay readable and unmodified until the
    /// weight is unregistered (and any page-in of it has completed).
    pub fn register(&self, range: HostRange) -> Result<WeightId> {
        crate::ensure!(
            range.len() <= self.cfg.budget_bytes,
            OutOfBudget,
            "a weight of {} bytes can never be resident under a budget of {} bytes",
            range.len(),
            self.cfg.budget_bytes
        );
        self.lock().reg.add(range)
    }

    /// Unregister a weight. It must not be acquired; if resident, waits for
    /// its fences and frees its device memory. It leaves the declared cycle.
    pub fn unregister(&self, w: WeightId) -> Result<()> {
        let mut st = self.lock();
        let e = st.reg.get(w)?;
        crate::ensure!(e.users == 0, InvalidState, "weight {} is acquired {} time(s): release it first", w.0, e.users);
        if e.block.is_some() {
            self.evict(&mut st, w)?;
        }
        let e = st.reg.remove(w)?;
        if e.reg.is_some() {
            st.c.registered_bytes -= e.range.len() as u64;
        }
        if st.cycle_pos.contains_key(&w) {
            let order: Vec<WeightId> = st.cycle.iter().copied().filter(|&x| x != w).collect();
            Self::set_cycle(&mut st, order)?;
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
        Ok(st.reg.add_range(r))
    }

    /// Undo [`Self::register_host_range`] (synchronizes the device first).
    /// Weights inside it stay registered and are staged from now on.
    pub fn unregister_host_range(&self, id: HostRangeId) -> Result<()> {
        let r = {
            let mut st = self.lock();
            let r = st.reg.remove_range(id)?;
            st.c.registered_bytes -= r.range().len() as u64;
            r
        };
        drop(r);
        Ok(())
    }

    /// Bytes of a registered weight.
    pub fn weight_len(&self, w: WeightId) -> Result<usize> {
        Ok(self.lock().reg.get(w)?.range.len())
    }
    pub fn is_resident(&self, w: WeightId) -> Result<bool> {
        Ok(self.lock().reg.get(w)?.block.is_some())
    }

    // ---- the cycle and prefetch -----------------------------------------

    /// Declare the cyclic order of a decode step. The policy evicts by it
    /// and `acquire` prefetches `prefetch_depth` weights ahead along it.
    pub fn declare_cycle(&self, order: &[WeightId]) -> Result<()> {
        let mut st = self.lock();
        for &w in order {
            st.reg.get(w)?;
        }
        Self::set_cycle(&mut st, order.to_vec())
    }

    fn set_cycle(st: &mut State, order: Vec<WeightId>) -> Result<()> {
        st.policy.set_cycle(&order)?;
        st.cycle_pos = order.iter().enumerate().map(|(i, &w)| (w, i)).collect();
        st.cycle = order;
        Ok(())
    }

    /// Page in `weights` ahead of use, in order, as far as the budget allows
    /// without evicting anything needed sooner. Returns how many page-ins
    /// were issued. Never waits for a copy.
    pub fn prefetch(&self, weights: &[WeightId]) -> Result<usize> {
        let mut st = self.lock();
        let mut n = 0;
        for &w in weights {
            if st.reg.get(w)?.block.is_none() {
                if !self.page_in(&mut st, w, false)? {
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
    /// prefetch) the host never waits. Pair with [`Self::release`].
    ///
    /// Errors: an unknown weight is `InvalidArgument`; when making room would
    /// mean evicting a weight that is acquired and not released, `AllInUse`.
    pub fn acquire(&self, w: WeightId, stream: RawStream) -> Result<u64> {
        let mut st = self.lock();
        let st = &mut *st;
        self.harvest(st)?;
        let e = st.reg.get_mut(w)?;
        let hit = e.block.is_some() && !e.prefetched;
        if std::mem::take(&mut e.prefetched) {
            st.c.pending_prefetches -= 1;
        }
        if e.block.is_none() {
            self.page_in(st, w, true)?;
        }
        st.c.acquires += 1;
        st.c.hits += hit as u64;
        st.policy.accessed(w);
        st.reg.get_mut(w)?.users += 1;
        let r = (|| {
            let e = st.reg.get_mut(w)?;
            let block = e.block.as_mut().ok_or_else(|| Error::internal("acquired weight has no block"))?;
            let addr = block.addr();
            if !block.page_in_done()? {
                if let Some(f) = block.page_in() {
                    if self.cfg.sync_page_in {
                        let t = Instant::now();
                        f.wait()?;
                        st.c.host_stall_ns += t.elapsed().as_nanos() as u64;
                    } else {
                        st.stalls.around(&self.dev, stream, || f.make_wait(stream))?;
                    }
                }
            }
            self.prefetch_ahead(st, w)?;
            Ok(addr)
        })();
        // A failed acquire must not leave the weight acquired: the caller
        // will not release it, and it could never be evicted (found by
        // tests/fault_injection.rs with an injected event fault).
        if r.is_err()
            && let Ok(e) = st.reg.get_mut(w)
        {
            e.users -= 1;
        }
        r
    }

    /// End a use of `w` on `stream`: records the read fence. The weight stays
    /// resident and may be evicted once the work queued on `stream` so far
    /// has completed — never before.
    pub fn release(&self, w: WeightId, stream: RawStream) -> Result<()> {
        let mut st = self.lock();
        let st = &mut *st;
        let e = st.reg.get(w)?;
        crate::ensure!(e.users > 0, InvalidState, "weight {} released more often than acquired", w.0);
        let ev = match st.spare.pop() {
            Some(ev) => ev,
            None => Event::new(&self.dev, false)?,
        };
        ev.record_raw(stream)?;
        let e = st.reg.get_mut(w)?;
        e.users -= 1;
        if let Some(b) = e.block.as_mut() {
            let spent = b.prune()?;
            b.push(ev);
            st.spare.extend(spent);
        }
        Ok(())
    }

    // ---- internals ------------------------------------------------------

    /// Page `w` in. `demand`: an acquire needs it now (errors if no room);
    /// otherwise a prefetch, which gives up (Ok(false)) rather than evict a
    /// weight needed sooner.
    fn page_in(&self, st: &mut State, w: WeightId, demand: bool) -> Result<bool> {
        let len = st.reg.get(w)?.range.len();
        if !self.make_room(st, w, len, demand)? {
            return Ok(false);
        }
        let block = loop {
            match DeviceBlock::alloc(&self.arena, len) {
                Ok(b) => break b,
                // The arena has the bytes but not in one range: evict more.
                Err(e) if e.status() == EpmStatus::OutOfBudget => match self.victim(st, w, demand) {
                    Some(v) => self.evict(st, v)?,
                    None if demand => return Err(self.all_in_use(st, w, len)),
                    None => return Ok(false),
                },
                Err(e) => return Err(e),
            }
        };
        self.maybe_register(st, w)?;
        let range = st.reg.get(w)?.range;
        let fence = self.engine.htod(block.addr(), range, None)?;
        if self.cfg.sync_page_in {
            let t = Instant::now();
            fence.wait()?;
            st.c.host_stall_ns += t.elapsed().as_nanos() as u64;
        }
        let e = st.reg.get_mut(w)?;
        e.block = Some(Fenced::new(block, fence));
        e.prefetched = !demand;
        st.resident_bytes += len;
        st.resident_weights += 1;
        st.peak_resident_bytes = st.peak_resident_bytes.max(st.resident_bytes);
        st.policy.inserted(w);
        st.c.page_ins += 1;
        st.c.prefetch_page_ins += !demand as u64;
        st.c.pending_prefetches += !demand as u64;
        Ok(true)
    }

    /// Evict until `len` more bytes fit the budget.
    fn make_room(&self, st: &mut State, w: WeightId, len: usize, demand: bool) -> Result<bool> {
        while st.resident_bytes + len > self.cfg.budget_bytes {
            match self.victim(st, w, demand) {
                Some(v) => self.evict(st, v)?,
                None if demand => return Err(self.all_in_use(st, w, len)),
                None => return Ok(false),
            }
        }
        Ok(true)
    }

    /// The policy's best victim that is not acquired and is not `target`;
    /// for a prefetch, only one needed later than `target`.
    fn victim(&self, st: &State, target: WeightId, demand: bool) -> Option<WeightId> {
        let limit = if demand { None } else { st.policy.distance(target) };
        st.policy.candidates().find(|&v| {
            v != target
                && st.reg.get(v).is_ok_and(|e| e.users == 0 && e.block.is_some())
                && match (limit, st.policy.distance(v)) {
                    (Some(t), Some(d)) => d > t,
                    _ => true,
                }
        })
    }

    /// Evict `v`: its memory goes back to the arena only with a [`ReadsDone`]
    /// witness, waiting on the host if its readers are still running.
    ///
    /// [`ReadsDone`]: super::fence::ReadsDone
    fn evict(&self, st: &mut State, v: WeightId) -> Result<()> {
        let e = st.reg.get_mut(v)?;
        let Some(fenced) = e.block.take() else { return Ok(()) };
        if std::mem::take(&mut e.prefetched) {
            st.c.pending_prefetches -= 1;
            st.c.wasted_prefetches += 1;
        }
        let len = fenced.len();
        let (block, done, spent) = match fenced.try_retire()? {
            Retire::Done(b, d, s) => (b, d, s),
            Retire::Pending(f) => {
                st.c.eviction_waits += 1;
                let t = Instant::now();
                let r = f.wait()?;
                st.c.host_stall_ns += t.elapsed().as_nanos() as u64;
                r
            }
        };
        block.free(done);
        st.spare.extend(spent);
        st.resident_bytes -= len;
        st.resident_weights -= 1;
        st.policy.removed(v);
        st.c.evictions += 1;
        Ok(())
    }

    fn all_in_use(&self, st: &State, w: WeightId, len: usize) -> Error {
        Error::new(
            EpmStatus::AllInUse,
            format!(
                "weight {} ({len} bytes) does not fit: {} of {} budget bytes are held by weights that are \
                 acquired and not released ({} resident weights); release weights or raise the budget",
                w.0, st.resident_bytes, self.cfg.budget_bytes, st.resident_weights
            ),
        )
    }

    /// Register `w`'s pageable source on its first page-in, per the config.
    fn maybe_register(&self, st: &mut State, w: WeightId) -> Result<()> {
        let (range, state) = {
            let e = st.reg.get(w)?;
            (e.range, e.reg_state)
        };
        if state != RegState::Untried
            || self.cfg.register_sources == RegisterSources::Never
            || self.dev.host_is_page_locked(range.ptr(), range.len())
        {
            return Ok(());
        }
        let within = match (self.cfg.register_sources, st.memlock) {
            (RegisterSources::WithinMemlock, Some(limit)) => st.c.registered_bytes + range.len() as u64 <= limit,
            _ => true,
        };
        let result = if within { Some(self.engine.register(range)) } else { None };
        let e = st.reg.get_mut(w)?;
        match result {
            Some(Ok(r)) => {
                e.reg = Some(r);
                e.reg_state = RegState::Registered;
                st.c.source_registrations += 1;
                st.c.registered_bytes += range.len() as u64;
            }
            Some(Err(err)) => {
                log::info!("epmem: staging weight {} (registering its source failed: {err})", w.0);
                e.reg_state = RegState::Refused;
                st.c.register_refusals += 1;
            }
            None => {
                e.reg_state = RegState::Refused;
                st.c.register_refusals += 1;
            }
        }
        Ok(())
    }

    /// Keep up to `prefetch_depth` weights ahead of `w` in the cycle paged in
    /// and not yet used: walk forward past resident weights to the next
    /// missing ones. Skipping resident weights matters: Belady's resident
    /// set is a run of the cycle, so misses come in runs, and the copies of
    /// the next run must start while the hit run computes.
    fn prefetch_ahead(&self, st: &mut State, w: WeightId) -> Result<()> {
        let Some(&p) = st.cycle_pos.get(&w) else { return Ok(()) };
        let n = st.cycle.len();
        let mut ahead = 0;
        for k in 1..n {
            if ahead >= self.cfg.prefetch_depth {
                break;
            }
            let x = st.cycle[(p + k) % n];
            let e = st.reg.get(x)?;
            if e.block.is_none() {
                if !self.page_in(st, x, false)? {
                    break;
                }
                ahead += 1;
            } else if e.prefetched {
                ahead += 1;
            }
        }
        Ok(())
    }

    fn harvest(&self, st: &mut State) -> Result<()> {
        st.c.device_stall_ms += st.stalls.harvest()?;
        Ok(())
    }

    /// Wait for every page-in and read fence, so the stats are final.
    pub fn synchronize(&self) -> Result<()> {
        self.engine.synchronize()?;
        self.dev.synchronize()?;
        let mut st = self.lock();
        self.harvest(&mut st)
    }

    /// A snapshot of the counters (times lag until their events complete;
    /// call [`Self::synchronize`] first for final figures).
    pub fn stats(&self) -> ResidencyStats {
        let mut st = self.lock();
        let _ = self.harvest(&mut st);
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
            bypassed_page_ins: s.bypassed,
            staged_page_ins: s.copies - s.bypassed,
            source_registrations: c.source_registrations,
            register_refusals: c.register_refusals,
            registered_bytes: c.registered_bytes,
            htod_bytes: s.htod_bytes,
            pinned_alloc_calls: s.pinned_alloc_calls,
            pinned_reuses: s.pinned_reuses,
            fill_ms: s.fill_ms,
            htod_ms: s.htod_ms,
            stall_ms: c.device_stall_ms + host_stall_ms,
            device_stall_ms: c.device_stall_ms,
            host_stall_ms,
            resident_bytes: st.resident_bytes as u64,
            peak_resident_bytes: st.peak_resident_bytes as u64,
            resident_weights: st.resident_weights as u64,
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
        let mut st = self.lock();
        let ids: Vec<WeightId> = st.reg.ids().collect();
        for w in ids {
            if let Ok(e) = st.reg.remove(w) {
                let Entry { block, reg, .. } = e;
                drop(block);
                drop(reg);
            }
        }
    }
}
