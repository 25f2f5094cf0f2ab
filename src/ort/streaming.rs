//! Weight streaming inside the plugin EP.
//!
//! `GetCapability` claims the weight-heavy MatMul/Gemm nodes ([`super::claim`]),
//! one fused node each, with `drop_constant_initializers`: ORT leaves their
//! weights out of the fused nodes' inputs and may free its own copies.
//! `Compile` copies each weight into host memory the EP owns (ORT's copies
//! are valid only during the call), registers it with a residency manager
//! under the session's budget, and declares the execution order as the
//! cycle. Each `Compute` acquires its weight on the node's stream, runs the
//! GEMM there and releases it: the host does not wait on a GPU (the
//! manager's fences order the copies and the reads). On the host device, and
//! on a GPU when ORT gives the node no stream, the EP uses a stream of its
//! own and waits for it before returning, because then nothing else would
//! order ORT's next reader after the GEMM.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::abi::*;
use super::api::{Api, MemoryKind, TensorView};
use super::claim::{Claim, EpOptions, GemmAttrs, InputFacts, StreamWeights, decide};
use super::gemm_host::{GemmShape, gemm as host_gemm, to_f32};
use super::graph::elem_name;
use crate::arena::Arena;
use crate::device::{Device, DeviceKind, HostRange, RawStream};
use crate::error::{Error, Result};
use crate::residency::{ResidencyConfig, ResidencyManager, WeightId};

/// A node claimed in `GetCapability`, by the name of its first output (node
/// names are optional in ONNX; output names are unique).
#[derive(Debug, Clone)]
pub(crate) struct Claimed {
    /// Position in the graph's topological order.
    pub order: usize,
    pub node_name: String,
    pub claim: Claim,
}

/// Run the claim decision over a graph: add each claimed node as its own
/// fused node and return the claims by output name.
///
/// # Safety
/// `graph` and `info` are what ORT passed to `GetCapability`.
///
/// With `stream_weights=auto`, `budget` is the budget the session's
/// streamer would get: when the weights that qualify (each initializer
/// counted once) fit in it, nothing is claimed.
pub(crate) unsafe fn get_capability(
    api: &Api,
    ep_name: &str,
    opts: &EpOptions,
    budget: Option<usize>,
    graph: *const OrtGraph,
    info: *mut OrtEpGraphSupportInfo,
    first_order: usize,
) -> Result<Vec<(String, Claimed)>> {
    let mut out = Vec::new();
    if opts.stream_weights == StreamWeights::Never {
        return Ok(out);
    }
    let mut found = Vec::new();
    // SAFETY: per the caller, for every call below: the graph and its nodes
    // and value infos are live during GetCapability.
    let nodes = unsafe { api.graph_nodes(graph) }?;
    for (i, &node) in nodes.iter().enumerate() {
        // SAFETY: `node` is one of the live graph's nodes.
        let (name, op, domain) = unsafe { api.node_ident(node) }?;
        if !matches!(op.as_str(), "MatMul" | "Gemm") {
            continue;
        }
        let mut facts = Vec::new();
        // SAFETY: the node is live during GetCapability (as for every call below).
        for vi in unsafe { api.node_inputs(node) }? {
            facts.push(if vi.is_null() {
                None
            } else {
                Some(InputFacts {
                    // SAFETY: a live value info or node of the graph, during GetCapability.
                    name: unsafe { api.value_name(vi) }?,
                    // SAFETY: a live value info or node of the graph, during GetCapability.
                    ty: unsafe { api.value_type(vi) }?,
                    // SAFETY: a live value info or node of the graph, during GetCapability.
                    constant: unsafe { api.is_constant_initializer(vi) }?,
                })
            });
        }
        let attrs = if op == "Gemm" {
            let d = GemmAttrs::default();
            GemmAttrs {
                // SAFETY: a live value info or node of the graph, during GetCapability.
                trans_a: unsafe { api.node_attr_int(node, "transA") }?.unwrap_or(d.trans_a),
                // SAFETY: a live value info or node of the graph, during GetCapability.
                trans_b: unsafe { api.node_attr_int(node, "transB") }?.unwrap_or(d.trans_b),
                // SAFETY: a live value info or node of the graph, during GetCapability.
                alpha: unsafe { api.node_attr_float(node, "alpha") }?.unwrap_or(d.alpha),
                // SAFETY: a live value info or node of the graph, during GetCapability.
                beta: unsafe { api.node_attr_float(node, "beta") }?.unwrap_or(d.beta),
            }
        } else {
            GemmAttrs::default()
        };
        let Some(verdict) = decide(&op, &domain, &facts, attrs, opts.weight_min_bytes) else {
            continue;
        };
        match verdict {
            Err(r) => {
                let line = format!("epmem ({ep_name}): leaving {op} '{name}' to the other EPs: {}", r.reason);
                if r.notable {
                    log::warn!("{line}");
                } else {
                    log::info!("{line}");
                }
            }
            Ok(c) => found.push((i, node, name, op, c)),
        }
    }
    if let (StreamWeights::Auto, Some(budget)) = (opts.stream_weights, budget) {
        let mut seen = std::collections::HashSet::new();
        let bytes: usize = found.iter().filter(|f| seen.insert(f.4.weight.as_str())).map(|f| f.4.weight_bytes).sum();
        if !found.is_empty() && bytes <= budget {
            log::info!(
                "epmem ({ep_name}): the {} weights that could stream ({bytes} bytes) fit the budget of {budget} \
                 bytes: leaving their nodes to the other EPs (stream_weights=1 streams them anyway)",
                seen.len()
            );
            return Ok(out);
        }
    }
    for (i, node, name, op, c) in found {
        // SAFETY: the node is live during GetCapability.
        let outs = unsafe { api.node_outputs(node) }?;
        let Some(&o) = outs.first() else { continue };
        // SAFETY: a live value info of that node.
        let key = unsafe { api.value_name(o) }?;
        let opt =
            OrtNodeFusionOptions { ort_version_supported: ORT_VERSION_SUPPORTED, drop_constant_initializers: true };
        // SAFETY: ORT's support info and a live node; the options are read during the call.
        let st = unsafe { (api.e.EpGraphSupportInfo_AddNodesToFuse)(info, &node, 1, &opt) };
        api.check(st, "EpGraphSupportInfo_AddNodesToFuse")?;
        log::info!(
            "epmem ({ep_name}): claiming {op} '{name}': weight '{}' {}x{} {} ({} bytes){}",
            c.weight,
            c.k,
            c.n,
            elem_name(c.elem),
            c.weight_bytes,
            if c.trans_b { ", transB" } else { "" }
        );
        out.push((key, Claimed { order: first_order + i, node_name: name, claim: c }));
    }
    Ok(out)
}

/// The budget a session's streamer gets on `dev`: `budget_bytes`, or the
/// device's free memory minus the margin. Also the free and total bytes.
pub(crate) fn session_budget(dev: &dyn Device, opts: &EpOptions) -> Result<(usize, u64, u64)> {
    let (free, total) = dev.mem_get_info()?;
    let margin = opts.budget_margin_bytes.unwrap_or((total / 10).max(1 << 30));
    let budget = match opts.budget_bytes {
        Some(b) => b,
        None => free.checked_sub(margin).filter(|b| *b > 0).ok_or_else(|| {
            Error::new(
                crate::error::EpmStatus::OutOfBudget,
                format!(
                    "{}: the device has {free} bytes free, not more than the margin of {margin} bytes; set the EP option budget_bytes",
                    dev.info().name
                ),
            )
        })?,
    };
    let budget = usize::try_from(budget).map_err(|_| Error::invalid_argument("budget_bytes is too large"))?;
    Ok((budget, free, total))
}

/// A bias row kept by the EP: f32 for the host GEMM, element bytes in
/// device memory for the GPU one.
struct Bias {
    host: Vec<f32>,
    dev: Option<u64>,
    bytes: usize,
}

/// A part of a weight the manager streams as one unit: the output
/// columns `n0..n0 + n`, laid out as a weight of its own ([k, n], or [n, k]
/// with transB).
#[derive(Debug, Clone, Copy)]
struct Part {
    weight: WeightId,
    n0: usize,
    n: usize,
}

/// Indices of `Streamer::spent`: host work in `Compute` (all but the GEMM
/// call), the part of it in acquire and release, and the GEMM call.
const HOST: usize = 0;
const RESIDENCY: usize = 1;
const GEMM: usize = 2;
const SPENT: usize = 3;

/// One `Compute`'s time in acquire/release and in the GEMM call.
#[derive(Default)]
struct Times {
    residency: Duration,
    gemm: Duration,
}

/// One compiled node.
pub(crate) struct Kernel {
    label: String,
    claim: Claim,
    parts: Vec<Part>,
    bias: Option<Bias>,
}

/// What a session's EP owns for streaming: the weights' host copies, the
/// residency manager, the GEMM.
pub(crate) struct Streamer {
    api: Api,
    ep_name: String,
    dev: Arc<dyn Device>,
    /// How ORT labels this device's memory.
    kind: MemoryKind,
    budget: usize,
    /// Weights above this are streamed in parts (0: never).
    split_bytes: usize,
    /// Dropped before `hosts`: the manager reads them until it goes.
    mgr: Option<ResidencyManager>,
    /// Host copies of the weights, by initializer name, and the order of
    /// first use (the cycle).
    state: Mutex<Owned>,
    own_stream: Mutex<Option<RawStream>>,
    adopted: Mutex<HashMap<u64, RawStream>>,
    blas: Option<Mutex<super::gemm_cuda::Blas>>,
    warned_sync: AtomicBool,
    computes: AtomicU64,
    /// Nodes per session run: the cycle's length (set by `declare_cycle`).
    per_run: AtomicU64,
    /// The manager's htod bytes when the second run began: what the first
    /// run copied (every weight once, the resident set's fill included).
    first_run_htod: AtomicU64,
    /// Time in `Compute`, summed over every compute ([`HOST`]: outside the
    /// GEMM call, on the host device outside what replaces the kernel:
    /// read-backs, host GEMM; [`RESIDENCY`]: the part of it in acquire and
    /// release; [`GEMM`]: the call), and the same at the start of the second
    /// run.
    spent: [AtomicU64; SPENT],
    first_run_spent: [AtomicU64; SPENT],
}

#[derive(Default)]
struct Owned {
    hosts: Vec<Box<[u8]>>,
    by_name: HashMap<String, Vec<Part>>,
    /// (topological order, weight), sorted into the cycle.
    uses: Vec<(usize, WeightId)>,
    weight_bytes: usize,
    biases: Vec<u64>,
    /// Compiled nodes (each computes once per run).
    nodes: usize,
}

/// Whether [`split`] cuts `c`'s weight.
fn splits(c: &Claim, split_bytes: usize) -> bool {
    split_bytes != 0 && c.weight_bytes > split_bytes && c.n >= 128
}

/// Cut a weight's host copy into parts of at most `split_bytes` (none when
/// 0 or the weight is smaller; at least 64 columns each): whole output
/// columns, a multiple of 64 but the last, as few parts as that allows and
/// of about equal size, each laid out as a weight of its own. Returns
/// ((first column, columns), bytes) in column order.
fn split(c: &Claim, data: Box<[u8]>, split_bytes: usize) -> Vec<((usize, usize), Box<[u8]>)> {
    let (k, n) = (c.k, c.n);
    if !splits(c, split_bytes) || data.len() != c.weight_bytes {
        return vec![((0, n), data)];
    }
    let eb = data.len() / (k * n).max(1);
    // The most whole groups of 64 columns a part of split_bytes holds (at
    // least one group), then as few parts as that allows, balanced.
    let most = (split_bytes / (k * eb).max(1) / 64 * 64).max(64);
    let cols = n.div_ceil(n.div_ceil(most)).next_multiple_of(64).min(n);
    let mut out = Vec::new();
    let mut n0 = 0;
    while n0 < n {
        let w = cols.min(n - n0);
        let part: Box<[u8]> = if c.trans_b {
            // [n, k]: the part's rows are contiguous.
            data[n0 * k * eb..(n0 + w) * k * eb].into()
        } else {
            // [k, n]: gather the columns of each row.
            let mut v = Vec::with_capacity(k * w * eb);
            for r in 0..k {
                let at = (r * n + n0) * eb;
                v.extend_from_slice(&data[at..at + w * eb]);
            }
            v.into_boxed_slice()
        };
        out.push(((n0, w), part));
        n0 += w;
    }
    out
}

impl Streamer {
    /// A streamer for `dev` with the session's budget: `budget_bytes`, or
    /// the device's free memory minus the margin.
    pub fn new(api: Api, ep_name: &str, dev: Arc<dyn Device>, kind: MemoryKind, opts: &EpOptions) -> Result<Self> {
        let (budget, free, total) = session_budget(&*dev, opts)?;
        let mut cfg = ResidencyConfig::with_budget(budget);
        cfg.prefetch_depth = opts.prefetch_depth.unwrap_or(super::claim::DEFAULT_PREFETCH_DEPTH);
        if let Some(r) = opts.register_sources {
            cfg.register_sources = r;
        }
        let mgr = ResidencyManager::new(&dev, cfg)?;
        let blas = match dev.info().kind {
            DeviceKind::Cuda => Some(Mutex::new(super::gemm_cuda::Blas::open(dev.info().ordinal)?)),
            DeviceKind::Host => None,
        };
        log::info!(
            "epmem ({ep_name}): streaming weights on {} under a budget of {budget} bytes ({} bytes free, {} total)",
            dev.info().name,
            free,
            total
        );
        Ok(Self {
            api,
            ep_name: ep_name.to_string(),
            dev,
            kind,
            budget,
            split_bytes: usize::try_from(opts.split_bytes).unwrap_or(usize::MAX),
            mgr: Some(mgr),
            state: Mutex::new(Owned::default()),
            own_stream: Mutex::new(None),
            adopted: Mutex::new(HashMap::new()),
            blas,
            warned_sync: AtomicBool::new(false),
            computes: AtomicU64::new(0),
            per_run: AtomicU64::new(0),
            first_run_htod: AtomicU64::new(0),
            spent: Default::default(),
            first_run_spent: Default::default(),
        })
    }

    fn mgr(&self) -> &ResidencyManager {
        // Some from `new` until Drop.
        self.mgr.as_ref().expect("the residency manager lives until the streamer is dropped")
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Owned> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Compile one claimed node: copy its weight (once per initializer) and
    /// bias out of ORT's graph and register the weight.
    ///
    /// # Safety
    /// `graph` is the single-node graph ORT passed to `Compile` for it.
    pub unsafe fn compile_node(&self, graph: *const OrtGraph, c: &Claimed) -> Result<Arc<Kernel>> {
        let api = &self.api;
        let claim = &c.claim;
        // SAFETY: per the caller: the graph, its node and initializers are
        // live during Compile.
        let nodes = unsafe { api.graph_nodes(graph) }?;
        crate::ensure!(
            nodes.len() == 1,
            Internal,
            "a fused graph of {} nodes; the EP fuses one node each",
            nodes.len()
        );
        // SAFETY: the graph's node, live during Compile.
        let inputs = unsafe { api.node_inputs(nodes[0]) }?;
        let find = |name: &str| -> Result<*const OrtValueInfo> {
            for &vi in &inputs {
                // SAFETY: the node's live input value infos.
                if !vi.is_null() && unsafe { api.value_name(vi) }? == name {
                    return Ok(vi);
                }
            }
            Err(Error::internal(format!("node '{}' has no input '{name}' at Compile", c.node_name)))
        };
        let label =
            if c.node_name.is_empty() { format!("{} of '{}'", claim.op, claim.weight) } else { c.node_name.clone() };
        // Parts are laid out for the node's transB: a weight split for a
        // MatMul and for a transB Gemm is registered once for each.
        let key = if claim.trans_b && splits(claim, self.split_bytes) {
            format!("{} (transB)", claim.weight)
        } else {
            claim.weight.clone()
        };
        let parts = {
            let known = self.state().by_name.get(&key).cloned();
            match known {
                Some(p) => p,
                None => {
                    // SAFETY: the graph's initializer value info, live during Compile.
                    let v = unsafe { api.initializer_value(find(&claim.weight)?) }?;
                    // SAFETY: the initializer value, live during Compile.
                    let t = unsafe { api.tensor(v, false) }?;
                    crate::ensure!(
                        t.bytes == claim.weight_bytes,
                        Internal,
                        "initializer '{}' has {} bytes, its type says {}",
                        claim.weight,
                        t.bytes,
                        claim.weight_bytes
                    );
                    let data = self.host_copy(&t)?;
                    let pieces = split(claim, data, self.split_bytes);
                    let largest = pieces.iter().map(|p| p.1.len()).max().unwrap_or(0);
                    if largest > self.budget {
                        crate::bail!(
                            OutOfBudget,
                            "weight '{}' of node '{label}' has {} bytes{}, more than the streaming budget of {} bytes \
                             (EP option budget_bytes): it could never be resident",
                            claim.weight,
                            claim.weight_bytes,
                            if pieces.len() > 1 { format!(" (parts of up to {largest})") } else { String::new() },
                            self.budget
                        );
                    }
                    let mut parts = Vec::with_capacity(pieces.len());
                    for ((n0, n), data) in pieces {
                        // SAFETY: `data` is owned by this streamer and dropped only
                        // after the manager (see Drop), never written meanwhile.
                        let range = unsafe { HostRange::new(data.as_ptr(), data.len()) };
                        let w = self.mgr().register(range)?;
                        self.state().hosts.push(data);
                        parts.push(Part { weight: w, n0, n });
                    }
                    let mut st = self.state();
                    st.by_name.insert(key, parts.clone());
                    st.weight_bytes += claim.weight_bytes;
                    parts
                }
            }
        };
        let bias = match &claim.bias {
            None => None,
            Some(b) => {
                // SAFETY: the graph's initializer value info, live during Compile.
                let v = unsafe { api.initializer_value(find(b)?) }?;
                // SAFETY: the initializer value, live during Compile.
                let t = unsafe { api.tensor(v, false) }?;
                let bytes = self.host_copy(&t)?;
                crate::ensure!(
                    bytes.len() == claim.n * super::graph::elem_bytes(claim.elem).unwrap_or(4),
                    Internal,
                    "bias '{b}' has {} bytes",
                    bytes.len()
                );
                let dev = match self.dev.info().kind {
                    DeviceKind::Cuda => {
                        let p = self.dev.mem_alloc(bytes.len())?;
                        self.state().biases.push(p);
                        let s = self.own_stream()?;
                        // SAFETY: p has room for the bytes; the source lives
                        // until the copy completes (synchronized just below).
                        unsafe { self.dev.memcpy_htod_async(p, bytes.as_ptr(), bytes.len(), s) }?;
                        self.dev.stream_synchronize(s)?;
                        Some(p)
                    }
                    DeviceKind::Host => None,
                };
                Some(Bias { host: to_f32(claim.elem, &bytes), dev, bytes: bytes.len() })
            }
        };
        // Parts in column order, all at the node's position (the sort is stable).
        let mut st = self.state();
        st.uses.extend(parts.iter().map(|p| (c.order, p.weight)));
        st.nodes += 1;
        drop(st);
        Ok(Arc::new(Kernel { label, claim: claim.clone(), parts, bias }))
    }

    /// Declare the execution order of every weight compiled so far as the
    /// manager's cycle.
    pub fn declare_cycle(&self) -> Result<()> {
        let (order, n, bytes) = {
            let mut st = self.state();
            st.uses.sort_by_key(|u| u.0);
            let mut seen = std::collections::HashSet::new();
            let order: Vec<WeightId> = st.uses.iter().map(|u| u.1).filter(|w| seen.insert(*w)).collect();
            self.per_run.store(st.nodes as u64, Ordering::Relaxed);
            (order, st.by_name.len(), st.weight_bytes)
        };
        self.mgr().declare_cycle(&order)?;
        log::info!(
            "epmem ({}): {n} weights of {bytes} bytes registered, budget {} bytes ({:.0}% of the weights)",
            self.ep_name,
            self.budget,
            100.0 * self.budget as f64 / bytes.max(1) as f64
        );
        Ok(())
    }

    /// A host copy of a tensor ORT owns (CPU memory, or ours).
    fn host_copy(&self, t: &TensorView) -> Result<Box<[u8]>> {
        if t.desc.kind == self.kind && t.desc.mem_type == DEVICE_MEMORY_DEFAULT {
            let mut v = vec![0u8; t.bytes].into_boxed_slice();
            let s = self.own_stream()?;
            // SAFETY: v has t.bytes bytes; synchronized before use.
            unsafe { self.dev.memcpy_dtoh_async(v.as_mut_ptr(), t.ptr, t.bytes, s) }?;
            self.dev.stream_synchronize(s)?;
            Ok(v)
        } else {
            // One pass over the source (no zero-fill first: weights are GiBs).
            // SAFETY: ORT's tensor in host-readable memory of t.bytes bytes.
            Ok(unsafe { std::slice::from_raw_parts(t.ptr as *const u8, t.bytes) }.into())
        }
    }

    fn own_stream(&self) -> Result<RawStream> {
        let mut s = self.own_stream.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = *s {
            return Ok(s);
        }
        let n = self.dev.stream_create()?;
        *s = Some(n);
        Ok(n)
    }

    /// The device's handle for ORT's native stream (adopted once).
    fn adopt(&self, native: u64) -> Result<RawStream> {
        let mut m = self.adopted.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = m.get(&native) {
            return Ok(*s);
        }
        let s = self.dev.stream_wrap_native(native).map_err(|e| {
            e.context(&format!("the stream ORT runs this node on ({native:#x}) cannot be used by epmem"))
        })?;
        m.insert(native, s);
        Ok(s)
    }

    /// Whether a tensor is in this device's (DEFAULT) memory.
    fn on_device(&self, t: &TensorView) -> bool {
        t.desc.kind == self.kind && t.desc.mem_type == DEVICE_MEMORY_DEFAULT
    }

    /// `Compute` of one node.
    ///
    /// # Safety
    /// `ctx` is the live kernel context of a `Compute` call for `k`'s node.
    pub unsafe fn compute(&self, k: &Kernel, ctx: *mut OrtKernelContext) -> Result<()> {
        let t0 = Instant::now();
        let mut t = Times::default();
        // SAFETY: per the caller.
        let r = unsafe { self.compute_timed(k, ctx, &mut t) };
        let host = t0.elapsed().saturating_sub(t.gemm);
        for (i, d) in [(HOST, host), (RESIDENCY, t.residency), (GEMM, t.gemm)] {
            self.spent[i].fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        }
        r
    }

    /// `compute`, adding the time spent in the GEMM itself to `gemm`.
    ///
    /// # Safety
    /// As for [`Self::compute`].
    unsafe fn compute_timed(&self, k: &Kernel, ctx: *mut OrtKernelContext, t: &mut Times) -> Result<()> {
        let api = &self.api;
        let c = &k.claim;
        // SAFETY: per the caller for every ORT call on ctx and its values.
        let n_in = unsafe { api.kernel_input_count(ctx) }?;
        crate::ensure!(
            n_in == 1,
            Internal,
            "node '{}' got {n_in} inputs; the EP expects 1 (its weight is its own)",
            k.label
        );
        // SAFETY: per the caller, `ctx` is this Compute's live kernel context.
        let a = unsafe { api.kernel_input(ctx, 0) }?
            .ok_or_else(|| Error::invalid_argument(format!("node '{}' got no input", k.label)))?;
        // SAFETY: a live input value of this Compute.
        let at = unsafe { api.value_tensor_type(a) }?;
        crate::ensure!(
            at.elem == c.elem,
            InvalidArgument,
            "node '{}': input is {}, weight is {}",
            k.label,
            elem_name(at.elem),
            elem_name(c.elem)
        );
        let rank_ok = if c.op == "Gemm" { at.dims.len() == 2 } else { !at.dims.is_empty() };
        crate::ensure!(rank_ok, InvalidArgument, "node '{}': input of shape {:?}", k.label, at.dims);
        let last = *at.dims.last().unwrap_or(&0);
        crate::ensure!(
            last == c.k as i64,
            InvalidArgument,
            "node '{}': input of shape {:?} has {last} columns, the weight has {} rows",
            k.label,
            at.dims,
            c.k
        );
        let lead = &at.dims[..at.dims.len() - 1];
        let m = lead.iter().try_fold(1usize, |acc, &d| usize::try_from(d).ok().and_then(|d| acc.checked_mul(d)));
        let m = m.ok_or_else(|| Error::invalid_argument(format!("node '{}': input shape {:?}", k.label, at.dims)))?;
        let mut out_dims = lead.to_vec();
        out_dims.push(c.n as i64);
        // SAFETY: ctx is the live kernel context (the caller's contract).
        let y = unsafe { api.kernel_output(ctx, 0, &out_dims) }?;
        let n = self.computes.fetch_add(1, Ordering::Relaxed);
        let per_run = self.per_run.load(Ordering::Relaxed);
        if n == per_run && n > 0 {
            // The second run begins: what was copied so far is the first run's.
            self.first_run_htod.store(self.mgr().stats().htod_bytes, Ordering::Relaxed);
            for (f, s) in self.first_run_spent.iter().zip(&self.spent) {
                f.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
            }
        }
        if m == 0 {
            return Ok(());
        }
        // SAFETY: live values of this Compute.
        let av = unsafe { api.tensor(a, false) }?;
        // SAFETY: live values of this Compute.
        let yv = unsafe { api.tensor(y, true) }?;
        let shape = GemmShape { m, k: c.k, n: c.n, trans_b: c.trans_b, alpha: c.alpha, beta: c.beta };
        // Asked on every device, so CI's host-device runs exercise the call;
        // only a GPU node uses the answer.
        // SAFETY: ctx is the live kernel context.
        let given = unsafe { api.kernel_gpu_stream(ctx) }?;
        match self.dev.info().kind {
            DeviceKind::Host => self.compute_host(k, shape, &av, &yv, t),
            DeviceKind::Cuda => self.compute_cuda(k, shape, &av, &yv, given, t),
        }
    }

    /// Run `f` between acquire and release of part `p` on `s`: the
    /// release is recorded whatever `f` returns.
    /// Adds the time of the acquire and the release to `res`.
    fn with_weight<T>(
        &self,
        p: &Part,
        s: RawStream,
        res: &mut Duration,
        f: impl FnOnce(u64) -> Result<T>,
    ) -> Result<T> {
        let t = Instant::now();
        let addr = self.mgr().acquire(p.weight, s)?;
        *res += t.elapsed();
        let r = f(addr);
        let t = Instant::now();
        let rel = self.mgr().release(p.weight, s);
        *res += t.elapsed();
        let v = r?;
        rel?;
        Ok(v)
    }

    /// `times.gemm` gets the time of what the host device does where a GPU runs
    /// a kernel on device tensors: the input's and the weight's read-back,
    /// the host GEMM and the output's copy.
    fn compute_host(
        &self,
        k: &Kernel,
        s: GemmShape,
        av: &TensorView,
        yv: &TensorView,
        times: &mut Times,
    ) -> Result<()> {
        let c = &k.claim;
        let eb = super::graph::elem_bytes(c.elem).unwrap_or(4);
        let stream = self.own_stream()?;
        let t = Instant::now();
        let x = self.host_copy(av)?;
        crate::ensure!(x.len() == s.m * s.k * eb, Internal, "input of {} bytes", x.len());
        let mut spent = t.elapsed();
        let mut out = vec![0u8; s.m * s.n * eb];
        for p in &k.parts {
            let t = Instant::now();
            let bytes = p.n * s.k * eb;
            let mut w = vec![0u8; bytes];
            spent += t.elapsed();
            self.with_weight(p, stream, &mut times.residency, |addr| {
                let t = Instant::now();
                // SAFETY: w has the part's bytes; read only after the sync below.
                let r = unsafe { self.dev.memcpy_dtoh_async(w.as_mut_ptr(), addr, bytes, stream) };
                spent += t.elapsed();
                r
            })?;
            let t2 = Instant::now();
            self.dev.stream_synchronize(stream)?;
            let part = GemmShape { n: p.n, ..s };
            let bias = k.bias.as_ref().map(|b| &b.host[p.n0..p.n0 + p.n]);
            let y = host_gemm(c.elem, part, &x, &w, bias);
            // The part's [m, n] into columns n0.. of the [m, N] output.
            for (r, row) in y.chunks_exact(p.n * eb).enumerate() {
                let at = (r * s.n + p.n0) * eb;
                out[at..at + row.len()].copy_from_slice(row);
            }
            spent += t2.elapsed();
        }
        let t = Instant::now();
        crate::ensure!(out.len() == yv.bytes, Internal, "output of {} bytes for {} computed", yv.bytes, out.len());
        if self.on_device(yv) {
            // SAFETY: the output has yv.bytes bytes; `out` lives until the sync.
            unsafe { self.dev.memcpy_htod_async(yv.ptr, out.as_ptr(), out.len(), stream) }?;
            self.dev.stream_synchronize(stream)?;
        } else {
            // SAFETY: ORT's output tensor in host-readable memory of yv.bytes bytes.
            unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), yv.ptr as *mut u8, out.len()) };
        }
        times.gemm += spent + t.elapsed();
        Ok(())
    }

    /// `given`: the native stream ORT runs the node on, if any.
    fn compute_cuda(
        &self,
        k: &Kernel,
        s: GemmShape,
        av: &TensorView,
        yv: &TensorView,
        given: Option<u64>,
        times: &mut Times,
    ) -> Result<()> {
        crate::ensure!(
            self.on_device(av) && self.on_device(yv),
            InvalidArgument,
            "node '{}': its input or output is not in this GPU's memory (input {:?}, output {:?}); \
             add ORT's CUDA EP to the session so activations stay on the GPU",
            k.label,
            av.desc,
            yv.desc
        );
        let (stream, native, sync) = match given {
            Some(n) => (self.adopt(n)?, n, false),
            None => {
                if !self.warned_sync.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "epmem ({}): ORT gives the EP's nodes no GPU stream (no CUDA EP in the session?): \
                         each node waits for the whole GPU, runs on the EP's own stream and waits for it",
                        self.ep_name
                    );
                }
                // Whatever produced the input ran on a stream we do not know.
                if let Some(b) = self.blas.as_ref() {
                    b.lock().unwrap_or_else(|p| p.into_inner()).synchronize_context()?;
                }
                let own = self.own_stream()?;
                (own, self.dev.stream_native(own)?, true)
            }
        };
        let c = &k.claim;
        let eb = super::graph::elem_bytes(c.elem).unwrap_or(4);
        let blas = self.blas.as_ref().ok_or_else(|| Error::internal("no cuBLAS handle on a CUDA device"))?;
        let mut shape = s;
        match &k.bias {
            Some(b) if s.beta != 0.0 => {
                let src = b.dev.ok_or_else(|| Error::internal("bias not on the device"))?;
                // Broadcast the bias row into Y: one copy, then doubling.
                let row = c.n * eb;
                self.dev.memcpy_dtod_async(yv.ptr, src, b.bytes.min(row), stream)?;
                let mut done = 1usize;
                while done < s.m {
                    let rows = done.min(s.m - done);
                    self.dev.memcpy_dtod_async(yv.ptr + (done * row) as u64, yv.ptr, rows * row, stream)?;
                    done += rows;
                }
            }
            _ => shape.beta = 0.0,
        }
        for p in &k.parts {
            let gemm = &mut times.gemm;
            self.with_weight(p, stream, &mut times.residency, |w| {
                let mut h = blas.lock().unwrap_or_else(|p| p.into_inner());
                let t = Instant::now();
                // SAFETY: x, w, y are device addresses of m·k, k·p.n, m·n
                // elements: ORT's tensors (checked sizes via their shapes) and
                // the acquired part, which stays resident until the release
                // recorded after this GEMM on the same stream completes; the
                // part writes columns n0..n0 + p.n of each row of Y (ldc n).
                let r = unsafe {
                    h.gemm(native, c.elem, GemmShape { n: p.n, ..shape }, av.ptr, w, yv.ptr + (p.n0 * eb) as u64, s.n)
                };
                *gemm += t.elapsed();
                r
            })?;
        }
        if sync {
            self.dev.stream_synchronize(stream)?;
        }
        Ok(())
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        let Some(mgr) = self.mgr.take() else { return };
        if let Err(e) = mgr.synchronize() {
            log::warn!("epmem ({}): synchronizing the weight streams at release: {e}", self.ep_name);
        }
        let s = mgr.stats();
        let arena = mgr.arena().clone();
        let (weights, units, bytes) = {
            let st = self.state();
            (st.by_name.len(), st.hosts.len(), st.weight_bytes)
        };
        drop(mgr);
        let a = arena.stats();
        drop(arena);
        let biases = std::mem::take(&mut self.state().biases);
        for p in biases {
            if let Err(e) = self.dev.mem_free(p) {
                log::warn!("epmem ({}): freeing a bias: {e}", self.ep_name);
            }
        }
        if let Some(st) = self.own_stream.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = self.dev.synchronize();
            if let Err(e) = self.dev.stream_destroy(st) {
                log::warn!("epmem ({}): destroying its stream: {e}", self.ep_name);
            }
        }
        for (_, st) in self.adopted.get_mut().unwrap_or_else(|p| p.into_inner()).drain() {
            let _ = self.dev.stream_destroy(st);
        }
        let computes = self.computes.load(Ordering::Relaxed);
        let per_run = self.per_run.load(Ordering::Relaxed);
        // Per compute after the first run (its page-ins are the resident
        // set's fill), or over every compute when there was one run.
        let later = computes > per_run && per_run > 0;
        let n = if later { computes - per_run } else { computes }.max(1) as f64;
        let us = |i: usize| {
            let first = if later { self.first_run_spent[i].load(Ordering::Relaxed) } else { 0 };
            (self.spent[i].load(Ordering::Relaxed) - first) as f64 / 1e3 / n
        };
        log::info!(
            "epmem ({}): weight streaming released: weights={weights} units={units} weight_bytes={bytes} budget_bytes={} \
             computes={computes} nodes_per_run={} first_run_htod_bytes={} host_us_per_compute={:.2} \
             residency_us_per_compute={:.2} gemm_call_us_per_compute={:.2} \
             acquires={} hits={} page_ins={} evictions={} eviction_waits={} plans={} ring_bytes={} \
             peak_resident_bytes={} htod_bytes={} stall_ms={:.1} device_stall_ms={:.1} host_stall_ms={:.1} \
             background_waits={} live_allocations_after={} in_use_bytes_after={}",
            self.ep_name,
            self.budget,
            per_run,
            self.first_run_htod.load(Ordering::Relaxed),
            us(HOST),
            us(RESIDENCY),
            us(GEMM),
            s.acquires,
            s.hits,
            s.page_ins,
            s.evictions,
            s.eviction_waits,
            s.plans,
            s.ring_bytes,
            s.peak_resident_bytes,
            s.htod_bytes,
            s.stall_ms,
            s.device_stall_ms,
            s.host_stall_ms,
            s.background_waits,
            a.live_allocations,
            a.in_use_bytes
        );
    }
}

/// The `OrtNodeComputeInfo` of one compiled node.
#[repr(C)]
pub(crate) struct ComputeInfo {
    base: OrtNodeComputeInfo,
    streamer: Arc<Streamer>,
    kernel: Arc<Kernel>,
}

impl ComputeInfo {
    pub fn create(streamer: Arc<Streamer>, kernel: Arc<Kernel>) -> *mut OrtNodeComputeInfo {
        Box::into_raw(Box::new(ComputeInfo {
            base: OrtNodeComputeInfo {
                ort_version_supported: ORT_VERSION_SUPPORTED,
                CreateState: Some(create_state),
                Compute: Some(compute),
                ReleaseState: Some(release_state),
            },
            streamer,
            kernel,
        })) as *mut OrtNodeComputeInfo
    }

    /// # Safety
    /// `p` came from [`ComputeInfo::create`] and is not used afterwards.
    pub unsafe fn destroy(p: *mut OrtNodeComputeInfo) {
        // SAFETY: per the caller.
        drop(unsafe { Box::from_raw(p as *mut ComputeInfo) });
    }
}

/// # Safety
/// `this` is a compute info made by [`ComputeInfo::create`].
unsafe fn me<'a>(this: *const OrtNodeComputeInfo) -> &'a ComputeInfo {
    // SAFETY: per the caller; `base` is the first field of a repr(C) struct.
    unsafe { &*(this as *const ComputeInfo) }
}

unsafe extern "C" fn create_state(
    this: *mut OrtNodeComputeInfo,
    _ctx: *mut OrtNodeComputeContext,
    state: *mut *mut c_void,
) -> *mut OrtStatus {
    // SAFETY: ORT passes the info we gave it.
    let info = unsafe { me(this) };
    super::status_boundary(&info.streamer.api, "CreateState", || {
        crate::ensure!(!state.is_null(), NullPointer, "state is NULL");
        // The state is the info itself: everything a Compute needs is there.
        // SAFETY: non-NULL out-param.
        unsafe { *state = this as *mut c_void };
        Ok(())
    })
}

unsafe extern "C" fn compute(
    this: *mut OrtNodeComputeInfo,
    _state: *mut c_void,
    ctx: *mut OrtKernelContext,
) -> *mut OrtStatus {
    // SAFETY: ORT passes the info we gave it.
    let info = unsafe { me(this) };
    super::status_boundary(&info.streamer.api, "Compute", || {
        crate::ensure!(!ctx.is_null(), NullPointer, "kernel context is NULL");
        // SAFETY: ORT's live kernel context for this node.
        unsafe { info.streamer.compute(&info.kernel, ctx) }.map_err(|e| e.context(&info.kernel.label))
    })
}

unsafe extern "C" fn release_state(_this: *mut OrtNodeComputeInfo, _state: *mut c_void) {
    // The state is the compute info, released by ReleaseNodeComputeInfos.
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(k: usize, n: usize, trans_b: bool) -> Claim {
        Claim {
            op: "MatMul",
            weight: "w".into(),
            trans_b,
            alpha: 1.0,
            bias: None,
            beta: 0.0,
            k,
            n,
            elem: TENSOR_ELEMENT_FLOAT16,
            weight_bytes: k * n * 2,
            a_rank: 2,
        }
    }

    /// Element (r, col) of a [k, n] (or, transposed, [n, k]) f16 weight as
    /// two distinct bytes.
    fn weight(k: usize, n: usize, trans_b: bool) -> Box<[u8]> {
        let mut v = Vec::with_capacity(k * n * 2);
        for i in 0..k * n {
            let (r, col) = if trans_b { (i % k, i / k) } else { (i / n, i % n) };
            v.extend_from_slice(&((r * 7 + col * 13) as u16).to_le_bytes());
        }
        v.into_boxed_slice()
    }

    #[test]
    fn parts_are_whole_columns_that_put_the_weight_back_together() {
        for trans_b in [false, true] {
            let (k, n) = (96, 1000);
            let c = claim(k, n, trans_b);
            let full = weight(k, n, trans_b);
            let parts = split(&c, full.clone(), 40_000);
            // 192 columns (36864 bytes) fit 40000: 6 parts of 167 rounded up to 192.
            assert_eq!(parts.len(), 6, "192000 bytes in parts of at most 40000");
            let mut next = 0;
            for ((n0, w), bytes) in &parts {
                assert_eq!(*n0, next, "columns in order, none missed");
                assert!(*n0 + w == n || w % 64 == 0, "{w} columns");
                assert_eq!(bytes.len(), k * w * 2);
                assert!(bytes.len() <= 40_000);
                // The part is the weight's columns n0.. as a [k, w] (or [w, k]) weight.
                for r in 0..k {
                    for j in 0..*w {
                        let at = if trans_b { j * k + r } else { r * w + j };
                        let got = u16::from_le_bytes([bytes[2 * at], bytes[2 * at + 1]]);
                        assert_eq!(got as usize, r * 7 + (n0 + j) * 13, "trans_b {trans_b} ({r}, {})", n0 + j);
                    }
                }
                next = n0 + w;
            }
            assert_eq!(next, n);
            // Not split: below the size, 0, or too few columns.
            assert_eq!(split(&c, full.clone(), 0).len(), 1);
            assert_eq!(split(&c, full.clone(), 1 << 20).len(), 1);
            assert_eq!(split(&claim(2000, 100, trans_b), weight(2000, 100, trans_b), 1000).len(), 1);
        }
    }
}
