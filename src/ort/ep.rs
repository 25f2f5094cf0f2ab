//! `OrtEp`: the per-session execution provider. It claims the weight-heavy
//! MatMul/Gemm nodes and streams their weights (`streaming`); every other
//! node runs on the session's other EPs, while tensors may also live in
//! epmem memory (ORT inserts copies through our data transfer where a
//! kernel needs them elsewhere). With `stream_weights=0` it claims nothing;
//! with the default `auto`, nothing when the weights it would claim fit the
//! budget.

use std::collections::HashMap;
use std::ffi::c_char;
use std::sync::{Arc, Mutex};

use super::abi::*;
use super::claim::{EpOptions, StreamWeights};
use super::factory::Factory;
use super::status_boundary;
use super::streaming::{Claimed, ComputeInfo, Streamer, get_capability, session_budget};
use crate::error::Result;

#[repr(C)]
pub(crate) struct Ep {
    base: OrtEp,
    factory: Arc<Factory>,
    /// Index of the device (in `factory.devices`) this EP runs on.
    device: usize,
    opts: EpOptions,
    /// Claims of the latest `GetCapability`, by the claimed node's first output.
    claims: Mutex<HashMap<String, Claimed>>,
    /// Made at the first `Compile` that has claimed nodes.
    streamer: Mutex<Option<Arc<Streamer>>>,
}

impl Ep {
    pub fn create(factory: Arc<Factory>, device: usize, opts: EpOptions) -> *mut OrtEp {
        let ep = Box::new(Ep {
            base: OrtEp {
                ort_version_supported: ORT_VERSION_SUPPORTED,
                GetName: Some(get_name),
                // Must be set: ORT calls it unconditionally (NULL crashes ORT).
                GetCapability: Some(get_capability_c),
                Compile: Some(compile),
                ReleaseNodeComputeInfos: Some(release_node_compute_infos),
                GetPreferredDataLayout: None,
                ShouldConvertDataLayoutForOp: None,
                SetDynamicOptions: None,
                OnRunStart: None,
                OnRunEnd: None,
                // NULL: ORT uses the factory's CreateAllocator.
                CreateAllocator: None,
                CreateSyncStreamForDevice: None,
                GetCompiledModelCompatibilityInfo: None,
                GetKernelRegistry: None,
                IsConcurrentRunSupported: None,
                Sync: None,
                CreateProfiler: None,
                _v26_v27: [None; 8],
            },
            factory,
            device,
            opts,
            claims: Mutex::new(HashMap::new()),
            streamer: Mutex::new(None),
        });
        Box::into_raw(ep) as *mut OrtEp
    }

    /// # Safety
    /// `p` came from [`Ep::create`] and is not used afterwards.
    pub unsafe fn destroy(p: *mut OrtEp) {
        // SAFETY: per the caller.
        drop(unsafe { Box::from_raw(p as *mut Ep) });
    }

    fn name(&self) -> String {
        self.factory.ep_name.to_string_lossy().into_owned()
    }

    fn streamer(&self) -> Result<Arc<Streamer>> {
        let mut s = self.streamer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = s.as_ref() {
            return Ok(s.clone());
        }
        let d = &self.factory.devices[self.device];
        let made = Arc::new(Streamer::new(self.factory.api, &self.name(), d.dev.clone(), d.kind, &self.opts)?);
        *s = Some(made.clone());
        Ok(made)
    }
}

/// # Safety
/// `this` is an EP made by [`Ep::create`].
unsafe fn me<'a>(this: *const OrtEp) -> &'a Ep {
    // SAFETY: per the caller; `base` is the first field of a repr(C) struct.
    unsafe { &*(this as *const Ep) }
}

unsafe extern "C" fn get_name(this: *const OrtEp) -> *const c_char {
    // The EP's name must be the factory's: the name it was registered under.
    // SAFETY: ORT passes the EP we gave it.
    unsafe { me(this) }.factory.ep_name.as_ptr()
}

unsafe extern "C" fn get_capability_c(
    this: *mut OrtEp,
    graph: *const OrtGraph,
    info: *mut OrtEpGraphSupportInfo,
) -> *mut OrtStatus {
    // SAFETY: as above.
    let ep = unsafe { me(this) };
    status_boundary(&ep.factory.api, "GetCapability", || {
        crate::ensure!(!graph.is_null() && !info.is_null(), NullPointer, "graph or support info is NULL");
        // Under stream_weights=auto the claim depends on the budget the
        // session's streamer would get (made later, at the first Compile).
        let budget = match ep.opts.stream_weights {
            StreamWeights::Auto => Some(session_budget(&*ep.factory.devices[ep.device].dev, &ep.opts)?.0),
            _ => None,
        };
        // SAFETY: ORT's live graph and support info for this call.
        let found = unsafe { get_capability(&ep.factory.api, &ep.name(), &ep.opts, budget, graph, info, 0) }?;
        let mut claims = ep.claims.lock().unwrap_or_else(|p| p.into_inner());
        claims.extend(found);
        Ok(())
    })
}

unsafe extern "C" fn compile(
    this: *mut OrtEp,
    graphs: *const *const OrtGraph,
    fused: *const *const OrtNode,
    count: usize,
    infos: *mut *mut OrtNodeComputeInfo,
    _ctx_nodes: *mut *mut OrtNode,
) -> *mut OrtStatus {
    // SAFETY: as above.
    let ep = unsafe { me(this) };
    let api = ep.factory.api;
    status_boundary(&api, "Compile", || {
        crate::ensure!(
            count == 0 || (!graphs.is_null() && !fused.is_null() && !infos.is_null()),
            NullPointer,
            "Compile was given NULL arrays"
        );
        if count == 0 {
            return Ok(());
        }
        let streamer = ep.streamer()?;
        let mut made: Vec<*mut OrtNodeComputeInfo> = Vec::with_capacity(count);
        let r = (|| -> Result<()> {
            for i in 0..count {
                // SAFETY: ORT passes `count` live graphs; each holds the one
                // node we fused, whose first output keys our claim.
                let g = unsafe { *graphs.add(i) };
                // SAFETY: `g` is one of those live graphs.
                let nodes = unsafe { api.graph_nodes(g) }?;
                let node = *nodes.first().ok_or_else(|| crate::error::Error::internal("an empty fused graph"))?;
                // SAFETY: `node` belongs to the live graph `g`.
                let outs = unsafe { api.node_outputs(node) }?;
                let out = *outs.first().ok_or_else(|| crate::error::Error::internal("a fused node without outputs"))?;
                // SAFETY: `out` is a value info of that live node.
                let key = unsafe { api.value_name(out) }?;
                let claimed =
                    ep.claims.lock().unwrap_or_else(|p| p.into_inner()).get(&key).cloned().ok_or_else(|| {
                        crate::error::Error::internal(format!("asked to compile '{key}', which was not claimed"))
                    })?;
                // SAFETY: the graph ORT passed for this node.
                let k = unsafe { streamer.compile_node(g, &claimed) }?;
                made.push(ComputeInfo::create(streamer.clone(), k));
            }
            streamer.declare_cycle()
        })();
        match r {
            Ok(()) => {
                for (i, p) in made.into_iter().enumerate() {
                    // SAFETY: ORT's array has room for `count` infos.
                    unsafe { *infos.add(i) = p };
                }
                Ok(())
            }
            Err(e) => {
                for p in made {
                    // SAFETY: made by us above and never handed to ORT.
                    unsafe { ComputeInfo::destroy(p) };
                }
                Err(e)
            }
        }
    })
}

unsafe extern "C" fn release_node_compute_infos(_this: *mut OrtEp, infos: *mut *mut OrtNodeComputeInfo, count: usize) {
    if infos.is_null() {
        return;
    }
    super::value_boundary("ReleaseNodeComputeInfos", (), || {
        for i in 0..count {
            // SAFETY: ORT hands back the infos our Compile made.
            let p = unsafe { *infos.add(i) };
            if !p.is_null() {
                // SAFETY: as above; ORT does not use them afterwards.
                unsafe { ComputeInfo::destroy(p) };
            }
        }
    })
}
