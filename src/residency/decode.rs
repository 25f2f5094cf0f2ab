//! Compressed weights (formats v1 and v2 of [`crate::codec`]): registration, and
//! page-ins that copy the compressed bytes into device staging and decode
//! them into the weight's memory, all ordered on the device.
//!
//! The host copy of a compressed weight is its encoded buffer, page-locked and
//! owned by the manager, so every page-in is a direct DMA of the compressed
//! bytes. The weight's share of the budget is its decoded length.
//!
//! The staging: [`DECODE_STAGING_BUFFERS`] × `cap` bytes of device memory,
//! reserved out of the budget (`budget − staging` is what weights, ring
//! included, may occupy). `cap`, the most one run of copies stages, is the
//! largest compressed weight the plan streams (at least
//! [`DECODE_STAGING_MIN_BYTES`] or the largest compressed weight, if
//! smaller), or with no plan the largest compressed weight registered, and
//! at most [`DECODE_STAGING_MAX_BYTES`]. Plan and staging are chosen together
//! when a plan is installed (`plan_with_staging`); a registration grows the
//! staging when the rule wants more.
//!
//! The host copy is the weight's frames ([`crate::codec::Frame`]), end to
//! end. A page-in stages them a run at a time: as many whole frames as fit
//! the free bytes (at most `cap`; runs are given back until at least half of
//! `cap`, or the rest of the weight, is free), in one copy, each decoded by
//! one launch;
//! a frame larger than `cap` goes in pieces ([`crate::codec::DecodePiece`]:
//! ranges of whole blocks, each staged by the copies of its parts of the
//! streams). Runs fill the staging as a circle, each where the last ended
//! (or at 0 when the rest of the lap is too short); the page-in fence
//! follows the last decode.
//!
//! Ordering, per run:
//! 1. bytes a decode may still read are reused only after that decode: the
//!    oldest runs are given back first, until the run fits, and the next
//!    copy waits for the event of the newest run given back (one stream
//!    wait: every decode runs on the decode stream in page-in order, so that
//!    event follows the decodes of every run given back before it);
//! 2. the copy engine copies the compressed bytes (or a piece's parts) into
//!    the run's bytes (copies stay in issue order on the engine's stream, so
//!    the first waits for the given-back decode and the decode waits for the
//!    last);
//! 3. the decode stream waits for the copy and, for a page-in into memory
//!    whose readers may still run, for the order stream that waits for them;
//!    it decodes into the weight's memory and records the run's event.
//!
//! So an H2D never overwrites staging a decode still reads, the decode of
//! weight k runs while the copy of weight k+1 fills other bytes, and the
//! copy of weight k+1 does not wait for the kernels still reading its
//! destination (only its decode does: with a ring that reuses the memory of
//! the weight just read, waiting there would idle the copy engine for that
//! weight's last decode and kernel on every page-in). While a decode waits
//! for its destination's readers, the copies behind it fill whatever the
//! staging has free: a compressed weight larger than half the staging no
//! longer leaves half of it idle. The acquiring stream waits for the decode
//! through the page-in fence, as it waits for a raw copy: no host wait per
//! page-in.

use std::sync::Arc;

use super::WeightId;
use super::manager::State;
use super::placement::{self, ALIGN, Plan};
use super::read_fence::DeviceBlock;
use super::registry::Coded;
use crate::arena::DeviceArena;
use crate::codec::{self, Dtype, EncodeOptions, RawReason};
use crate::device::{Device, Event, HostRange, PinnedBuffer, RawStream, Stream};
use crate::error::{EpmStatus, Error, Result};
use crate::residency::ResidencyManager;
use crate::staging::Fence;

/// The staging for compressed bytes holds this many runs of the largest size
/// (`cap` bytes each): at least two, so the copy of the next weight lands
/// while the decode of the last reads its bytes.
pub const DECODE_STAGING_BUFFERS: usize = 2;

/// The most bytes one run stages (`cap`): a weight larger than this pages in
/// a run at a time whatever the plan (64 MiB is ~1.2 ms of PCIe at
/// 55 GB/s; its copy and a launch per frame cost microseconds).
pub const DECODE_STAGING_MAX_BYTES: usize = 64 << 20;

/// Under a plan, `cap` is at least this much (or the largest
/// compressed weight, if smaller) even when no compressed weight streams:
/// planned-resident weights page in through it at first fill and after an
/// eviction, and pieces much smaller than this cost launches.
pub const DECODE_STAGING_MIN_BYTES: usize = 2 << 20;

/// Plans tried when choosing a plan and its staging together
/// ([`ResidencyManager::plan_with_staging`]).
const STAGING_ROUNDS: usize = 3;

/// What [`ResidencyManager::register_encoded`] registered.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Registered {
    pub id: WeightId,
    /// `None`: stored compressed; otherwise why the weight stays raw (it is
    /// then registered over the caller's bytes, as [`ResidencyManager::register`]).
    pub raw: Option<RawReason>,
    /// Bytes of the host copy the manager streams from: the compressed
    /// buffer, or the raw weight.
    pub host_bytes: usize,
    /// The compressed buffer's description (`None` when raw).
    pub desc: Option<crate::codec::DecodeDesc>,
}

/// A run of staged compressed bytes, from byte `start` of the staging up to
/// the next run's start, and the event recorded after the decodes that read it.
#[derive(Debug)]
struct Staged {
    start: usize,
    read: Event,
}

/// The device staging of compressed page-ins, and the streams ordering them.
///
/// One block of [`DECODE_STAGING_BUFFERS`] × `cap` bytes, filled as a
/// circle: each run of copies (at most `cap` bytes) starts where the last
/// ended, or at 0 when the rest of the lap is too short; bytes a decode may
/// still read are reused only by a copy that waits for that decode. So while
/// one decode waits for its destination's readers, the copy engine fills
/// whatever the staging has left, not only the other half.
#[derive(Debug)]
pub(crate) struct DecodeStaging {
    block: DeviceBlock,
    /// The most bytes one run stages (the sizing rule's per-buffer bytes).
    cap: usize,
    /// Where the next run starts (or the circle wraps to 0).
    head: usize,
    /// Runs a decode may still read, oldest first (in staging order).
    staged: std::collections::VecDeque<Staged>,
    /// Events of runs given back and no longer needed, for reuse.
    spare: Vec<Event>,
    /// The event of the newest run given back since the last copy was
    /// issued: the next copy waits for it (it follows the decodes of every
    /// run given back before it, all on `stream`).
    gate: Option<Event>,
    /// Decodes run here, in page-in order.
    stream: Stream,
    /// Records the caller's order stream for the decode stream to wait on.
    after: Event,
}

impl DecodeStaging {
    fn new(dev: &Arc<dyn Device>, arena: &Arc<DeviceArena>, cap: usize) -> Result<Self> {
        Ok(Self {
            block: DeviceBlock::alloc(arena, DECODE_STAGING_BUFFERS * cap)?,
            cap,
            head: 0,
            staged: std::collections::VecDeque::new(),
            spare: Vec::new(),
            gate: None,
            stream: Stream::new(dev)?,
            after: Event::new(dev, false)?,
        })
    }

    /// Free bytes from `head` on, in one range.
    fn room(&self) -> usize {
        match self.staged.front() {
            None => self.block.len() - self.head,
            // The oldest run lies ahead: free up to it (0 when full).
            Some(f) if f.start >= self.head => f.start - self.head,
            // The oldest run lies behind: free to the end of the lap.
            Some(_) => self.block.len() - self.head,
        }
    }

    /// At least `min` (≤ `cap`) free bytes from `head` on: the rest of the
    /// lap is skipped when too short, and the oldest runs are given back
    /// (the next copy waits for their decodes) until there is room. The
    /// free bytes, at most `cap`.
    fn make_room(&mut self, min: usize) -> Result<usize> {
        debug_assert!(min <= self.cap && 2 * self.cap <= self.block.len());
        loop {
            let room = self.room();
            if room >= min {
                return Ok(room.min(self.cap));
            }
            match self.staged.front() {
                None => self.head = 0,
                Some(f) if f.start < self.head => self.head = 0,
                Some(_) => {
                    let Some(old) = self.staged.pop_front() else { unreachable!("a front run") };
                    if let Some(older) = self.gate.replace(old.read) {
                        self.spare.push(older);
                    }
                    if self.staged.is_empty() {
                        self.head = 0;
                    }
                }
            }
        }
    }
}

impl ResidencyManager {
    /// Bytes weights may occupy: the budget less the reserved decode staging.
    pub(super) fn budget(&self, st: &State) -> usize {
        st.ledger.budget()
    }

    /// Register a weight already encoded (format v1 or v2, e.g. by
    /// [`codec::encode`] or `epm_codec_encode`). The bytes are validated
    /// (header, layout, escape index, CRC-32): a corrupt or truncated buffer
    /// is refused here with the codec's message, never decoded. They are
    /// copied into page-locked memory the manager owns, so the caller may
    /// free `encoded` when this returns; a buffer of more than one frame
    /// ([`codec::FRAME_VALUES`] values) is stored in frames, its streams
    /// sliced ([`codec::reframe`]), as a weight the manager encodes. The
    /// weight occupies its decoded length of the budget; see
    /// [`DECODE_STAGING_BUFFERS`] for the staging.
    pub fn register_compressed(&self, encoded: &[u8]) -> Result<WeightId> {
        // A buffer that is not even a whole header is refused before anything is allocated.
        codec::parse_header(encoded)?;
        let mut buf = PinnedBuffer::new(&self.dev, encoded.len())?;
        buf.copy_from_slice(encoded);
        // Validated in the manager's own copy (what is checked is what
        // streams), before the budget: a corrupt buffer says so first.
        let desc = codec::parse(&buf, EncodeOptions::default().thread_count())?;
        // Stored in frames, as a weight the manager encodes (one copy per
        // staging buffer): the validated buffer's streams, sliced.
        let frames = codec::frames_of(&desc, &buf)?;
        let framed_len = frames.last().map_or(0, |f| f.at + f.len());
        self.check_fits(desc.raw_len(), framed_len.max(buf.len()))?;
        let (buf, frames) = if frames.len() > 1 {
            let mut framed = PinnedBuffer::new(&self.dev, framed_len)?;
            codec::reframe(&desc, &buf, &frames, &mut framed)?;
            (framed, frames)
        } else {
            (buf, vec![codec::Frame { at: 0, raw_offset: 0, desc }])
        };
        self.add_coded(Coded { buf, desc, frames })
    }

    /// Register raw bf16 or fp16 bytes, encoding them on `opts.threads`
    /// threads straight into page-locked memory the manager owns; the
    /// caller's bytes are not needed afterwards. A weight the codec keeps raw
    /// ([`RawReason`]: too small, no gain, another dtype) is registered raw
    /// over `raw`, exactly as [`Self::register`] (so `raw` must then stay
    /// readable until it is unregistered), and [`Registered::raw`] says why.
    pub fn register_encoded(&self, raw: HostRange, dtype: Dtype, opts: &EncodeOptions) -> Result<Registered> {
        crate::ensure!(
            !raw.is_empty() && !raw.ptr().is_null(),
            InvalidArgument,
            "a weight must be a non-empty host range (got {:p}, {} bytes)",
            raw.ptr(),
            raw.len()
        );
        let data = raw.as_slice();
        let plan = codec::plan(data, dtype, opts)?;
        let len = match plan.framed_len() {
            Ok(len) => len,
            Err(reason) => {
                let id = self.register(raw)?;
                return Ok(Registered { id, raw: Some(reason), host_bytes: raw.len(), desc: None });
            }
        };
        self.check_fits(raw.len(), len)?;
        let Some(desc) = plan.desc().copied() else {
            return Err(Error::internal("an encoding plan without a description"));
        };
        let mut buf = PinnedBuffer::new(&self.dev, len)?;
        let frames = plan.encode_frames_into(data, &mut buf)?;
        let id = self.add_coded(Coded { buf, desc, frames })?;
        Ok(Registered { id, raw: None, host_bytes: len, desc: Some(desc) })
    }

    /// The staging's `cap` (bytes per run) the sizing rule (module docs) gives under
    /// `plan` (`None`: no plan) with the compressed weights registered, and
    /// one more of `extra` compressed bytes (0: none).
    pub(super) fn staging_cap_for(st: &State, plan: Option<&Plan>, extra: usize) -> usize {
        let coded = |w: WeightId| st.reg.get(w).ok().and_then(|e| e.coded.as_ref().map(|k| k.buf.len()));
        let largest = st.reg.ids().filter_map(coded).max().unwrap_or(0).max(extra);
        if largest == 0 {
            return 0;
        }
        let cap = match plan {
            None => largest,
            Some(p) => {
                // A split unit streams its tail's frames.
                let tail = |u: WeightId, head: usize| {
                    let k = st.reg.get(u).ok()?.coded.as_ref()?;
                    Some(k.frames.iter().filter(|f| f.raw_offset >= head).map(|f| f.len()).sum::<usize>())
                };
                let streamed = (0..p.resident.len())
                    .filter(|&i| !p.resident[i])
                    .filter_map(|i| tail(*st.plan.cycle().get(i)?, p.heads.get(i).copied().unwrap_or(0)));
                largest.min(streamed.max().unwrap_or(0).max(DECODE_STAGING_MIN_BYTES))
            }
        };
        cap.min(DECODE_STAGING_MAX_BYTES).next_multiple_of(ALIGN)
    }

    /// The plan the declared cycle wants and the staging's `cap` beside
    /// it, chosen together: the plan is made for `budget − staging`, and the
    /// staging follows from what the plan streams. Starting from the staging
    /// of no plan (the largest), re-plan with the staging the last plan needs
    /// until it needs no less, at most [`STAGING_ROUNDS`] plans; of the plans
    /// whose streamed weights each fit one run (each decodes whole), keep
    /// the one that streams the fewest bytes (on a tie, the smaller staging).
    pub(super) fn plan_with_staging(&self, st: &State) -> Result<(Option<Plan>, usize)> {
        let top = Self::staging_cap_for(st, None, 0);
        let mut cap = top;
        let mut best: Option<(Plan, usize)> = None;
        for round in 0..STAGING_ROUNDS {
            let Some(room) = self.cfg.budget_bytes.checked_sub(DECODE_STAGING_BUFFERS * cap) else { break };
            let Some(p) = self.wanted_plan(st, room)? else {
                // Everything fits beside this staging: nothing streams
                // under a plan.
                if self.cycle_bytes(st)? <= room {
                    return Ok((None, cap));
                }
                // No plan wanted (weights of one size: farthest-next-use),
                // unless one that splits them, whose tails need less
                // staging, streams fewer bytes beside a staging of a frame.
                if round == 0 {
                    return Ok(self.split_beside_frame_staging(st, room)?.unwrap_or((None, cap)));
                }
                break;
            };
            let need = Self::staging_cap_for(st, Some(&p), 0);
            let fewer = |b: &(Plan, usize)| (p.streamed_bytes, cap) < (b.0.streamed_bytes, b.1);
            if need <= cap && best.as_ref().is_none_or(fewer) {
                best = Some((p, cap));
            }
            if need >= cap {
                break;
            }
            cap = need;
        }
        Ok(match best {
            Some((p, cap)) => (Some(p), cap),
            None => (None, top),
        })
    }

    /// With no plan wanted beside the largest staging (`room` left for
    /// weights): the split plan made beside a staging of the largest frame,
    /// if it needs no more and streams fewer bytes than farthest-next-use
    /// does in `room` (about (total − room) plus the largest unit).
    fn split_beside_frame_staging(&self, st: &State, room: usize) -> Result<Option<(Option<Plan>, usize)>> {
        let frame = st
            .reg
            .ids()
            .filter_map(|w| st.reg.get(w).ok()?.coded.as_ref()?.frames.iter().map(|f| f.len()).max())
            .max()
            .unwrap_or(0);
        if frame == 0 || !self.cfg.split_weights {
            return Ok(None);
        }
        let cap = frame.max(DECODE_STAGING_MIN_BYTES).min(DECODE_STAGING_MAX_BYTES).next_multiple_of(ALIGN);
        let Some(small) = self.cfg.budget_bytes.checked_sub(DECODE_STAGING_BUFFERS * cap) else { return Ok(None) };
        if small <= room {
            return Ok(None);
        }
        let Some(p) = self.wanted_plan(st, small)? else { return Ok(None) };
        let sizes: Vec<usize> =
            st.plan.cycle().iter().map(|&u| st.reg.get(u).map(|e| e.dev_len())).collect::<Result<_>>()?;
        let fnu = placement::farthest_next_use_bytes(&sizes, room);
        let need = Self::staging_cap_for(st, Some(&p), 0);
        Ok((p.splits() && need <= cap && p.streamed_bytes < fnu).then_some((Some(p), cap)))
    }

    /// Bytes of the declared cycle's units on the device.
    fn cycle_bytes(&self, st: &State) -> Result<usize> {
        st.plan.cycle().iter().map(|&u| st.reg.get(u).map(|e| e.dev_len())).sum()
    }

    /// Refuse (before anything is allocated) a compressed weight of `raw_len`
    /// decoded and `coded_len` compressed bytes the budget cannot hold beside
    /// the staging it would need.
    fn check_fits(&self, raw_len: usize, coded_len: usize) -> Result<()> {
        let st = self.lock();
        let cap = st.ledger.staging_cap().max(Self::staging_cap_for(&st, st.plan.plan(), coded_len));
        let reserve = DECODE_STAGING_BUFFERS * cap;
        let largest = st.reg.ids().filter_map(|w| st.reg.get(w).ok().map(|e| e.dev_len())).max().unwrap_or(0);
        let need = raw_len.max(largest).saturating_add(reserve);
        crate::ensure!(
            need <= self.cfg.budget_bytes,
            OutOfBudget,
            "a compressed weight of {raw_len} bytes ({coded_len} compressed) does not fit a budget of {} bytes: \
             decoding needs {reserve} bytes of device staging ({DECODE_STAGING_BUFFERS} buffers of {cap} bytes: \
             the largest compressed weight the plan streams, or any when there is no plan, at most \
             {DECODE_STAGING_MAX_BYTES}) beside the largest weight ({} bytes)",
            self.cfg.budget_bytes,
            raw_len.max(largest)
        );
        Ok(())
    }

    /// Register a validated compressed weight, growing the staging when the
    /// sizing rule now wants more (reserved out of the budget, evicting what
    /// no longer fits, re-planning). A failure registers nothing.
    fn add_coded(&self, coded: Coded) -> Result<WeightId> {
        let (raw_len, coded_len) = (coded.desc.raw_len(), coded.buf.len());
        let mut st = self.lock();
        let st = &mut *st;
        let id = st.reg.add_coded(coded)?;
        let r = (|| {
            let cap = Self::staging_cap_for(st, st.plan.plan(), 0);
            if cap > st.ledger.staging_cap() {
                self.set_staging(st, cap)?;
                // The plan was made for the old budget.
                if st.plan.plan().is_some() {
                    if st.plan.held() == 0 {
                        self.install_plan(st)?;
                    } else {
                        st.plan.request_replan();
                    }
                }
            }
            crate::ensure!(
                raw_len <= self.budget(st),
                OutOfBudget,
                "a compressed weight of {raw_len} bytes decoded can never be resident: the budget of {} bytes \
                 less {} bytes of decode staging leaves {}",
                self.cfg.budget_bytes,
                st.ledger.staging_reserve(),
                self.budget(st)
            );
            Ok(())
        })();
        if let Err(e) = r {
            // Never paged in: no copy reads its host bytes.
            st.reg.remove(id)?;
            return Err(e);
        }
        st.c.compressed_weights += 1;
        st.c.compressed_host_bytes += coded_len as u64;
        st.c.compressed_raw_bytes += raw_len as u64;
        Ok(id)
    }

    /// Make the staging's `cap` this many bytes: reserve it out of the budget
    /// (evicting until the resident weights fit what is left) and allocate
    /// it. Not in steady state: at a registration that needs more, and when
    /// a plan is installed (with nothing resident). The caller re-plans.
    pub(super) fn set_staging(&self, st: &mut State, cap: usize) -> Result<()> {
        let reserve = DECODE_STAGING_BUFFERS * cap;
        crate::ensure!(
            reserve < self.cfg.budget_bytes,
            OutOfBudget,
            "decode staging of {reserve} bytes ({DECODE_STAGING_BUFFERS} × {cap}) leaves nothing of a budget of {} bytes",
            self.cfg.budget_bytes
        );
        let (old_cap, old_reserve) = (st.ledger.staging_cap(), st.ledger.staging_reserve());
        // The old buffers go first (their drop synchronizes the device: no
        // decode reads them any more).
        st.dec = None;
        st.ledger.set_staging(cap, reserve);
        let r = (|| {
            if cap == 0 {
                return Ok(None);
            }
            while st.ledger.resident_bytes() > self.budget(st) {
                let Some(v) = self.victim(st, WeightId(u32::MAX), super::manager::Need::Demand) else {
                    return Err(Error::new(
                        EpmStatus::AllInUse,
                        format!(
                            "reserving {reserve} bytes of decode staging: {} of {} budget bytes are resident and \
                             what could make room is acquired; release weights first",
                            st.ledger.resident_bytes(),
                            self.cfg.budget_bytes
                        ),
                    ));
                };
                self.evict(st, v)?;
            }
            loop {
                match DecodeStaging::new(&self.dev, &self.arena, cap) {
                    Ok(d) => break Ok(Some(d)),
                    // The arena has the bytes but not in one range.
                    Err(e) if e.status() == EpmStatus::OutOfBudget => {
                        match self.victim(st, WeightId(u32::MAX), super::manager::Need::Demand) {
                            Some(v) => self.evict(st, v)?,
                            None => break Err(e),
                        }
                    }
                    Err(e) => break Err(e),
                }
            }
        })();
        match r {
            Ok(d) => {
                st.dec = d;
                Ok(())
            }
            Err(e) => {
                st.ledger.set_staging(old_cap, old_reserve);
                if old_cap > 0 {
                    st.dec = DecodeStaging::new(&self.dev, &self.arena, old_cap).ok();
                }
                Err(e)
            }
        }
    }

    /// Issue compressed unit `w`'s page-in into `dst` (its decoded bytes'
    /// start), of its frames from the one starting at byte `from` (0: all;
    /// a split unit's tail): copy their compressed bytes into the staging,
    /// then decode them into `dst`, after `order` (the stream that waits for
    /// `dst`'s readers) when given. Each run takes whole frames (contiguous
    /// in the host copy: one copy, then a decode per frame) as many as fit
    /// the staging's free bytes, or, for a frame larger than `cap`, a piece
    /// of it (whole blocks: up to six copies, one decode); see the module
    /// docs. The fence completes when the last decode has.
    pub(super) fn compressed_in(
        &self,
        st: &mut State,
        w: WeightId,
        dst: u64,
        from: usize,
        order: Option<RawStream>,
    ) -> Result<Fence> {
        let State { reg, dec, c, decode_timer, .. } = st;
        let e = reg.get(w)?;
        let (src, k) = match e.coded.as_ref() {
            Some(k) => (e.unit, k),
            None => return Err(Error::internal("compressed page-in of a raw weight")),
        };
        let dec = dec.as_mut().ok_or_else(|| Error::internal("compressed weight without decode staging"))?;
        // From the frame that starts at `from` (a split unit's tail).
        let Some(f0) = k.frames.iter().position(|fr| fr.raw_offset == from) else {
            return Err(Error::internal(format!("a compressed page-in from byte {from}, not a frame's start")));
        };
        let dlen = k.desc.raw_len() - from;
        let (mut copied, mut decoding, mut first) = (0, false, true);
        let r = (|| {
            let frames = &k.frames;
            let (mut f, mut at) = (f0, 0);
            while f < frames.len() {
                // What this run takes: (copies: from, to, len) and
                // (decodes: staged offset, offset in the weight, piece).
                let mut copies: Vec<(usize, usize, usize)> = Vec::new();
                let mut pieces: Vec<(usize, usize, codec::DecodePiece)> = Vec::new();
                let fr = &frames[f];
                if fr.len() > dec.cap {
                    let bytes = &k.buf[fr.at..fr.at + fr.len()];
                    let piece = fr.desc.piece_within(bytes, at, dec.cap)?;
                    dec.make_room(piece.staged_len())?;
                    copies.extend(piece.copies().map(|(from, to, len)| (fr.at + from, to, len)));
                    pieces.push((0, fr.raw_offset + piece.raw_offset(), piece));
                    at = piece.end_block();
                    if at == fr.desc.blocks() {
                        (f, at) = (f + 1, 0);
                    }
                } else {
                    // A run takes at least half of `cap` (or what is left
                    // of the weight, if less): giving back runs for room
                    // costs nothing the copy engine waits on until the
                    // staging is full, and a run is a copy.
                    let rest = frames[frames.len() - 1].at + frames[frames.len() - 1].len() - fr.at;
                    let room = dec.make_room(fr.len().max(rest.min(dec.cap / 2)))?;
                    let start = fr.at;
                    let mut g = f;
                    while g < frames.len() && frames[g].at + frames[g].len() - start <= room {
                        pieces.push((frames[g].at - start, frames[g].raw_offset, frames[g].desc.whole()));
                        g += 1;
                    }
                    let end = frames[g - 1].at + frames[g - 1].len();
                    copies.push((start, 0, end - start));
                    f = g;
                }
                let base = dec.block.addr() + dec.head as u64;
                // The first copy waits for the newest decode given back (its
                // bytes may be reused); the rest follow it in issue order on
                // the copy engine's stream, so the decode waits for the last.
                let (mut last, mut staged_len) = (None, 0);
                for (from, to, len) in copies {
                    let part = src.slice(from, len)?;
                    let gate = dec.gate.take();
                    match self.engine.htod_after_event(base + to as u64, part, gate.as_ref()) {
                        Ok(f) => {
                            last = Some(f);
                            // The wait is issued: the event may be recorded again.
                            dec.spare.extend(gate);
                        }
                        Err(e) => {
                            // Not ordered after the decode: the next copy waits instead.
                            dec.gate = gate;
                            return Err(e);
                        }
                    }
                    copied += len;
                    staged_len = staged_len.max(to + len);
                }
                let copy = last.ok_or_else(|| Error::internal("a decode staging with nothing to copy"))?;
                copy.make_wait(dec.stream.raw())?;
                // Only the decode writes `dst`: it, not the copy into
                // staging, waits for `dst`'s readers, so the copy engine
                // fills staging while the last kernel on `dst` still runs.
                if first && let Some(o) = order {
                    dec.after.record_raw(o)?;
                    dec.stream.wait_event(&dec.after)?;
                }
                first = false;
                let s = dec.stream.raw();
                decoding = true;
                decode_timer.around(&self.dev, s, || {
                    pieces.iter().try_for_each(|(off, out, p)| {
                        self.dev.decode_piece_async(base + *off as u64, dst + *out as u64, p, s)
                    })
                })?;
                let read = match dec.spare.pop() {
                    Some(e) => e,
                    None => Event::new(&self.dev, false)?,
                };
                read.record(&dec.stream)?;
                dec.staged.push_back(Staged { start: dec.head, read });
                dec.head = (dec.head + staged_len).next_multiple_of(ALIGN);
            }
            let done = self.engine.events().take()?;
            done.record(&dec.stream)?;
            // `order` is not made to wait for the decode: the next page-in
            // after it would then wait for this decode before its copy (the
            // overlap lost). A later reuse of `dst` waits for this page-in's
            // fence anyway (`reuse_after`, `order_before`).
            Ok(done)
        })();
        let done = match r {
            Ok(d) => d,
            Err(err) => {
                // A decode may be queued with no event to fence it: let it end
                // before the caller frees or reuses `dst` or the staging.
                if decoding && let Err(s) = dec.stream.synchronize() {
                    log::error!("epmem: a failed decode's stream could not be synchronized ({s})");
                }
                return Err(err);
            }
        };
        c.compressed_htod_bytes += copied as u64;
        c.decoded_bytes += dlen as u64;
        c.decodes += 1;
        Ok(Fence::recorded(&self.dev, done, dlen))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::{ArenaConfig, DeviceArena};
    use crate::device::{self, DeviceSelect};

    /// Runs of random sizes through the staging circle: every run lands in
    /// bytes no staged run holds (given back runs excepted), inside the
    /// block, 16-aligned; room is given back oldest first and only when
    /// needed; the copy after a give-back waits for a decode, no other.
    #[test]
    fn staging_runs_never_overlap_runs_a_decode_may_still_read() {
        let d = device::open(DeviceSelect::Host, 0).unwrap();
        let arena = Arc::new(DeviceArena::new(&d, ArenaConfig::with_capacity(64 << 20)).unwrap());
        let cap = 4096;
        let mut dec = DecodeStaging::new(&d, &arena, cap).unwrap();
        let len = dec.block.len();
        assert_eq!(len, DECODE_STAGING_BUFFERS * cap);
        // (start, end) of the runs still staged, oldest first: the model.
        let mut live: std::collections::VecDeque<(usize, usize)> = Default::default();
        let mut seed = 0x9E37_79B9_7F4A_7C15_u64;
        let mut rand = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let (mut gave_back, mut wrapped) = (0, 0);
        for i in 0..5000 {
            let min = 16 + rand(cap - 16);
            let before = dec.staged.len();
            let (head, free) = (dec.head, dec.room());
            let room = dec.make_room(min).unwrap();
            assert!(room >= min && room <= cap, "run {i}: room {room} for {min}");
            let popped = before - dec.staged.len();
            for _ in 0..popped {
                live.pop_front();
            }
            gave_back += popped;
            if free >= min {
                assert!(popped == 0 && dec.head == head, "run {i}: gave back or wrapped with {free} free for {min}");
            }
            assert_eq!(
                dec.gate.is_some(),
                popped > 0,
                "run {i}: the next copy waits for a decode iff a run was given back"
            );
            if dec.head < head {
                wrapped += 1;
            }
            let take = (min + rand(room - min + 1)).next_multiple_of(16).min(room);
            let (start, end) = (dec.head, dec.head + take);
            assert!(end <= len && start % 16 == 0, "run {i}: [{start}, {end}) of {len}");
            for &(a, b) in &live {
                assert!(end <= a || start >= b, "run {i}: [{start}, {end}) overlaps a staged run [{a}, {b})");
            }
            let read = dec.spare.pop().map_or_else(|| Event::new(&d, false), Ok).unwrap();
            dec.spare.extend(dec.gate.take()); // the run's first copy waited for it
            dec.staged.push_back(Staged { start, read });
            dec.head = end.next_multiple_of(ALIGN);
            live.push_back((start, end));
        }
        assert!(gave_back > 1000 && wrapped > 100, "{gave_back} given back, {wrapped} wraps: not the cases meant");
        // Events are reused (5000 runs): at most one per run the circle holds at once.
        assert!(dec.spare.len() + dec.staged.len() <= len / 16);
    }
}
