//! Helpers shared by the KV integration tests: a device from EPM_DEVICE, a
//! qwen14b-shaped layout (196,608 B/token: a granule boundary falls inside a
//! token run, so prefixes end mid-granule), and synchronous host↔device copies.
#![allow(dead_code)]

use std::sync::Arc;

use epmem::device::{self, Device, DevicePtr, Stream};
use epmem::kv::{KvLayout, KvShape};

pub fn dev() -> Arc<dyn Device> {
    device::open_from_env(0).expect("open the device EPM_DEVICE names")
}

pub fn qwen14b() -> KvLayout {
    KvLayout::token_major(KvShape { layers: 48, kv_heads: 8, head_dim: 128, elem_bytes: 2 }).unwrap()
}

/// Write `bytes` at `dst` and wait.
pub fn write(d: &Arc<dyn Device>, s: &Stream, dst: DevicePtr, bytes: &[u8]) -> epmem::Result<()> {
    // SAFETY: `bytes` outlives the copy: we synchronize before returning.
    unsafe { d.memcpy_htod_async(dst, bytes.as_ptr(), bytes.len(), s.raw())? };
    s.synchronize()
}

/// Read `n` bytes at `src`.
pub fn read(d: &Arc<dyn Device>, s: &Stream, src: DevicePtr, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    // SAFETY: `v` is exclusively ours and outlives the copy (synchronized below).
    unsafe { d.memcpy_dtoh_async(v.as_mut_ptr(), src, n, s.raw()).unwrap() };
    s.synchronize().unwrap();
    v
}

/// A recognisable pattern: byte i of stream `seed`.
pub fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed as u32 * 7 + 1) as u8).collect()
}

/// A deterministic generator per seed, so failures reproduce.
pub use fastrand::Rng;

/// A uniform pick in `0..n`, taking `n = 0` as 1 (the random walks pick from
/// lists and lengths that may be empty; the caller's `1 +` or guard decides).
pub fn below(r: &mut Rng, n: u64) -> u64 {
    r.u64(..n.max(1))
}
