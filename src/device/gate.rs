//! A gate a stream can be held on: work queued after
//! [`Device::hold_async`](super::Device::hold_async) runs only once the
//! gate is opened.
//!
//! Why: a test that needs "this copy has not run yet" cannot rely on a spin
//! of N ms and assume the host gets its checks done within it, which a
//! loaded 2-core CI machine does not promise. A gate orders the check before
//! the work by an event the test controls, so such a test cannot pass or
//! fail by timing. On the host device the hold is a queued op; on CUDA a
//! stream memory wait (`cuStreamWaitValue32`) on a flag in mapped pinned
//! memory that opening sets. (A host function that blocks the stream also
//! blocks `cuEventQuery`/`cuEventElapsedTime` on the H200's driver, so a
//! test could not observe "pending" without hanging.)
//!
//! Dropping a [`Gate`] opens it, so a test that fails (panics) between hold
//! and open never leaves a stream blocked forever.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A 4-byte flag a device waits on (CUDA: `cuStreamWaitValue32` on mapped
/// pinned memory), set to 1 when the gate opens. The device that made it
/// owns the memory and frees it only once the gate is open and the wait
/// has completed; see [`GateShared::attach`].
#[derive(Debug)]
pub(crate) struct DeviceFlag(*mut u32);

// SAFETY: the pointer is only written (a volatile store) under the gate's
// lock, to memory its device keeps alive while the gate is closed.
unsafe impl Send for DeviceFlag {}

#[derive(Debug, Default)]
struct State {
    open: bool,
    flags: Vec<DeviceFlag>,
}

/// The shared state a held stream waits on.
#[derive(Debug, Default)]
pub(crate) struct GateShared {
    state: Mutex<State>,
    cv: Condvar,
}

impl GateShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Block the calling (stream) thread until the gate opens.
    pub(crate) fn wait(&self) {
        let mut st = self.lock();
        while !st.open {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }
    /// Whether the gate is open. Once true, no flag attached to it is
    /// written again (the store happens once, under the same lock), so its
    /// device may free the flag's memory after the device-side wait passed.
    pub(crate) fn is_open(&self) -> bool {
        self.lock().open
    }
    /// Have `flag` set to 1 when the gate opens. `false` (and the flag is not
    /// kept) if the gate is already open: then there is nothing to wait for.
    ///
    /// # Safety
    /// `flag` points at a 4-byte, 4-aligned word that stays valid until
    /// [`is_open`](Self::is_open) returns true (the device keeps it until then
    /// and opens the gate itself before freeing it at teardown).
    pub(crate) unsafe fn attach(&self, flag: *mut u32) -> bool {
        let mut st = self.lock();
        if st.open {
            return false;
        }
        st.flags.push(DeviceFlag(flag));
        true
    }
    /// Wait up to `limit` for the gate to open; whether it did.
    fn wait_for(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut st = self.lock();
        while !st.open {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self.cv.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        true
    }
    pub(crate) fn set_open(&self) {
        let mut st = self.lock();
        if !st.open {
            st.open = true;
            for f in std::mem::take(&mut st.flags) {
                // SAFETY: `attach`'s contract: the word is valid and aligned
                // while the gate is closed, and it is closed until this store
                // (made once, under the lock). Atomic: the device polls it.
                unsafe { std::sync::atomic::AtomicU32::from_ptr(f.0) }.store(1, Ordering::SeqCst);
            }
        }
        drop(st);
        self.cv.notify_all();
    }
}

/// See the module docs. Not `Clone`: one owner opens it.
#[derive(Debug, Default)]
pub struct Gate {
    shared: Arc<GateShared>,
}

impl Gate {
    pub fn new() -> Self {
        Self::default()
    }
    /// Let every stream held on this gate run on. Idempotent.
    pub fn open(&self) {
        self.shared.set_open();
    }
    /// Open the gate after `limit` unless it is opened before. For the
    /// failure path only: code under test that wrongly blocks on the held
    /// stream would otherwise hang the test; with a watchdog it returns once
    /// the watchdog fires, and [`Watchdog::fired`] says so. A test that
    /// passes never waits for it.
    pub fn watchdog(&self, limit: Duration) -> Watchdog {
        let (shared, fired) = (self.shared.clone(), Arc::new(AtomicBool::new(false)));
        let flag = fired.clone();
        std::thread::spawn(move || {
            if !shared.wait_for(limit) {
                flag.store(true, Ordering::SeqCst);
                shared.set_open();
            }
        });
        Watchdog { fired }
    }
    pub(crate) fn shared(&self) -> Arc<GateShared> {
        self.shared.clone()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.shared.set_open();
    }
}

/// See [`Gate::watchdog`].
#[derive(Debug)]
pub struct Watchdog {
    fired: Arc<AtomicBool>,
}

impl Watchdog {
    /// Whether the watchdog had to open the gate (the test's own `open`
    /// never came first).
    pub fn fired(&self) -> bool {
        self.fired.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{self, Event, Stream};

    #[test]
    fn a_held_stream_runs_nothing_until_the_gate_opens() {
        let d = device::open(device::DeviceSelect::Host, 0).unwrap();
        let s = Stream::new(&d).unwrap();
        let gate = Gate::new();
        let wd = gate.watchdog(Duration::from_secs(30));
        d.hold_async(s.raw(), &gate).unwrap();
        let e = Event::new(&d, false).unwrap();
        e.record(&s).unwrap();
        assert!(!e.query().unwrap(), "an event behind a closed gate completed");
        gate.open();
        e.synchronize().unwrap();
        assert!(!wd.fired());
    }

    #[test]
    fn a_watchdog_opens_a_gate_nobody_opened_and_says_so() {
        let d = device::open(device::DeviceSelect::Host, 0).unwrap();
        let s = Stream::new(&d).unwrap();
        let gate = Gate::new();
        let wd = gate.watchdog(Duration::from_millis(20));
        d.hold_async(s.raw(), &gate).unwrap();
        s.synchronize().unwrap();
        assert!(wd.fired());
    }

    #[test]
    fn dropping_the_gate_releases_its_stream() {
        let d = device::open(device::DeviceSelect::Host, 0).unwrap();
        let s = Stream::new(&d).unwrap();
        let gate = Gate::new();
        d.hold_async(s.raw(), &gate).unwrap();
        drop(gate);
        s.synchronize().unwrap();
    }
}
