//! Content-hash detection of shared prefixes.
//!
//! A sequence may declare its token ids. When a prefix is pinned from such a
//! sequence, the chained hash of every full block of `block_tokens` tokens is
//! indexed: `h[0] = hash(layout, namespace)`, `h[i+1] = hash(h[i], block i)`.
//! A new sequence that declares its tokens looks up its own chain from the
//! longest block down and shares the longest pinned prefix it matches. The
//! layout and the namespace are in the seed of the chain, so two models (or
//! two namespaces) never share. A hit is confirmed by comparing the namespace
//! and the token ids themselves, so a 64-bit collision can never map another
//! request's KV into a sequence.

use std::collections::HashMap;

use super::layout::KvLayout;
use super::namespace::Namespace;

fn mix(mut h: u64, v: u64) -> u64 {
    // splitmix64 finaliser over a running state: cheap, well distributed.
    h ^= v.wrapping_add(0x9e37_79b9_7f4a_7c15).wrapping_add(h << 6).wrapping_add(h >> 2);
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

fn seed(l: &KvLayout, ns: &Namespace) -> u64 {
    let s = l.shape;
    let layout = [
        s.layers as u64,
        s.kv_heads as u64,
        s.head_dim as u64,
        s.elem_bytes as u64,
        l.token_stride,
        l.layer_stride,
        l.kv_stride,
        l.head_stride,
    ]
    .into_iter()
    .fold(0x6570_6d65_6d6b_7631, mix);
    // Length first, then the bytes: no two namespaces feed the same sequence.
    let b = ns.as_bytes();
    b.iter().fold(mix(layout, b.len() as u64), |acc, &x| mix(acc, x as u64))
}

/// Chained hashes of the full blocks of `tokens` in namespace `ns`: element
/// `i` covers tokens `[0, (i + 1) * block_tokens)`.
pub fn block_chain(layout: &KvLayout, ns: &Namespace, tokens: &[u32], block_tokens: usize) -> Vec<u64> {
    let mut h = seed(layout, ns);
    tokens
        .chunks_exact(block_tokens.max(1))
        .map(|block| {
            h = block.iter().fold(mix(h, block.len() as u64), |acc, &t| mix(acc, t as u64));
            h
        })
        .collect()
}

/// Chain hash → the prefixes (and token counts) whose tokens hash to it.
#[derive(Debug, Default)]
pub struct PrefixIndex<P: Copy + Eq> {
    map: HashMap<u64, Vec<(P, u64)>>,
}

impl<P: Copy + Eq> PrefixIndex<P> {
    pub fn new() -> Self {
        Self { map: HashMap::new() }
    }

    /// Index every block boundary of a prefix's chain.
    pub fn insert(&mut self, chain: &[u64], block_tokens: usize, prefix: P) {
        for (i, &h) in chain.iter().enumerate() {
            self.map.entry(h).or_default().push((prefix, ((i + 1) * block_tokens) as u64));
        }
    }

    /// Forget every entry of `prefix`.
    pub fn remove(&mut self, chain: &[u64], prefix: P) {
        for h in chain {
            if let Some(v) = self.map.get_mut(h) {
                v.retain(|&(p, _)| p != prefix);
                if v.is_empty() {
                    self.map.remove(h);
                }
            }
        }
    }

    /// Candidates for the longest match, longest first: (prefix, tokens).
    /// The caller confirms each by comparing token ids.
    pub fn candidates<'a>(&'a self, chain: &'a [u64]) -> impl Iterator<Item = (P, u64)> + 'a {
        chain.iter().rev().filter_map(|h| self.map.get(h)).flatten().copied()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::layout::KvShape;

    fn layout(layers: u32) -> KvLayout {
        KvLayout::token_major(KvShape { layers, kv_heads: 1, head_dim: 8, elem_bytes: 2 }).unwrap()
    }

    #[test]
    fn chain_shares_a_prefix_and_depends_on_layout() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 9999;
        let d = Namespace::default();
        let ca = block_chain(&layout(2), &d, &a, 16);
        let cb = block_chain(&layout(2), &d, &b, 16);
        assert_eq!(ca.len(), 4);
        assert_eq!(ca[..2], cb[..2]);
        assert_ne!(ca[2], cb[2]);
        assert_ne!(ca[0], block_chain(&layout(3), &d, &a, 16)[0]);
    }

    #[test]
    fn chain_depends_on_namespace() {
        let a: Vec<u32> = (0..32).collect();
        let ns = |s: &[u8]| Namespace::new(s).unwrap();
        let base = block_chain(&layout(2), &Namespace::default(), &a, 16);
        let t1 = block_chain(&layout(2), &ns(b"tenant-1"), &a, 16);
        let t2 = block_chain(&layout(2), &ns(b"tenant-2"), &a, 16);
        assert_eq!(t1, block_chain(&layout(2), &ns(b"tenant-1"), &a, 16));
        for i in 0..2 {
            assert_ne!(t1[i], t2[i]);
            assert_ne!(t1[i], base[i]);
        }
    }

    #[test]
    fn index_returns_longest_first_and_forgets() {
        let a: Vec<u32> = (0..48).collect();
        let l = layout(2);
        let d = Namespace::default();
        let chain = block_chain(&l, &d, &a, 16);
        let mut idx = PrefixIndex::new();
        idx.insert(&chain[..2], 16, 7u32);
        let q = block_chain(&l, &d, &a, 16);
        assert_eq!(idx.candidates(&q).next(), Some((7, 32)));
        idx.remove(&chain[..2], 7);
        assert!(idx.is_empty());
    }
}
