//! Helpers shared by the staging tests (a directory, so cargo does not build
//! it as a test crate of its own).
#![allow(dead_code)]

use std::sync::Arc;

use epmem::device::{self, Device, DevicePtr, HostRange, PinnedBuffer, Stream};
use epmem::transfer::witness;

/// The device `EPM_DEVICE` names (host in CI, cuda on the GPU machine).
pub fn dev() -> Arc<dyn Device> {
    device::open_from_env(0).expect("open the device EPM_DEVICE names")
}

/// Deterministic pseudo-random bytes, different per seed.
pub fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; n];
    fastrand::Rng::with_seed(seed).fill(&mut out);
    out
}

/// A host range over bytes that live for the rest of the test process
/// (HostRange's safe constructor needs 'static; tests may leak).
pub fn leak_range(bytes: Vec<u8>) -> HostRange {
    HostRange::from_static(Box::leak(bytes.into_boxed_slice()))
}

/// Read `len` bytes of device memory back, ordered after the work on `s`.
pub fn read_back(dev: &Arc<dyn Device>, s: &Stream, src: DevicePtr, len: usize) -> Vec<u8> {
    let buf = PinnedBuffer::new(dev, len.max(1)).expect("pinned read-back buffer");
    let buf = witness::enqueue_dtoh(s, buf, src, len, None).expect("enqueue d2h").wait().expect("d2h");
    buf[..len].to_vec()
}

/// Index of the first differing byte, for readable failures on big buffers.
pub fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}
