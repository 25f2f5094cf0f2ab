//! Shared prefixes: pin, commit into new sequences, find by content hash
//! (within one namespace, see [`super::namespace`]).
//!
//! A prefix is the granules covering a sequence's first `n_tokens` tokens —
//! its full granules plus the partial boundary granule. Pinning maps them
//! read-only into the prefix's own *view* reservation (the source of every
//! sharer's copy-on-write, which outlives the sequence it was pinned from)
//! and turns them read-only in the origin sequence too, so nobody can write
//! shared bytes. `commit_shared_prefix` maps them read-only at offset 0 of a
//! new sequence: each granule gains a reference, the ledger gains nothing —
//! the Nth sharer costs 0 owned bytes.
//!
//! Lifetime: a prefix lives while it is pinned or while any sequence still
//! maps one of its granules through it (its sharers). A pinned prefix is
//! never reclaimed; unpinning it with no sharers frees it at once, otherwise
//! it goes with its last sharer. Each granule goes back to the pool when its
//! last mapping (view or sequence) is gone.

use super::granule::GranuleId;
use super::hash::block_chain;
use super::id::{PrefixId, SeqId};
use super::layout::KvLayout;
use super::namespace::Namespace;
use super::pool::{AdmitMode, KvPool};
use super::sequence::Slot;
use crate::device::{Access, DevicePtr, RawStream, VaRange};
use crate::error::Result;

#[derive(Debug)]
pub(crate) struct Prefix {
    pub layout: KvLayout,
    pub n_tokens: u64,
    pub granules: Vec<GranuleId>,
    /// Every granule mapped read-only, in order.
    pub view: VaRange,
    pub pinned: bool,
    /// Sequences linked to this prefix (they map its granules).
    pub sharers: u32,
    /// Token ids, when the origin declared them (content-hash detection).
    pub tokens: Vec<u32>,
    /// The origin's namespace: only lookups in it find this prefix.
    pub namespace: Namespace,
    /// The indexed block chain (to unindex on destroy).
    pub chain: Vec<u64>,
}

/// What a host can ask about a prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixInfo {
    pub n_tokens: u64,
    pub granules: u64,
    pub pinned: bool,
    pub sharers: u32,
    /// Read-only view of the prefix's bytes (token 0 at this address).
    pub view_base: DevicePtr,
}

impl KvPool {
    /// Pin the first `n_tokens` tokens of a sequence as a shared prefix.
    ///
    /// Waits for `stream` first (the origin's granules turn read-only, and a
    /// kernel still writing into the boundary granule would fault). If the
    /// origin was admitted with a promise and will next write into the now
    /// shared boundary granule, one more granule is promised for its
    /// copy-on-write (OutOfBudget if the ledger cannot hold it).
    pub fn pin_prefix(&mut self, seq_id: SeqId, n_tokens: u64, stream: RawStream) -> Result<PrefixId> {
        let g = self.granule() as u64;
        let block = self.config.hash_block_tokens as usize;
        let seq = self.seqs.get(seq_id)?;
        crate::ensure!(
            n_tokens > 0 && n_tokens <= seq.len,
            InvalidArgument,
            "KV pin: {n_tokens} tokens outside 1..={} (tokens written to sequence {seq_id:#x})",
            seq.len
        );
        let bpt = seq.layout.bytes_per_token();
        let k = (n_tokens * bpt).div_ceil(g) as usize;
        let next_slot = (seq.len * bpt / g) as usize;
        let cow_promise = u64::from(seq.promise > 0 && seq.len < seq.max_tokens && next_slot < k);
        let granules: Vec<GranuleId> = seq.slots[..k]
            .iter()
            .map(|s| match *s {
                Slot::Shared(gid) | Slot::Private(gid) => Ok(gid),
                Slot::Dummy => crate::bail!(Internal, "KV pin: written slot maps the dummy"),
            })
            .collect::<Result<_>>()?;
        // Wait before promising, so a failed wait leaves the ledger as it was.
        self.wait_for_stream(stream)?;
        self.pool.ledger_mut().promise(cow_promise * g)?;
        self.pool.trim_to_budget();

        let view = match self.map_view(&granules) {
            Ok(v) => v,
            Err(e) => {
                self.pool.ledger_mut().unpromise(cow_promise * g)?;
                return Err(e);
            }
        };
        let seq = self.seqs.get_mut(seq_id)?;
        let mut switched = Vec::new();
        let mut failed = None;
        for i in 0..k {
            if let Slot::Private(gid) = seq.slots[i] {
                if let Err(e) = seq.va.set_access(i, Access::ReadOnly) {
                    failed = Some(e);
                    break;
                }
                seq.slots[i] = Slot::Shared(gid);
                switched.push(i);
            }
        }
        if let Some(e) = failed {
            // Undo everything: the origin's slots turn writable again, the
            // view's references go (else its granules are never credited),
            // and the promise returns (found by tests/fault_injection.rs).
            for &i in &switched {
                if let Slot::Shared(gid) = seq.slots[i] {
                    seq.va.set_access(i, Access::ReadWrite)?;
                    seq.slots[i] = Slot::Private(gid);
                }
            }
            let mut view = view;
            for (j, &gid) in granules.iter().enumerate() {
                view.unmap(j * g as usize, g as usize)?;
                self.pool.release(gid)?;
            }
            self.pool.ledger_mut().unpromise(cow_promise * g)?;
            return Err(e);
        }
        seq.promise += cow_promise;
        let tokens =
            if seq.tokens.len() as u64 >= n_tokens { seq.tokens[..n_tokens as usize].to_vec() } else { Vec::new() };
        let namespace = seq.namespace.clone();
        let chain = block_chain(&seq.layout, &namespace, &tokens, block);
        let layout = seq.layout;
        // Link the origin to the prefix that covers all of its shared slots.
        let old_cover = match seq.prefix {
            Some(pid) => self.prefixes.get(pid)?.granules.len(),
            None => 0,
        };
        let relink = k >= old_cover;
        let pid = self.prefixes.insert(Prefix {
            layout,
            n_tokens,
            granules,
            view,
            pinned: true,
            sharers: 0,
            tokens,
            namespace,
            chain,
        });
        if relink {
            self.unlink(seq_id)?;
            self.seqs.get_mut(seq_id)?.prefix = Some(pid);
            self.prefixes.get_mut(pid)?.sharers = 1;
        }
        let p = self.prefixes.get(pid)?;
        self.index.insert(&p.chain, block, pid);
        Ok(pid)
    }

    /// Drop the pin. The prefix is freed now if no sequence shares it, else
    /// with its last sharer. Unpinning twice is InvalidState.
    pub fn unpin_prefix(&mut self, pid: PrefixId) -> Result<()> {
        let p = self.prefixes.get_mut(pid)?;
        crate::ensure!(p.pinned, InvalidState, "KV prefix {pid:#x} is not pinned");
        p.pinned = false;
        if p.sharers == 0 {
            self.destroy_prefix(pid)?;
        }
        Ok(())
    }

    /// A new sequence of up to `max_tokens` tokens whose first `n_tokens`
    /// tokens map the prefix read-only at offset 0 (no copy, no charge).
    pub fn commit_shared_prefix(
        &mut self,
        pid: PrefixId,
        n_tokens: u64,
        max_tokens: u64,
        mode: AdmitMode,
    ) -> Result<SeqId> {
        let p = self.prefixes.get(pid)?;
        let (layout, tokens) = (p.layout, p.tokens.get(..n_tokens as usize).map(<[u32]>::to_vec));
        let seq = self.build_sequence(&layout, max_tokens, Some((pid, n_tokens)), mode)?;
        if let Some(t) = tokens {
            self.seqs.get_mut(seq)?.tokens = t;
        }
        Ok(seq)
    }

    /// The longest live prefix of the default namespace whose declared
    /// tokens begin `tokens` (whole hash blocks only), as (prefix, shared tokens).
    pub fn find_prefix(&self, layout: &KvLayout, tokens: &[u32]) -> Option<(PrefixId, u64)> {
        self.find_prefix_in(&Namespace::default(), layout, tokens)
    }

    /// As [`KvPool::find_prefix`], among the prefixes of namespace `ns` only.
    pub fn find_prefix_in(&self, ns: &Namespace, layout: &KvLayout, tokens: &[u32]) -> Option<(PrefixId, u64)> {
        let chain = block_chain(layout, ns, tokens, self.config.hash_block_tokens as usize);
        self.index.candidates(&chain).find(|&(pid, m)| {
            self.prefixes.get(pid).is_ok_and(|p| {
                p.layout == *layout
                    && p.namespace == *ns
                    && m <= p.n_tokens
                    && p.tokens.get(..m as usize) == tokens.get(..m as usize)
            })
        })
    }

    /// A new sequence that declares `tokens` (its prompt): if a live prefix
    /// begins with the same tokens, its longest match is shared (as
    /// [`KvPool::commit_shared_prefix`]) and the caller skips prefill for
    /// them. Returns (sequence, tokens already in the cache). The default
    /// namespace: see [`KvPool::create_sequence_for_tokens_in`].
    pub fn create_sequence_for_tokens(
        &mut self,
        layout: &KvLayout,
        max_tokens: u64,
        tokens: &[u32],
        mode: AdmitMode,
    ) -> Result<(SeqId, u64)> {
        self.create_sequence_for_tokens_in(&Namespace::default(), layout, max_tokens, tokens, mode)
    }

    /// As [`KvPool::create_sequence_for_tokens`] in namespace `ns`: only a
    /// prefix pinned from a sequence of `ns` is shared, and prefixes later
    /// pinned from the new sequence are found only by lookups in `ns`.
    pub fn create_sequence_for_tokens_in(
        &mut self,
        ns: &Namespace,
        layout: &KvLayout,
        max_tokens: u64,
        tokens: &[u32],
        mode: AdmitMode,
    ) -> Result<(SeqId, u64)> {
        crate::ensure!(
            tokens.len() as u64 <= max_tokens,
            InvalidArgument,
            "KV sequence: {} declared tokens exceed max_tokens {max_tokens}",
            tokens.len()
        );
        let (seq, shared) = match self.find_prefix_in(ns, layout, tokens) {
            Some((pid, m)) => {
                let s = self.commit_shared_prefix(pid, m, max_tokens, mode)?;
                self.counters.hash_hits += 1;
                (s, m)
            }
            None => (self.create_sequence(layout, max_tokens, mode)?, 0),
        };
        let s = self.seqs.get_mut(seq)?;
        s.tokens = tokens.to_vec();
        s.namespace = ns.clone();
        Ok((seq, shared))
    }

    /// Declare more token ids of a sequence (appended to those declared), so
    /// a prefix pinned from it can be found by content.
    pub fn declare_tokens(&mut self, seq_id: SeqId, tokens: &[u32]) -> Result<()> {
        let seq = self.seqs.get_mut(seq_id)?;
        crate::ensure!(
            (seq.tokens.len() + tokens.len()) as u64 <= seq.max_tokens,
            InvalidArgument,
            "KV sequence {seq_id:#x}: {} declared tokens would exceed max_tokens {}",
            seq.tokens.len() + tokens.len(),
            seq.max_tokens
        );
        seq.tokens.extend_from_slice(tokens);
        Ok(())
    }

    pub fn prefix_info(&self, pid: PrefixId) -> Result<PrefixInfo> {
        let p = self.prefixes.get(pid)?;
        Ok(PrefixInfo {
            n_tokens: p.n_tokens,
            granules: p.granules.len() as u64,
            pinned: p.pinned,
            sharers: p.sharers,
            view_base: p.view.base(),
        })
    }

    /// A read-only view of `granules`, each gaining a reference; all or nothing.
    fn map_view(&mut self, granules: &[GranuleId]) -> Result<VaRange> {
        let g = self.granule();
        let mut view = VaRange::reserve(&self.dev, granules.len() * g)?;
        for (i, &gid) in granules.iter().enumerate() {
            let r = self.pool.phys(gid).and_then(|p| view.map(i * g, g, p, 0, Access::ReadOnly));
            if let Err(e) = r.and_then(|()| self.pool.add_ref(gid)) {
                for (j, &done) in granules[..i].iter().enumerate() {
                    let _ = view.unmap(j * g, g);
                    let _ = self.pool.release(done);
                }
                return Err(e);
            }
        }
        Ok(view)
    }

    /// Unmap the view, drop its granule references, unindex it.
    pub(crate) fn destroy_prefix(&mut self, pid: PrefixId) -> Result<()> {
        let mut p = self.prefixes.remove(pid)?;
        self.index.remove(&p.chain, pid);
        let g = self.granule();
        let mut first = Ok(());
        for (i, &gid) in p.granules.iter().enumerate() {
            let r = p.view.unmap(i * g, g).and_then(|()| self.pool.release(gid));
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}
