//! The layout descriptor: where K and V of (layer, token, head) live.
//!
//! A descriptor of strides rather than an enum of named layouts, so a new
//! layout is new numbers, not new code in every kernel, and an execution
//! provider can describe its own layout without a new enum variant here.
//!
//! The KV pool requires token-major: every byte of token `t` lies in
//! `[t * token_stride, (t + 1) * token_stride)`, so an S-token prefix of all
//! layers is one contiguous range — one multi-map to share it. Head-major
//! would scatter a prefix into `layers × 2 × kv_heads` fragments.

use crate::error::Result;

/// Which half of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kv {
    K = 0,
    V = 1,
}

/// A model's KV shape: the numbers a token-major layout is derived from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvShape {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per element (2 for fp16/bf16).
    pub elem_bytes: u32,
}

impl KvShape {
    /// `layers × 2 × kv_heads × head_dim × elem_bytes`; None on overflow.
    pub fn bytes_per_token(&self) -> Option<u64> {
        (self.layers as u64)
            .checked_mul(2)?
            .checked_mul(self.kv_heads as u64)?
            .checked_mul(self.head_dim as u64)?
            .checked_mul(self.elem_bytes as u64)
    }
}

/// Byte offsets of K/V elements relative to a sequence's base address:
/// `token * token_stride + layer * layer_stride + kv * kv_stride + head * head_stride
///  + i * elem_bytes` for element `i < head_dim` of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub shape: KvShape,
    /// Bytes from one token to the next; the whole token's K and V of every
    /// layer lies within one stride (token-major).
    pub token_stride: u64,
    pub layer_stride: u64,
    /// Bytes from K to V of the same layer, token and head.
    pub kv_stride: u64,
    pub head_stride: u64,
}

impl KvLayout {
    /// The dense token-major layout: [token][layer][K,V][head][head_dim].
    pub fn token_major(shape: KvShape) -> Result<Self> {
        let l = Self::dense(shape)?;
        l.validate()?;
        Ok(l)
    }

    fn dense(shape: KvShape) -> Result<Self> {
        let bpt = shape
            .bytes_per_token()
            .ok_or_else(|| crate::Error::invalid_argument(format!("KV shape {shape:?}: bytes per token overflow")))?;
        let head_stride = shape.head_dim as u64 * shape.elem_bytes as u64;
        let kv_stride = shape.kv_heads as u64 * head_stride;
        Ok(Self { shape, token_stride: bpt, layer_stride: 2 * kv_stride, kv_stride, head_stride })
    }

    /// Bytes one token occupies in a sequence's reservation.
    pub fn bytes_per_token(&self) -> u64 {
        self.token_stride
    }

    /// Check that the descriptor is token-major and every element of a token
    /// lies inside its token stride.
    pub fn validate(&self) -> Result<()> {
        let s = self.shape;
        crate::ensure!(
            s.layers > 0 && s.kv_heads > 0 && s.head_dim > 0 && s.elem_bytes > 0,
            InvalidArgument,
            "KV shape {s:?} has a zero dimension"
        );
        let last = (s.layers as u64 - 1)
            .checked_mul(self.layer_stride)
            .and_then(|o| o.checked_add(self.kv_stride))
            .and_then(|o| o.checked_add((s.kv_heads as u64 - 1).checked_mul(self.head_stride)?))
            .and_then(|o| o.checked_add(s.head_dim as u64 * s.elem_bytes as u64));
        crate::ensure!(
            last.is_some_and(|end| end <= self.token_stride),
            InvalidArgument,
            "KV layout is not token-major: a token's elements reach past its stride of {} bytes",
            self.token_stride
        );
        crate::ensure!(
            self.head_stride >= s.head_dim as u64 * s.elem_bytes as u64,
            InvalidArgument,
            "KV layout: head stride {} is shorter than a head ({} bytes)",
            self.head_stride,
            s.head_dim as u64 * s.elem_bytes as u64
        );
        Ok(())
    }

    /// Byte offset of head `head` of (layer, kv, token) from the sequence base.
    pub fn offset(&self, layer: u32, kv: Kv, token: u64, head: u32) -> Result<u64> {
        crate::ensure!(
            layer < self.shape.layers && head < self.shape.kv_heads,
            InvalidArgument,
            "KV offset: layer {layer} / head {head} outside {} layers / {} heads",
            self.shape.layers,
            self.shape.kv_heads
        );
        token
            .checked_mul(self.token_stride)
            .and_then(|o| o.checked_add(layer as u64 * self.layer_stride))
            .and_then(|o| o.checked_add(kv as u64 * self.kv_stride))
            .and_then(|o| o.checked_add(head as u64 * self.head_stride))
            .ok_or_else(|| crate::Error::invalid_argument(format!("KV offset of token {token} overflows")))
    }
}

/// Round `bytes` up to a multiple of `granule`; None on overflow.
pub fn round_up(bytes: u64, granule: u64) -> Option<u64> {
    bytes.checked_add(granule - 1).map(|b| b / granule * granule)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen14b_is_196608_bytes_per_token() {
        let s = KvShape { layers: 48, kv_heads: 8, head_dim: 128, elem_bytes: 2 };
        let l = KvLayout::token_major(s).unwrap();
        assert_eq!(l.bytes_per_token(), 196_608);
        // V of the last head of the last layer ends exactly at the stride.
        let v = l.offset(47, Kv::V, 0, 7).unwrap();
        assert_eq!(v + 256, 196_608);
        assert_eq!(l.offset(0, Kv::K, 3, 0).unwrap(), 3 * 196_608);
        assert!(l.offset(48, Kv::K, 0, 0).is_err());
    }

    #[test]
    fn rejects_layouts_that_are_not_token_major() {
        let s = KvShape { layers: 2, kv_heads: 2, head_dim: 4, elem_bytes: 2 };
        let mut l = KvLayout::token_major(s).unwrap();
        l.token_stride -= 1;
        assert!(l.validate().is_err());
        // Padding between tokens is fine.
        l.token_stride += 64;
        l.validate().unwrap();
        let zero = KvShape { layers: 0, ..s };
        assert!(KvLayout::token_major(zero).is_err());
    }
}
