//! Streams and events of the host device.
//!
//! A stream is a worker thread running its queue in order. Every queued op
//! gets the next sequence number of its stream; the worker publishes the
//! sequence of the last op it finished. An event is a marker op: it remembers
//! (stream, sequence) when recorded, and it has completed once the stream's
//! completed sequence reaches it. A stream waiting on an event queues a wait
//! for that (stream, sequence); the host does not wait.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::event::EventShared;

use super::space::{AddrSpace, Need};
use crate::device::{DevicePtr, checksum_host};
use crate::error::{Error, Result};

/// Lock, ignoring poison: a panic elsewhere must not turn into a panic here.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A byte operation on memory. Addresses are plain integers (device
/// addresses and host pointers alike, the latter with exposed provenance).
#[derive(Debug)]
pub(super) enum MemOp {
    Copy {
        dst: usize,
        src: usize,
        n: usize,
    },
    Fill {
        dst: usize,
        value: u8,
        n: usize,
    },
    Checksum {
        p: usize,
        n: usize,
        out: usize,
    },
    /// A compressed weight decoded on the CPU (ranges checked disjoint).
    Decode {
        src: usize,
        src_len: usize,
        dst: usize,
        dst_len: usize,
        piece: Box<crate::codec::DecodePiece>,
    },
}

#[derive(Debug)]
pub(super) enum Op {
    /// `checks`: the device ranges it touches, re-checked when it runs.
    Mem {
        op: MemOp,
        checks: Vec<(DevicePtr, usize, Need)>,
    },
    Spin(Duration),
    /// Blocks the stream until the gate opens (tests).
    Hold(Arc<crate::device::gate::GateShared>),
    Mark {
        ev: Arc<EventShared>,
        generation: u64,
    },
    Wait {
        on: Arc<StreamShared>,
        seq: u64,
    },
}

#[derive(Debug, Default)]
struct State {
    queue: VecDeque<(u64, Op)>,
    submitted: u64,
    completed: u64,
    closing: bool,
    /// An op that failed on the worker (its range changed after enqueue);
    /// reported by the next synchronize, like a CUDA asynchronous error.
    error: Option<Error>,
}

#[derive(Debug, Default)]
pub(super) struct StreamShared {
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
}

impl StreamShared {
    /// Queue `op`; returns its sequence number.
    pub fn push(&self, op: Op) -> Result<u64> {
        let mut st = lock(&self.state);
        crate::ensure!(!st.closing, InvalidHandle, "stream is being destroyed");
        st.submitted += 1;
        let seq = st.submitted;
        st.queue.push_back((seq, op));
        self.work.notify_one();
        Ok(seq)
    }
    pub fn is_done(&self, seq: u64) -> bool {
        lock(&self.state).completed >= seq
    }
    pub fn wait_for(&self, seq: u64) {
        let mut st = lock(&self.state);
        while st.completed < seq {
            st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
    /// Wait for everything queued so far; report (and clear) an asynchronous error.
    pub fn synchronize(&self) -> Result<()> {
        let mut st = lock(&self.state);
        let target = st.submitted;
        while st.completed < target {
            st = self.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.error.take().map_or(Ok(()), Err)
    }
}

/// A stream: the shared queue plus the worker that drains it.
#[derive(Debug)]
pub(super) struct HostStream {
    pub shared: Arc<StreamShared>,
    thread: Option<JoinHandle<()>>,
}

impl HostStream {
    pub fn spawn(id: u64, space: Arc<RwLock<AddrSpace>>) -> Result<Self> {
        let shared = Arc::new(StreamShared::default());
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("epm-stream-{id}"))
            .spawn(move || run(&worker, &space))
            .map_err(|e| Error::new(crate::EpmStatus::OsError, format!("spawning a stream thread: {e}")))?;
        Ok(Self { shared, thread: Some(thread) })
    }
}

impl Drop for HostStream {
    /// Lets queued work finish, then joins the worker. An empty queue returns at once.
    fn drop(&mut self) {
        lock(&self.shared.state).closing = true;
        self.shared.work.notify_all();
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            log::warn!("epmem: a host stream worker panicked");
        }
    }
}

fn run(me: &StreamShared, space: &RwLock<AddrSpace>) {
    loop {
        let (seq, op) = {
            let mut st = lock(&me.state);
            loop {
                if let Some(item) = st.queue.pop_front() {
                    break item;
                }
                if st.closing {
                    return;
                }
                st = me.work.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        let r = catch_unwind(AssertUnwindSafe(|| execute(op, space)))
            .unwrap_or_else(|_| Err(Error::internal("a host stream op panicked")));
        let mut st = lock(&me.state);
        if let Err(e) = r {
            log::error!("epmem: host stream op {seq} failed: {e}");
            st.error.get_or_insert(e);
        }
        st.completed = seq;
        me.done.notify_all();
    }
}

fn execute(op: Op, space: &RwLock<AddrSpace>) -> Result<()> {
    match op {
        Op::Mem { op, checks } => {
            // Held for the whole op: mapping changes wait until it is done.
            let sp = space.read().unwrap_or_else(|e| e.into_inner());
            for &(addr, n, need) in &checks {
                sp.check(addr, n, need)?;
            }
            // SAFETY: every device range was just checked under the read lock,
            // which keeps it mapped with that access until we finish; host ranges
            // are vouched for by the caller of the unsafe enqueue function.
            unsafe { run_mem(op) }
        }
        Op::Spin(d) => {
            spin(d);
            Ok(())
        }
        Op::Hold(g) => {
            g.wait();
            Ok(())
        }
        Op::Mark { ev, generation } => {
            ev.stamp(generation);
            Ok(())
        }
        Op::Wait { on, seq } => {
            on.wait_for(seq);
            Ok(())
        }
    }
}

/// Threads a host-device decode may use: the stream worker plus helpers,
/// bounded so several streams decoding at once do not oversubscribe.
const DECODE_THREADS: usize = 8;

/// # Safety
/// Every range is valid for its access (see `execute`).
unsafe fn run_mem(op: MemOp) -> Result<()> {
    match op {
        // Zero-length ops are valid with any address (even NULL), which
        // `ptr::copy` and `from_raw_parts` do not accept: skip them.
        MemOp::Copy { n: 0, .. } | MemOp::Fill { n: 0, .. } => {}
        MemOp::Checksum { n: 0, out, .. } => {
            // SAFETY: 8 writable device bytes (caller).
            unsafe { std::ptr::write_unaligned(std::ptr::with_exposed_provenance_mut::<u64>(out), 0) }
        }
        MemOp::Copy { dst, src, n } => {
            let (d, s) =
                (std::ptr::with_exposed_provenance_mut::<u8>(dst), std::ptr::with_exposed_provenance::<u8>(src));
            // SAFETY: both ranges valid (caller); `copy` allows overlap.
            unsafe { std::ptr::copy(s, d, n) }
        }
        MemOp::Fill { dst, value, n } => {
            // SAFETY: a writable device range (caller).
            unsafe { std::ptr::write_bytes(std::ptr::with_exposed_provenance_mut::<u8>(dst), value, n) }
        }
        MemOp::Checksum { p, n, out } => {
            // SAFETY: a readable device range (caller).
            let bytes = unsafe { std::slice::from_raw_parts(std::ptr::with_exposed_provenance::<u8>(p), n) };
            let sum = checksum_host(bytes);
            // SAFETY: 8 writable device bytes (caller); no alignment is promised.
            unsafe { std::ptr::write_unaligned(std::ptr::with_exposed_provenance_mut::<u64>(out), sum.to_le()) }
        }
        MemOp::Decode { src, src_len, dst, dst_len, piece } => {
            // SAFETY: a readable device range (caller), disjoint from `dst`
            // (checked at enqueue), so the two slices do not alias.
            let from = unsafe { std::slice::from_raw_parts(std::ptr::with_exposed_provenance::<u8>(src), src_len) };
            // SAFETY: a writable device range (caller), disjoint from `src`.
            let to =
                unsafe { std::slice::from_raw_parts_mut(std::ptr::with_exposed_provenance_mut::<u8>(dst), dst_len) };
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(DECODE_THREADS);
            return crate::codec::decode_piece(&piece, from, to, threads);
        }
    }
    Ok(())
}

/// Sleep most of the way, spin the last stretch: a "kernel" of `d` that is
/// neither early nor much late.
fn spin(d: Duration) {
    let until = Instant::now() + d;
    if d > Duration::from_millis(2) {
        std::thread::sleep(d - Duration::from_millis(1));
    }
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}
