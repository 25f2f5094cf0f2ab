//! Which nodes the EP claims, and its session options.
//!
//! The EP streams the weights of MatMul and Gemm nodes whose weight (input
//! B) is a constant 2-D initializer of at least `weight_min_bytes`, in
//! float32, float16 or bfloat16. Everything else stays with the session's
//! other EPs; a candidate that is not claimed gets a log line saying why.
//! The decision is made from plain facts ([`InputFacts`]) so it is tested
//! without ORT.

use super::abi::*;
use super::graph::{TensorType, elem_bytes, elem_name};
use crate::error::{Error, Result};

/// EP option: when the EP claims nodes: `auto` (the default) only when the
/// weights it would claim exceed the budget, `1` always, `0` never (the EP
/// then serves memory only).
pub const OPT_STREAM_WEIGHTS: &str = "stream_weights";
/// EP option: the smallest weight claimed, in bytes (default 1 MiB).
pub const OPT_WEIGHT_MIN_BYTES: &str = "weight_min_bytes";
/// EP option: device bytes the streamed weights may occupy at once.
pub const OPT_BUDGET_BYTES: &str = "budget_bytes";
/// EP option: with no `budget_bytes`, the budget is the device's free
/// memory at session creation minus this (default: a tenth of the device's
/// memory, at least 1 GiB).
pub const OPT_BUDGET_MARGIN_BYTES: &str = "budget_margin_bytes";
/// EP option: weights paged in ahead of use along the execution order
/// (default [`DEFAULT_PREFETCH_DEPTH`]).
pub const OPT_PREFETCH_DEPTH: &str = "prefetch_depth";
/// The EP's prefetch depth when the option is not given: 2. At a run's end
/// the host waits for the outputs and then starts the next run; with depth 1
/// only the next streamed weight is queued across that gap and the copy
/// engine idles in it. Depth never adds bytes (the window's later units go
/// only into free or already-read memory, docs/RESIDENCY.md); on the H200
/// it took the 8.4 GiB decoder at 75% from 0.89 to 0.91 x the PCIe floor.
pub const DEFAULT_PREFETCH_DEPTH: usize = 2;
/// EP option: when the weights' host pages are registered with the device
/// (`memlock`: within RLIMIT_MEMLOCK, the default; `always`; `never`).
pub const OPT_REGISTER_SOURCES: &str = "register_sources";
/// EP option: weights larger than this are streamed in parts of at most
/// about this many bytes (whole columns of the output), each its own unit
/// of the residency manager (default 0: whole weights).
pub const OPT_SPLIT_BYTES: &str = "split_bytes";

const KNOWN: &[&str] = &[
    OPT_STREAM_WEIGHTS,
    OPT_WEIGHT_MIN_BYTES,
    OPT_BUDGET_BYTES,
    OPT_BUDGET_MARGIN_BYTES,
    OPT_PREFETCH_DEPTH,
    OPT_REGISTER_SOURCES,
    OPT_SPLIT_BYTES,
];

/// The EP's options, from the session's `ep.<registered name>.<key>`
/// config entries (what `add_provider_for_devices(devs, {key: value})` and
/// `SessionOptionsAppendExecutionProvider_V2` store).
/// When the EP claims the weight-heavy nodes (EP option `stream_weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamWeights {
    /// Only when the claimable weights exceed the budget. When they fit,
    /// streaming has nothing to save and would add a fused node's dispatch,
    /// an acquire and a release to each of them: the session's other EPs
    /// keep them, so a model that fits runs as it does without epmem's EP.
    Auto,
    /// Whenever a node qualifies, whatever the budget.
    Always,
    /// Never: the EP serves memory only.
    Never,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EpOptions {
    pub stream_weights: StreamWeights,
    pub weight_min_bytes: u64,
    pub budget_bytes: Option<u64>,
    pub budget_margin_bytes: Option<u64>,
    pub prefetch_depth: Option<usize>,
    pub register_sources: Option<crate::residency::RegisterSources>,
    /// 0: whole weights.
    pub split_bytes: u64,
}

impl Default for EpOptions {
    fn default() -> Self {
        Self {
            stream_weights: StreamWeights::Auto,
            weight_min_bytes: 1 << 20,
            budget_bytes: None,
            budget_margin_bytes: None,
            prefetch_depth: None,
            register_sources: None,
            split_bytes: 0,
        }
    }
}

impl EpOptions {
    /// Read the entries under `ep.<ep_name lowercased>.`. A value that does
    /// not parse is an error naming the key; an unknown key is reported to
    /// the log (ORT may add keys of its own under the prefix).
    pub fn parse(ep_name: &str, entries: &[(String, String)]) -> Result<Self> {
        let prefix = format!("ep.{}.", ep_name.to_lowercase());
        let mut o = Self::default();
        for (k, v) in entries {
            let Some(key) = k.strip_prefix(&prefix) else { continue };
            let bad = |why: &str, want: &str| {
                Error::invalid_argument(format!("EP option {key}={v:?}: {why}; expected {want}"))
            };
            match key {
                OPT_STREAM_WEIGHTS => {
                    o.stream_weights = match v.trim() {
                        "auto" => StreamWeights::Auto,
                        "1" | "true" | "True" | "always" => StreamWeights::Always,
                        "0" | "false" | "False" | "never" => StreamWeights::Never,
                        _ => return Err(bad("unknown value", "auto, 1 or 0")),
                    }
                }
                OPT_WEIGHT_MIN_BYTES => {
                    o.weight_min_bytes =
                        super::options::parse_bytes(v).map_err(|w| bad(w, "a byte count such as 1048576 or 1MiB"))?
                }
                OPT_BUDGET_BYTES => {
                    o.budget_bytes = Some(
                        super::options::parse_bytes(v)
                            .map_err(|w| bad(w, "a byte count such as 4294967296 or 4GiB"))?,
                    )
                }
                OPT_BUDGET_MARGIN_BYTES => {
                    o.budget_margin_bytes =
                        Some(super::options::parse_bytes(v).map_err(|w| bad(w, "a byte count such as 2GiB"))?)
                }
                OPT_PREFETCH_DEPTH => {
                    o.prefetch_depth = Some(v.trim().parse().map_err(|_| bad("not a whole number", "0, 1, 2, ..."))?)
                }
                OPT_REGISTER_SOURCES => {
                    use crate::residency::RegisterSources as R;
                    o.register_sources = Some(match v.trim() {
                        "memlock" => R::WithinMemlock,
                        "always" => R::Always,
                        "never" => R::Never,
                        _ => return Err(bad("unknown value", "memlock, always or never")),
                    })
                }
                OPT_SPLIT_BYTES => {
                    o.split_bytes = if v.trim() == "0" {
                        0
                    } else {
                        super::options::parse_bytes(v)
                            .map_err(|w| bad(w, "0 (whole weights) or a byte count such as 32MiB"))?
                    }
                }
                _ => log::warn!("epmem: ignoring unknown EP option {k:?}; epmem's EP reads {}", KNOWN.join(", ")),
            }
        }
        Ok(o)
    }
}

/// What the graph says about one input of a candidate node.
#[derive(Debug, Clone)]
pub(crate) struct InputFacts {
    pub name: String,
    pub ty: Option<TensorType>,
    pub constant: bool,
}

/// The attributes of a Gemm node (ONNX defaults when absent).
#[derive(Debug, Clone, Copy)]
pub(crate) struct GemmAttrs {
    pub trans_a: i64,
    pub trans_b: i64,
    pub alpha: f32,
    pub beta: f32,
}

impl Default for GemmAttrs {
    fn default() -> Self {
        Self { trans_a: 0, trans_b: 0, alpha: 1.0, beta: 1.0 }
    }
}

/// A claimed node: Y = alpha · A · op(W) (+ beta · bias), A's leading
/// dimensions flattened into rows.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Claim {
    /// "MatMul" or "Gemm".
    pub op: &'static str,
    pub weight: String,
    /// W is stored [N, K] (Gemm transB=1) rather than [K, N].
    pub trans_b: bool,
    pub alpha: f32,
    /// Gemm's C: a constant [N] or [1, N] initializer, added times beta.
    pub bias: Option<String>,
    pub beta: f32,
    pub k: usize,
    pub n: usize,
    pub elem: ONNXTensorElementDataType,
    pub weight_bytes: usize,
    /// A's rank as the graph declares it (MatMul: ≥ 1; Gemm: 2).
    pub a_rank: usize,
}

/// Why a candidate was not claimed, and whether it matters (a weight-heavy
/// node left to the other EPs is logged as a warning, a small one as info).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub reason: String,
    pub notable: bool,
}

fn refuse(reason: String, notable: bool) -> Refusal {
    Refusal { reason, notable }
}

/// Decide whether to claim a node. None: not a MatMul or Gemm of the ONNX
/// domain. `inputs[i]` is None where an optional input is absent.
pub(crate) fn decide(
    op_type: &str,
    domain: &str,
    inputs: &[Option<InputFacts>],
    attrs: GemmAttrs,
    min_bytes: u64,
) -> Option<std::result::Result<Claim, Refusal>> {
    if !(domain.is_empty() || domain == "ai.onnx") {
        return None;
    }
    let op: &'static str = match op_type {
        "MatMul" => "MatMul",
        "Gemm" => "Gemm",
        _ => return None,
    };
    Some(decide_gemm(op, inputs, attrs, min_bytes))
}

fn decide_gemm(
    op: &'static str,
    inputs: &[Option<InputFacts>],
    attrs: GemmAttrs,
    min_bytes: u64,
) -> std::result::Result<Claim, Refusal> {
    let gemm = op == "Gemm";
    let arity_ok = if gemm { (2..=3).contains(&inputs.len()) } else { inputs.len() == 2 };
    let (Some(a), Some(Some(w))) = (inputs.first().cloned().flatten(), inputs.get(1)) else {
        return Err(refuse(format!("{op} with {} inputs", inputs.len()), false));
    };
    if !arity_ok {
        return Err(refuse(format!("{op} with {} inputs", inputs.len()), false));
    }
    if !w.constant {
        // A weight-sized 2-D tensor that is not constant (a graph input, an
        // overridable initializer) deserves a warning; an activation (the
        // attention products) is the normal case.
        let weight_like = w.ty.as_ref().is_some_and(|t| {
            t.dims.len() == 2
                && t.dims.iter().all(|&d| d > 0)
                && elem_bytes(t.elem).is_some_and(|eb| (t.dims[0] * t.dims[1]) as u64 * eb as u64 >= min_bytes)
        });
        return Err(refuse(
            format!("its weight input '{}' is not a constant initializer (it can change per run)", w.name),
            weight_like,
        ));
    }
    let Some(wt) = w.ty.as_ref() else {
        return Err(refuse(format!("weight '{}' has no tensor type", w.name), true));
    };
    let Some(eb) = elem_bytes(wt.elem) else {
        return Err(refuse(
            format!("weight '{}' is {}; the EP computes float32, float16 and bfloat16", w.name, elem_name(wt.elem)),
            true,
        ));
    };
    if wt.dims.len() != 2 || wt.dims.iter().any(|&d| d <= 0) {
        return Err(refuse(format!("weight '{}' has shape {:?}; the EP takes a 2-D weight", w.name, wt.dims), true));
    }
    let (r, c) = (wt.dims[0] as usize, wt.dims[1] as usize);
    let bytes = r.saturating_mul(c).saturating_mul(eb);
    if (bytes as u64) < min_bytes {
        return Err(refuse(
            format!("weight '{}' has {bytes} bytes, below weight_min_bytes={min_bytes}", w.name),
            false,
        ));
    }
    if gemm && attrs.trans_a != 0 {
        return Err(refuse("Gemm with transA=1 (the EP takes A untransposed)".into(), true));
    }
    let trans_b = gemm && attrs.trans_b != 0;
    let (k, n) = if trans_b { (c, r) } else { (r, c) };
    if a.constant {
        return Err(refuse(format!("its input '{}' is a constant initializer too", a.name), true));
    }
    let Some(at) = a.ty.as_ref() else {
        return Err(refuse(format!("input '{}' has no tensor type", a.name), true));
    };
    if at.elem != wt.elem {
        return Err(refuse(
            format!("input '{}' is {} but the weight is {}", a.name, elem_name(at.elem), elem_name(wt.elem)),
            true,
        ));
    }
    let rank_ok = if gemm { at.dims.len() == 2 } else { !at.dims.is_empty() };
    if !rank_ok {
        return Err(refuse(format!("input '{}' has rank {}", a.name, at.dims.len()), true));
    }
    if let Some(&last) = at.dims.last()
        && last > 0
        && last as usize != k
    {
        return Err(refuse(format!("input '{}' has {last} columns but the weight has {k} rows", a.name), true));
    }
    let mut bias = None;
    if let Some(Some(cf)) = inputs.get(2)
        && attrs.beta != 0.0
    {
        let shape_ok =
            cf.ty.as_ref().is_some_and(|t| t.elem == wt.elem && (t.dims == [n as i64] || t.dims == [1, n as i64]));
        if !cf.constant || !shape_ok {
            return Err(refuse(
                format!("its bias '{}' is not a constant [{n}] or [1, {n}] initializer of the weight's type", cf.name),
                true,
            ));
        }
        bias = Some(cf.name.clone());
    }
    Ok(Claim {
        op,
        weight: w.name.clone(),
        trans_b,
        alpha: if gemm { attrs.alpha } else { 1.0 },
        bias,
        beta: if gemm { attrs.beta } else { 0.0 },
        k,
        n,
        elem: wt.elem,
        weight_bytes: bytes,
        a_rank: at.dims.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(elem: ONNXTensorElementDataType, dims: &[i64]) -> Option<TensorType> {
        Some(TensorType { elem, dims: dims.to_vec() })
    }
    fn input(name: &str, ty: Option<TensorType>, constant: bool) -> Option<InputFacts> {
        Some(InputFacts { name: name.into(), ty, constant })
    }
    const F: ONNXTensorElementDataType = TENSOR_ELEMENT_FLOAT;

    #[test]
    fn claims_a_batched_matmul_with_a_large_constant_weight() {
        let ins = [input("x", t(F, &[-1, -1, 512]), false), input("w", t(F, &[512, 1024]), true)];
        let c = decide("MatMul", "", &ins, GemmAttrs::default(), 1 << 20).unwrap().unwrap();
        assert_eq!((c.k, c.n, c.weight_bytes, c.trans_b, c.a_rank), (512, 1024, 2 << 20, false, 3));
        assert_eq!(c.weight, "w");
    }

    #[test]
    fn claims_gemm_trans_b_with_a_bias_vector() {
        let ins = [
            input("x", t(TENSOR_ELEMENT_FLOAT16, &[-1, 1024]), false),
            input("w", t(TENSOR_ELEMENT_FLOAT16, &[2048, 1024]), true),
            input("b", t(TENSOR_ELEMENT_FLOAT16, &[2048]), true),
        ];
        let attrs = GemmAttrs { trans_b: 1, alpha: 0.5, beta: 2.0, ..Default::default() };
        let c = decide("Gemm", "ai.onnx", &ins, attrs, 1 << 20).unwrap().unwrap();
        assert_eq!((c.k, c.n, c.trans_b), (1024, 2048, true));
        assert_eq!((c.alpha, c.beta, c.bias.as_deref()), (0.5, 2.0, Some("b")));
    }

    #[test]
    fn leaves_what_it_cannot_stream_and_says_why() {
        let min = 1 << 20;
        let big = t(F, &[1024, 1024]);
        let x = input("x", t(F, &[4, 1024]), false);
        let why = |op: &str, ins: &[Option<InputFacts>], attrs: GemmAttrs| {
            decide(op, "", ins, attrs, min).unwrap().unwrap_err()
        };
        let r = why("MatMul", &[x.clone(), input("w", big.clone(), false)], GemmAttrs::default());
        assert!(r.notable && r.reason.contains("not a constant initializer"), "{r:?}");
        let r = why("MatMul", &[x.clone(), input("kt", t(F, &[-1, 1024, -1]), false)], GemmAttrs::default());
        assert!(!r.notable && r.reason.contains("not a constant initializer"), "an activation: {r:?}");
        let r = why("MatMul", &[x.clone(), input("w", t(7, &[1024, 1024]), true)], GemmAttrs::default());
        assert!(r.notable && r.reason.contains("int64"), "{r:?}");
        let r = why("MatMul", &[x.clone(), input("w", t(F, &[16, 16]), true)], GemmAttrs::default());
        assert!(!r.notable && r.reason.contains("below weight_min_bytes"), "{r:?}");
        let r = why("MatMul", &[x.clone(), input("w", t(F, &[8, 1024, 1024]), true)], GemmAttrs::default());
        assert!(r.reason.contains("2-D"), "{r:?}");
        let r =
            why("MatMul", &[input("x", t(F, &[4, 512]), false), input("w", big.clone(), true)], GemmAttrs::default());
        assert!(r.reason.contains("512 columns"), "{r:?}");
        let attrs = GemmAttrs { trans_a: 1, ..Default::default() };
        let r = why("Gemm", &[x.clone(), input("w", big.clone(), true)], attrs);
        assert!(r.reason.contains("transA"), "{r:?}");
        let r = why(
            "Gemm",
            &[x.clone(), input("w", big.clone(), true), input("c", t(F, &[4, 1024]), true)],
            GemmAttrs::default(),
        );
        assert!(r.reason.contains("bias"), "{r:?}");
        let r = why(
            "Gemm",
            &[x.clone(), input("w", big.clone(), true), input("c", t(F, &[1024]), false)],
            GemmAttrs::default(),
        );
        assert!(r.reason.contains("bias"), "{r:?}");
        let r = why(
            "MatMul",
            &[input("x", t(TENSOR_ELEMENT_FLOAT16, &[4, 1024]), false), input("w", big, true)],
            GemmAttrs::default(),
        );
        assert!(r.reason.contains("float16"), "{r:?}");
        assert!(decide("Add", "", &[], GemmAttrs::default(), min).is_none());
        assert!(decide("MatMul", "com.microsoft", &[], GemmAttrs::default(), min).is_none());
    }

    #[test]
    fn options_parse_under_the_eps_prefix() {
        let e = |k: &str, v: &str| (format!("ep.epmem.{k}"), v.to_string());
        let o = EpOptions::parse(
            "EpMem",
            &[
                e("budget_bytes", "64MiB"),
                e("weight_min_bytes", "4096"),
                e("prefetch_depth", "2"),
                e("stream_weights", "1"),
                e("split_bytes", "32MiB"),
                ("ep.other.budget_bytes".into(), "garbage".into()),
                ("session.x".into(), "1".into()),
            ],
        )
        .unwrap();
        assert_eq!(o.budget_bytes, Some(64 << 20));
        assert_eq!((o.weight_min_bytes, o.prefetch_depth, o.stream_weights), (4096, Some(2), StreamWeights::Always));
        assert_eq!(o.split_bytes, 32 << 20);
        assert_eq!(EpOptions::parse("epmem", &[e("split_bytes", "0")]).unwrap().split_bytes, 0);
        assert!(EpOptions::parse("epmem", &[e("split_bytes", "x")]).is_err());
        assert_eq!(EpOptions::parse("epmem", &[]).unwrap(), EpOptions::default());
        let err = EpOptions::parse("epmem", &[e("budget_bytes", "lots")]).unwrap_err();
        assert!(err.message().contains("budget_bytes"), "{err}");
        assert!(EpOptions::parse("epmem", &[e("stream_weights", "maybe")]).is_err());
        assert_eq!(
            EpOptions::parse("epmem", &[e("stream_weights", "0")]).unwrap().stream_weights,
            StreamWeights::Never
        );
        assert_eq!(
            EpOptions::parse("epmem", &[e("stream_weights", "auto")]).unwrap().stream_weights,
            StreamWeights::Auto
        );
        assert_eq!(EpOptions::parse("epmem", &[]).unwrap().stream_weights, StreamWeights::Auto);
        let r = EpOptions::parse("epmem", &[e("register_sources", "always")]).unwrap();
        assert_eq!(r.register_sources, Some(crate::residency::RegisterSources::Always));
        assert!(EpOptions::parse("epmem", &[e("register_sources", "sometimes")]).is_err());
    }
}
