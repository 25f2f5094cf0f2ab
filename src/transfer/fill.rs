//! Persistent fill threads: a parallel memcpy into a staging buffer.
//!
//! Why here and not in `staging/`: handing disjoint pieces of one `&mut [u8]`
//! to long-lived threads needs raw pointers (scoped threads would be safe but
//! are created per call — the "threads made per slot" pipeline that reached
//! only 68% of the PCIe peak). The unsafe lives in the transfer layer, behind
//! a safe call that does not return until every piece is written.
//!
//! Why several threads: on the H200 host one memcpy thread fills at ~10 GB/s
//! and PCIe moves ~54 GB/s; 8–16 threads fill 52–92 GB/s alone and 34–49 GB/s
//! while a DMA runs (bench_staging's fill-rate table, docs/BENCHMARKS.md,
//! "Staging: page-in bandwidth").
//!
//! How the work is shared: every thread — the caller included, once it is
//! done with its own work — claims the next piece until none is left, and the
//! pieces shrink toward the end. Nobody owns a fixed share, so a thread that
//! starts late costs nothing but its absent help, and all finish together.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Most fill threads a pool may have (a guard against typos like 800).
pub const MAX_FILL_THREADS: usize = 64;
/// Pieces are cut on this boundary so each thread copies whole cache lines
/// and pages.
const PIECE_ALIGN: usize = 4096;
/// Below twice this, one thread copies alone: waking others costs more than
/// it saves. Also the smallest piece a thread claims (~15 µs of copying).
const MIN_PIECE: usize = 64 * 1024;
/// Largest piece: past it a thread that arrives late (woken from sleep, or
/// the caller back from enqueueing the previous chunk) leaves a long tail.
const MAX_PIECE: usize = 1 << 20;

/// Copies (page-ins) shorter than this are filled with streaming stores
/// (ntcopy.rs), longer ones with plain stores. Measured on the H200
/// (bench_staging and bench_residency, two runs each, engine defaults):
/// streaming raised staged page-ins of 2 / 8 / 32 MiB from 17 / 22 / 35–38 to
/// 27–28 / 37 / 39–41 GB/s, but lowered 128 MiB page-ins from 47–48 to
/// 41–46 GB/s and staged 64 MiB weights from 41.5 to 36 GB/s: with plain
/// stores the engine's three 16 MiB slots can stay in the last-level cache for
/// the DMA to read, which streamed lines never do. So the choice is per
/// page-in, not per chunk (a large copy's short tail chunks stay plain too).
pub const STREAM_BELOW: usize = 64 << 20;
/// How the pieces shrink: each claim takes the unclaimed bytes divided by
/// this many per thread (guided self-scheduling), so the pieces are large
/// while much is left and small at the end, where every thread should finish
/// together. With one fixed piece per thread, the caller — which first
/// enqueues the previous chunk's DMA (~10–20 µs of driver calls) — finished
/// last on every chunk: on the H200, chunks of 2 MiB (32 MiB in 16 chunks)
/// reached 23.5 GB/s against 34.0 GB/s for 4 MiB chunks, with 8 threads.
const SHARES_PER_THREAD: usize = 2;
/// How long an idle worker spins before sleeping. A pipelined page-in hands
/// out the next chunk within a fill time (~100 µs–1 ms), and waking a sleeping
/// thread costs 5–50 µs, a large share of a 4 MiB chunk's ~130 µs fill.
const SPIN: Duration = Duration::from_micros(200);

/// The piece claimed at byte `at` of a `len`-byte copy shared by `threads`
/// threads: the unclaimed bytes over `SHARES_PER_THREAD × threads`, within
/// [`MIN_PIECE`, `MAX_PIECE`], on a page boundary, and never past the end.
fn piece_at(at: usize, len: usize, threads: usize) -> usize {
    let left = len - at;
    let guided = (left / (SHARES_PER_THREAD * threads)).clamp(MIN_PIECE, MAX_PIECE).next_multiple_of(PIECE_ALIGN);
    guided.min(left)
}

/// One parallel copy, shared by its caller and the workers it was posted to.
struct Job {
    dst: *mut u8,
    src: *const u8,
    len: usize,
    threads: usize,
    /// Bytes claimed so far (claims are contiguous from 0); never exceeds `len`.
    next: AtomicUsize,
    /// Bytes written. The caller returns only once every claimed byte is.
    done: AtomicUsize,
    /// Write with streaming stores (ntcopy.rs) rather than plain ones.
    streaming: bool,
}

// SAFETY: `dst` and `src` are dereferenced only for a claimed piece, and the
// submitter blocks in `FillThreads::copy_with` until every claimed piece is
// written (`done` reaches the claimed bytes, see `Join`), so both pointers
// are valid (and the destination exclusively ours) while a worker uses them.
// A worker that arrives after the last claim touches only the atomics, which
// its `Arc` keeps alive.
unsafe impl Send for Job {}
// SAFETY: as above; the shared fields are atomics and the pieces disjoint.
unsafe impl Sync for Job {}

impl Job {
    /// Claim the next piece, if any is left: its start and length.
    fn claim(&self) -> Option<(usize, usize)> {
        let (len, threads) = (self.len, self.threads);
        let at = self
            .next
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |at| (at < len).then(|| at + piece_at(at, len, threads)))
            .ok()?;
        Some((at, piece_at(at, len, threads)))
    }

    /// Copy pieces until none is left to claim.
    fn run(&self) {
        while let Some((start, n)) = self.claim() {
            // SAFETY: see `Job`: `[start, start + n)` was claimed by this
            // thread alone, lies inside both ranges (`piece_at` never passes
            // `len`), and the submitter keeps them alive until `done` counts it.
            // Streaming stores (ntcopy.rs) are fenced inside, before `done`.
            unsafe {
                if self.streaming {
                    super::ntcopy::copy(self.dst.add(start), self.src.add(start), n)
                } else {
                    std::ptr::copy_nonoverlapping(self.src.add(start), self.dst.add(start), n)
                }
            };
            self.done.fetch_add(n, Ordering::Release);
        }
    }
}

#[derive(Default)]
struct Inbox {
    /// A queue, not a slot: concurrent callers may post to the same worker.
    jobs: VecDeque<Arc<Job>>,
    /// The worker is blocked on `ready` (not spinning): only then does a post
    /// pay for a futex wake.
    sleeping: bool,
}

#[derive(Default)]
struct Mailbox {
    inbox: Mutex<Inbox>,
    ready: Condvar,
    has_job: AtomicBool,
    shutdown: AtomicBool,
}

/// A fixed set of threads that copy pieces of one buffer in parallel. The
/// calling thread copies pieces too, so `threads` counts it.
pub struct FillThreads {
    mailboxes: Vec<Arc<Mailbox>>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
}

impl std::fmt::Debug for FillThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FillThreads").field("threads", &self.threads).finish()
    }
}

impl FillThreads {
    /// `threads` in 1..=64, counting the caller (so `threads - 1` are spawned).
    pub fn new(threads: usize) -> Result<Self> {
        crate::ensure!(
            (1..=MAX_FILL_THREADS).contains(&threads),
            InvalidArgument,
            "fill threads {threads} not in 1..={MAX_FILL_THREADS}"
        );
        let mut me = Self { mailboxes: Vec::new(), workers: Vec::new(), threads };
        for i in 1..threads {
            let mb = Arc::new(Mailbox::default());
            let theirs = mb.clone();
            let handle = std::thread::Builder::new()
                .name(format!("epm-fill-{i}"))
                .spawn(move || worker(&theirs))
                .map_err(|e| Error::new(crate::EpmStatus::OsError, format!("spawning fill thread: {e}")))?;
            me.mailboxes.push(mb);
            me.workers.push(handle);
        }
        Ok(me)
    }

    /// Threads that fill, counting the caller.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Copy `src` into `dst` (equal lengths) using every fill thread; returns
    /// when all of it is written. Concurrent callers interleave their pieces
    /// and each waits for its own.
    pub fn copy(&self, dst: &mut [u8], src: &[u8]) -> Result<()> {
        self.copy_with(dst, src, || ())
    }

    /// As [`Self::copy`], and run `during` on the calling thread while the
    /// other fill threads copy (before the caller claims pieces itself). The
    /// copy engine enqueues the previous chunk's DMA here, so its driver calls
    /// cost no fill time: the workers claim the pieces the caller would have
    /// taken meanwhile.
    pub fn copy_with<R>(&self, dst: &mut [u8], src: &[u8], during: impl FnOnce() -> R) -> Result<R> {
        self.copy_with_stores(dst, src, src.len() < STREAM_BELOW, during)
    }

    /// As [`Self::copy_with`], choosing streaming (`true`) or plain stores:
    /// the copy engine decides by the size of the whole page-in, of which
    /// this is one chunk (see [`STREAM_BELOW`]).
    pub fn copy_with_stores<R>(
        &self,
        dst: &mut [u8],
        src: &[u8],
        streaming: bool,
        during: impl FnOnce() -> R,
    ) -> Result<R> {
        self.copy_observed(dst, src, streaming, |_| during())
    }

    /// As [`Self::copy_with_stores`], `during` given the count of bytes the
    /// other threads have written so far (a Release/Acquire counter: once it
    /// reads `n`, those bytes are visible to the reader).
    fn copy_observed<R>(
        &self,
        dst: &mut [u8],
        src: &[u8],
        streaming: bool,
        during: impl FnOnce(&AtomicUsize) -> R,
    ) -> Result<R> {
        crate::ensure!(dst.len() == src.len(), InvalidArgument, "fill of {} bytes into {} bytes", src.len(), dst.len());
        let len = src.len();
        if len < 2 * MIN_PIECE || self.threads == 1 {
            let r = during(&AtomicUsize::new(0));
            dst.copy_from_slice(src);
            return Ok(r);
        }
        let job = Arc::new(Job {
            dst: dst.as_mut_ptr(),
            src: src.as_ptr(),
            len,
            threads: self.threads,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            streaming,
        });
        // Waits on every exit from here, unwinding included, so no worker can
        // outlive the borrows it writes through.
        let _join = Join(&job);
        // No more workers than there are smallest pieces beyond the caller's:
        // a small copy wakes only the threads it can use.
        for mb in self.mailboxes.iter().take(len / MIN_PIECE - 1) {
            post(mb, job.clone());
        }
        let r = during(&job.done);
        job.run();
        Ok(r)
    }
}

/// Closes a job (no more claims) and waits until every claimed piece is written.
struct Join<'a>(&'a Job);

impl Drop for Join<'_> {
    fn drop(&mut self) {
        let claimed = self.0.next.swap(self.0.len, Ordering::AcqRel).min(self.0.len);
        wait_for(&self.0.done, claimed);
    }
}

fn post(mb: &Mailbox, job: Arc<Job>) {
    let sleeping = {
        let mut inbox = mb.inbox.lock().unwrap_or_else(|p| p.into_inner());
        inbox.jobs.push_back(job);
        mb.has_job.store(true, Ordering::Release);
        inbox.sleeping
    };
    // Woken after the lock is released, so the worker does not wake only to
    // block on it. It saw `sleeping` set under the lock, so it is inside
    // `wait` (which released the lock atomically) and gets this notification.
    if sleeping {
        mb.ready.notify_one();
    }
}

/// The caller's wait for the last pieces other threads hold: the pieces are
/// smallest at the end (64 KiB, ~15 µs), so spin, then yield. Never returns
/// before `done` reaches `target`.
fn wait_for(done: &AtomicUsize, target: usize) {
    let mut spins = 0u32;
    while done.load(Ordering::Acquire) < target {
        if spins < 10_000 {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

fn worker(mb: &Mailbox) {
    loop {
        // Spin a little for the next piece, then sleep on the condvar.
        let t0 = Instant::now();
        while !mb.has_job.load(Ordering::Acquire) && !mb.shutdown.load(Ordering::Acquire) && t0.elapsed() < SPIN {
            std::hint::spin_loop();
        }
        let job = {
            let mut inbox = mb.inbox.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(job) = inbox.jobs.pop_front() {
                    mb.has_job.store(!inbox.jobs.is_empty(), Ordering::Release);
                    break Some(job);
                }
                if mb.shutdown.load(Ordering::Acquire) {
                    break None;
                }
                inbox.sleeping = true;
                inbox = mb.ready.wait(inbox).unwrap_or_else(|p| p.into_inner());
                inbox.sleeping = false;
            }
        };
        let Some(job) = job else { return };
        job.run();
    }
}

impl Drop for FillThreads {
    fn drop(&mut self) {
        for mb in &self.mailboxes {
            let _inbox = mb.inbox.lock().unwrap_or_else(|p| p.into_inner());
            mb.shutdown.store(true, Ordering::Release);
            mb.ready.notify_one();
        }
        for w in self.workers.drain(..) {
            if w.join().is_err() {
                log::warn!("epmem: a fill thread panicked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::conformance::random_bytes;

    #[test]
    fn parallel_copy_is_exact_for_awkward_lengths() {
        let fill = FillThreads::new(5).unwrap();
        for &n in &[0usize, 1, 4095, MIN_PIECE, 2 * MIN_PIECE + 3, 5 * MIN_PIECE - 1, 3 << 20] {
            let src = random_bytes(n as u64 + 11, n);
            let mut dst = vec![0u8; n];
            fill.copy(&mut dst, &src).unwrap();
            assert!(dst == src, "mismatch at n={n}");
        }
    }

    #[test]
    fn copy_with_runs_its_closure_once_while_filling() {
        let fill = FillThreads::new(4).unwrap();
        for &n in &[100usize, 4 * MIN_PIECE + 1] {
            let src = random_bytes(5, n);
            let mut dst = vec![0u8; n];
            let mut calls = 0;
            let r = fill
                .copy_with(&mut dst, &src, || {
                    calls += 1;
                    n * 2
                })
                .unwrap();
            assert_eq!((r, calls), (n * 2, 1));
            assert!(dst == src);
        }
    }

    #[test]
    fn pieces_are_aligned_shrink_toward_the_end_and_cover_the_copy() {
        for &(n, threads) in &[(2 * MIN_PIECE, 8), ((1 << 20) + 1, 8), (2 << 20, 8), (16 << 20, 8), (64 << 20, 16)] {
            let (mut at, mut last, mut count) = (0, usize::MAX, 0);
            while at < n {
                let p = piece_at(at, n, threads);
                assert!(p > 0 && p <= MAX_PIECE && p <= last, "n={n} at={at}: piece {p} after {last}");
                assert!(p.is_multiple_of(PIECE_ALIGN) || at + p == n, "n={n} at={at}: unaligned piece {p}");
                assert!(p >= MIN_PIECE || at + p == n, "n={n} at={at}: piece {p} below the minimum");
                (at, last, count) = (at + p, p, count + 1);
            }
            assert_eq!(at, n, "the pieces cover exactly the copy");
            if n >= 2 << 20 {
                assert!(count >= 2 * threads, "n={n}: {count} pieces for {threads} threads");
                assert!(last <= MIN_PIECE, "n={n}: the copy ends on a piece of {last} bytes, not a small one");
            }
        }
    }

    #[test]
    fn the_workers_finish_the_copy_while_the_caller_is_busy() {
        // The caller's `during` waits until the workers have written every
        // byte (their `done` counter), or until every worker is asleep with
        // an empty inbox: were any piece reserved for the caller, the
        // workers would go idle with it unwritten.
        // Both are events (an atomic and the inbox locks), so no clock decides
        // the outcome, and the destination is read only after the copy
        // returns, never while the workers write it.
        let fill = FillThreads::new(4).unwrap();
        let n = 4 << 20;
        let src = random_bytes(3, n);
        let mut dst: Vec<u8> = src.iter().map(|b| b.wrapping_add(1)).collect();
        let mailboxes = fill.mailboxes.clone();
        let idle = move || {
            mailboxes.iter().all(|mb| {
                let inbox = mb.inbox.lock().unwrap_or_else(|p| p.into_inner());
                inbox.sleeping && inbox.jobs.is_empty()
            })
        };
        let by_workers = fill
            .copy_observed(&mut dst, &src, n < STREAM_BELOW, |done| {
                loop {
                    if done.load(Ordering::Acquire) == n {
                        break n;
                    }
                    // A worker goes to sleep (under its inbox lock) only after
                    // its last piece is counted, so the count read after seeing
                    // every worker idle is final.
                    if idle() {
                        break done.load(Ordering::Acquire);
                    }
                    std::thread::yield_now();
                }
            })
            .unwrap();
        assert_eq!(by_workers, n, "the workers went idle leaving pieces to the caller");
        assert!(dst == src);
    }

    #[test]
    fn mismatched_lengths_are_an_error_and_bad_counts_rejected() {
        let fill = FillThreads::new(2).unwrap();
        let e = fill.copy(&mut [0u8; 4], &[1u8; 5]).unwrap_err();
        assert_eq!(e.status(), crate::EpmStatus::InvalidArgument);
        assert_eq!(FillThreads::new(0).unwrap_err().status(), crate::EpmStatus::InvalidArgument);
        assert_eq!(FillThreads::new(65).unwrap_err().status(), crate::EpmStatus::InvalidArgument);
    }

    #[test]
    fn concurrent_callers_each_get_their_own_data() {
        let fill = Arc::new(FillThreads::new(4).unwrap());
        let handles: Vec<_> = (0..3)
            .map(|t| {
                let fill = fill.clone();
                std::thread::spawn(move || {
                    for i in 0..20 {
                        let src = random_bytes(t * 100 + i as u64, MIN_PIECE * 4 + i);
                        let mut dst = vec![0u8; src.len()];
                        fill.copy(&mut dst, &src).unwrap();
                        assert!(dst == src);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }
}
