//! The ledger stays exact under a long random create / share / append / pin /
//! unpin / destroy sequence. The expected owned and promised bytes come from
//! an independent model: granules are abstract identities, a sequence is a
//! list of them, a prefix holds its own; owned = distinct live identities.

mod kv_util;

use std::collections::{HashMap, HashSet};

use epmem::device::Stream;
use epmem::kv::{AdmitMode, KvConfig, KvPool, PrefixId, SeqId};
use kv_util::*;

#[derive(Clone)]
struct MSeq {
    max: u64,
    len: u64,
    /// Per slot: (identity, shared?) or None for the dummy.
    slots: Vec<Option<(u64, bool)>>,
    link: Option<PrefixId>,
    promise: u64,
}

struct MPrefix {
    ids: Vec<u64>,
    n: u64,
    pinned: bool,
}

struct Model {
    g: u64,
    bpt: u64,
    next_id: u64,
    seqs: HashMap<SeqId, MSeq>,
    prefixes: HashMap<PrefixId, MPrefix>,
}

impl Model {
    fn slots(&self, tokens: u64) -> usize {
        (tokens * self.bpt).div_ceil(self.g) as usize
    }
    fn fresh(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }
    fn owned(&self) -> u64 {
        let mut live: HashSet<u64> = HashSet::new();
        for s in self.seqs.values() {
            live.extend(s.slots.iter().flatten().map(|&(id, _)| id));
        }
        for p in self.prefixes.values() {
            live.extend(&p.ids);
        }
        (live.len() as u64 + 1) * self.g // + the dummy
    }
    fn promised(&self) -> u64 {
        self.seqs.values().map(|s| s.promise).sum::<u64>() * self.g
    }
    fn sharers(&self, pid: PrefixId) -> usize {
        self.seqs.values().filter(|s| s.link == Some(pid)).count()
    }
    fn unlink(&mut self, seq: SeqId) {
        if let Some(pid) = self.seqs.get_mut(&seq).and_then(|s| s.link.take()) {
            if self.sharers(pid) == 0 && !self.prefixes[&pid].pinned {
                self.prefixes.remove(&pid);
            }
        }
    }
}

#[test]
fn ledger_matches_an_independent_model_over_random_operations() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let l = qwen14b();
    let g = d.vmm_granularity() as u64;
    let mut a = KvPool::new(&d, KvConfig::new(1 << 40)).unwrap();
    let mut m = Model { g, bpt: l.bytes_per_token(), next_id: 0, seqs: HashMap::new(), prefixes: HashMap::new() };
    let mut rng = Rng::with_seed(0x5eed_4b56_0001);
    let steps = std::env::var("EPM_KV_RANDOM_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(600);
    let mut done = [0u32; 7];
    for step in 0..steps {
        let seq_ids: Vec<SeqId> = m.seqs.keys().copied().collect();
        let pids: Vec<PrefixId> = m.prefixes.keys().copied().collect();
        let op = below(&mut rng, 7);
        let mode = if below(&mut rng, 2) == 0 { AdmitMode::Promise } else { AdmitMode::OnDemand };
        match op {
            0 if m.seqs.len() < 12 => {
                let max = 1 + below(&mut rng, 60);
                let id = a.create_sequence(&l, max, mode).unwrap();
                let n = m.slots(max);
                let promise = if mode == AdmitMode::Promise { n as u64 } else { 0 };
                m.seqs.insert(id, MSeq { max, len: 0, slots: vec![None; n], link: None, promise });
            }
            1 | 2 if !seq_ids.is_empty() => {
                let id = seq_ids[below(&mut rng, seq_ids.len() as u64) as usize];
                let ms = m.seqs[&id].clone();
                let n = below(&mut rng, ms.max - ms.len + 1);
                a.prepare_append(id, n, s.raw()).unwrap();
                let first = (ms.len * m.bpt / g) as usize;
                let end = if n == 0 { first } else { m.slots(ms.len + n) };
                for i in first..end {
                    if !matches!(m.seqs[&id].slots[i], Some((_, false))) {
                        let fresh = m.fresh();
                        let ms = m.seqs.get_mut(&id).unwrap();
                        ms.slots[i] = Some((fresh, false));
                        ms.promise = ms.promise.saturating_sub(1);
                    }
                }
                let ms = m.seqs.get_mut(&id).unwrap();
                ms.len += n;
                if ms.link.is_some() && !ms.slots.iter().any(|s| matches!(s, Some((_, true)))) {
                    m.unlink(id);
                }
            }
            3 if !seq_ids.is_empty() => {
                let id = seq_ids[below(&mut rng, seq_ids.len() as u64) as usize];
                let ms = m.seqs[&id].clone();
                if ms.len == 0 {
                    continue;
                }
                let n = 1 + below(&mut rng, ms.len);
                let pid = a.pin_prefix(id, n, s.raw()).unwrap();
                let k = m.slots(n);
                let ids: Vec<u64> = ms.slots[..k].iter().map(|s| s.unwrap().0).collect();
                let old_cover = ms.link.map_or(0, |p| m.prefixes[&p].ids.len());
                let next = (ms.len * m.bpt / g) as usize;
                let bump = u64::from(ms.promise > 0 && ms.len < ms.max && next < k);
                m.prefixes.insert(pid, MPrefix { ids, n, pinned: true });
                let msm = m.seqs.get_mut(&id).unwrap();
                msm.promise += bump;
                for s in &mut msm.slots[..k] {
                    s.as_mut().unwrap().1 = true;
                }
                if k >= old_cover {
                    m.unlink(id);
                    m.seqs.get_mut(&id).unwrap().link = Some(pid);
                }
            }
            4 if !pids.is_empty() => {
                let pid = pids[below(&mut rng, pids.len() as u64) as usize];
                let (pn, ids) = (m.prefixes[&pid].n, m.prefixes[&pid].ids.clone());
                let n = 1 + below(&mut rng, pn);
                let max = n + below(&mut rng, 40);
                let id = a.commit_shared_prefix(pid, n, max, mode).unwrap();
                let total = m.slots(max);
                let k = m.slots(n);
                let full = (n * m.bpt / g) as usize;
                let promise = match mode {
                    AdmitMode::OnDemand => 0,
                    AdmitMode::Promise if max == n => total - k,
                    AdmitMode::Promise => total - full,
                } as u64;
                let mut slots = vec![None; total];
                for i in 0..k {
                    slots[i] = Some((ids[i], true));
                }
                m.seqs.insert(id, MSeq { max, len: n, slots, link: Some(pid), promise });
            }
            5 if !pids.is_empty() => {
                let pid = pids[below(&mut rng, pids.len() as u64) as usize];
                if !m.prefixes[&pid].pinned {
                    assert_eq!(a.unpin_prefix(pid).unwrap_err().status(), epmem::EpmStatus::InvalidState);
                    continue;
                }
                a.unpin_prefix(pid).unwrap();
                m.prefixes.get_mut(&pid).unwrap().pinned = false;
                if m.sharers(pid) == 0 {
                    m.prefixes.remove(&pid);
                }
            }
            6 if !seq_ids.is_empty() => {
                let id = seq_ids[below(&mut rng, seq_ids.len() as u64) as usize];
                a.destroy_sequence(id).unwrap();
                m.unlink(id);
                m.seqs.remove(&id);
            }
            _ => continue,
        }
        done[op as usize] += 1;
        let st = a.stats();
        assert_eq!(st.ledger.owned_bytes, m.owned(), "owned bytes after step {step} (op {op})");
        assert_eq!(st.ledger.promised_bytes, m.promised(), "promised bytes after step {step} (op {op})");
        assert_eq!(st.prefixes, m.prefixes.len() as u64, "live prefixes after step {step}");
        assert_eq!(st.ledger.owned_granules * g, st.ledger.owned_bytes);
        assert_eq!(st.ledger.charges - st.ledger.credits, st.ledger.owned_granules);
        // The device's own counts agree: every physical byte is owned or retained,
        // one VA per sequence and prefix, one mapping per slot and view granule.
        let live = d.live_counts();
        assert_eq!(live.physical_bytes, st.ledger.owned_bytes + st.pool.retained * g, "device bytes after step {step}");
        assert_eq!(live.va_reservations, (m.seqs.len() + m.prefixes.len()) as u64, "VA ranges after step {step}");
        let slots: usize = m.seqs.values().map(|s| s.slots.len()).sum::<usize>()
            + m.prefixes.values().map(|p| p.ids.len()).sum::<usize>();
        assert_eq!(live.mappings, slots as u64, "mappings after step {step}");
    }
    eprintln!("ops run: {done:?}");
    assert!(done.iter().all(|&n| n > 0), "every operation ran: {done:?}");
    // Tear down: everything but the dummy is credited.
    a.clear().unwrap();
    assert_eq!(a.stats().ledger.owned_bytes, g);
    assert_eq!(a.stats().ledger.promised_bytes, 0);
}
