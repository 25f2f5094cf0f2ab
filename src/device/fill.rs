//! Persistent fill threads: a parallel memcpy into a staging buffer.
//!
//! Why here and not in `staging/`: handing disjoint pieces of one `&mut [u8]`
//! to long-lived threads needs raw pointers (scoped threads would be safe but
//! are created per call — the "threads made per slot" pipeline that reached
//! only 68% of the PCIe peak). The unsafe lives in the device layer, behind a
//! safe call that does not return until every piece is written.
//!
//! Why several threads: on the H200 host one memcpy thread fills at ~10 GB/s
//! and PCIe moves ~54 GB/s; 6–16 threads reach 47–50 GB/s alone and 27–37 GB/s
//! while a DMA runs (DESIGN.md, measured floors).

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
/// Below this, one thread copies alone: waking others costs more than it saves.
const MIN_PIECE: usize = 256 * 1024;
/// How long an idle worker spins before sleeping. A pipelined page-in hands
/// out the next chunk within a fill time (~100 µs–1 ms), and waking a sleeping
/// thread costs 5–50 µs, a large share of a 4 MiB chunk's ~130 µs fill.
const SPIN: Duration = Duration::from_micros(200);

struct Job {
    dst: *mut u8,
    src: *const u8,
    len: usize,
    remaining: Arc<AtomicUsize>,
}

// SAFETY: a Job is a piece of a copy whose submitter blocks in
// `FillThreads::copy` until `remaining` reaches zero, so both pointers stay
// valid (and the destination exclusively ours) while a worker uses them.
unsafe impl Send for Job {}

#[derive(Default)]
struct Inbox {
    /// A queue, not a slot: concurrent callers may post to the same worker.
    jobs: VecDeque<Job>,
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
/// calling thread copies the first piece itself, so `threads` counts it.
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
    /// other fill threads copy (before the caller copies its own piece). The
    /// copy engine enqueues the previous chunk's DMA here, so its driver calls
    /// cost no fill time.
    pub fn copy_with<R>(&self, dst: &mut [u8], src: &[u8], during: impl FnOnce() -> R) -> Result<R> {
        crate::ensure!(dst.len() == src.len(), InvalidArgument, "fill of {} bytes into {} bytes", src.len(), dst.len());
        let len = src.len();
        let pieces = (len / MIN_PIECE).clamp(1, self.threads);
        if pieces == 1 {
            let r = during();
            dst.copy_from_slice(src);
            return Ok(r);
        }
        let piece = len.div_ceil(pieces).next_multiple_of(PIECE_ALIGN);
        let remaining = Arc::new(AtomicUsize::new(0));
        // Waits on every exit from here, unwinding included, so no worker can
        // outlive the borrows it writes through.
        let _join = Join(&remaining);
        let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
        let mut start = piece; // the caller keeps [0, piece)
        for mb in &self.mailboxes {
            if start >= len {
                break;
            }
            let n = piece.min(len - start);
            // SAFETY: start + n <= len, inside both slices.
            let job = unsafe { Job { dst: d.add(start), src: s.add(start), len: n, remaining: remaining.clone() } };
            remaining.fetch_add(1, Ordering::AcqRel);
            post(mb, job);
            start += n;
        }
        // pieces <= threads and each worker took one, so nothing is left over.
        debug_assert!(start >= len);
        let r = during();
        let own = piece.min(len);
        dst[..own].copy_from_slice(&src[..own]);
        Ok(r)
    }
}

struct Join<'a>(&'a AtomicUsize);

impl Drop for Join<'_> {
    fn drop(&mut self) {
        wait_zero(self.0);
    }
}

fn post(mb: &Mailbox, job: Job) {
    let mut inbox = mb.inbox.lock().unwrap_or_else(|p| p.into_inner());
    inbox.jobs.push_back(job);
    mb.has_job.store(true, Ordering::Release);
    if inbox.sleeping {
        mb.ready.notify_one();
    }
}

/// The caller's wait: the pieces are the same size as its own, so they finish
/// about when it does; spin, then yield. Never returns before every worker
/// has finished with the borrowed slices.
fn wait_zero(remaining: &AtomicUsize) {
    let mut spins = 0u32;
    while remaining.load(Ordering::Acquire) != 0 {
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
        // SAFETY: see `Job`: the submitter keeps both ranges alive and the
        // destination unaliased until `remaining` drops to zero, which is
        // after this copy. The pieces of one copy are disjoint.
        unsafe { std::ptr::copy_nonoverlapping(job.src, job.dst, job.len) };
        job.remaining.fetch_sub(1, Ordering::AcqRel);
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

    fn pattern(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn parallel_copy_is_exact_for_awkward_lengths() {
        let fill = FillThreads::new(5).unwrap();
        for &n in &[0usize, 1, 4095, MIN_PIECE, 2 * MIN_PIECE + 3, 5 * MIN_PIECE - 1, 3 << 20] {
            let src = pattern(n, n as u64 + 11);
            let mut dst = vec![0u8; n];
            fill.copy(&mut dst, &src).unwrap();
            assert!(dst == src, "mismatch at n={n}");
        }
    }

    #[test]
    fn copy_with_runs_its_closure_once_while_filling() {
        let fill = FillThreads::new(4).unwrap();
        for &n in &[100usize, 4 * MIN_PIECE + 1] {
            let src = pattern(n, 5);
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
                        let src = pattern(MIN_PIECE * 4 + i, t * 100 + i as u64);
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
