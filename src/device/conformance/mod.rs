//! The device conformance suite: written once against `&Arc<dyn Device>`,
//! run on the host device under `cargo test` and on CUDA (the H200) with
//! `EPM_DEVICE=cuda` from the same test binary (`tests/device_conformance.rs`).
//!
//! Each check is a public function that returns `Err` when a device call
//! fails unexpectedly and panics (assert) when the device misbehaves. Every
//! check ends by comparing `live_counts` with its start: nothing it made may
//! leak. Checks that rely on host-device-only behaviour (exact status codes,
//! reading device memory directly) gate that part on `info().kind`.
//!
//! On CUDA, run each check in its own process (`--exact NAME`): a check that
//! finds a bug may poison the context, and that must not fail the others.

mod codec;
mod copies;
mod errors;
mod ordering;
mod resources;
mod vmm;

pub use codec::*;
pub use copies::*;
pub use errors::*;
pub use ordering::*;
pub use resources::*;
pub use vmm::*;

use std::sync::Arc;

use super::{Device, DeviceKind, DevicePtr, PinnedBuffer, Stream};
use crate::error::{EpmStatus, Result};

/// `n` deterministic random bytes.
pub fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    fastrand::Rng::with_seed(seed).fill(&mut v);
    v
}

/// A host buffer that is either pinned or plain pageable memory.
enum HostBuf {
    Pinned(PinnedBuffer),
    Pageable(Vec<u8>),
}

impl HostBuf {
    fn new(dev: &Arc<dyn Device>, n: usize, pinned: bool) -> Result<Self> {
        Ok(if pinned { HostBuf::Pinned(PinnedBuffer::new(dev, n)?) } else { HostBuf::Pageable(vec![0u8; n]) })
    }
    fn as_slice(&self) -> &[u8] {
        match self {
            HostBuf::Pinned(p) => p,
            HostBuf::Pageable(v) => v,
        }
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            HostBuf::Pinned(p) => p,
            HostBuf::Pageable(v) => v,
        }
    }
}

/// H2D copy of `data` to `dst` on `s`, then wait for the stream. The
/// result is the enqueue error if any, else the synchronize result.
fn upload(dev: &Arc<dyn Device>, s: &Stream, dst: DevicePtr, data: &[u8]) -> Result<()> {
    // SAFETY: `data` outlives the copy: the stream is synchronized before returning.
    let r = unsafe { dev.memcpy_htod_async(dst, data.as_ptr(), data.len(), s.raw()) };
    let sync = s.synchronize();
    r.and(sync)
}

/// D2H copy of `n` bytes from `src` on `s`, waited for.
fn download(dev: &Arc<dyn Device>, s: &Stream, src: DevicePtr, n: usize) -> Result<Vec<u8>> {
    let mut out = vec![0u8; n];
    // SAFETY: `out` outlives the copy and is not touched until the stream is synchronized.
    let r = unsafe { dev.memcpy_dtoh_async(out.as_mut_ptr(), src, n, s.raw()) };
    let sync = s.synchronize();
    r.and(sync)?;
    Ok(out)
}

/// Assert two byte strings are equal, naming the first difference (never
/// printing megabytes).
#[track_caller]
fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length differs");
    if got == want {
        return;
    }
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: first difference at byte {i} of {}: got {:#04x}, want {:#04x}", want.len(), got[i], want[i]);
    }
}

/// Assert an H2D write was refused, either when enqueued or when the stream
/// was synchronized (CUDA may report either), and on the host device with
/// `AccessDenied` at enqueue.
#[track_caller]
fn assert_write_refused(dev: &Arc<dyn Device>, what: &str, enqueue: Result<()>, sync: Result<()>) {
    assert!(enqueue.is_err() || sync.is_err(), "{what}: the write was accepted");
    if dev.info().kind == DeviceKind::Host {
        let e = enqueue.expect_err("host device refuses at enqueue");
        assert_eq!(e.status(), EpmStatus::AccessDenied, "{what}: {e}");
    }
}

/// Run `f` and assert that every live resource count is back where it started.
fn no_leaks(dev: &Arc<dyn Device>, name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
    let before = dev.live_counts();
    f()?;
    dev.synchronize()?;
    let after = dev.live_counts();
    assert_eq!(after, before, "{name}: live resource counts did not return to their starting values (leak)");
    Ok(())
}

/// A one-line description of the device, for test output.
pub fn describe(dev: &Arc<dyn Device>) -> String {
    let i = dev.info();
    format!("{} #{}: {} (granularity {} bytes)", i.kind.name(), i.ordinal, i.name, i.granularity)
}
