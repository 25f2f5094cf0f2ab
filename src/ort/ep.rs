//! `OrtEp`: the per-session execution provider. epmem is a memory provider,
//! so it claims no nodes; the session's kernels run on the CPU EP while
//! tensors may live in epmem memory (ORT inserts copies through our data
//! transfer where a kernel needs them elsewhere).

use std::ffi::c_char;
use std::sync::Arc;

use super::abi::*;
use super::factory::Factory;
use super::status_boundary;

#[repr(C)]
pub(crate) struct Ep {
    base: OrtEp,
    factory: Arc<Factory>,
}

impl Ep {
    pub fn create(factory: Arc<Factory>) -> *mut OrtEp {
        let ep = Box::new(Ep {
            base: OrtEp {
                ort_version_supported: ORT_VERSION_SUPPORTED,
                GetName: Some(get_name),
                // Must be set: ORT calls it unconditionally (NULL crashes ORT).
                GetCapability: Some(get_capability),
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
        });
        Box::into_raw(ep) as *mut OrtEp
    }

    /// # Safety
    /// `p` came from [`Ep::create`] and is not used afterwards.
    pub unsafe fn destroy(p: *mut OrtEp) {
        // SAFETY: per the caller.
        drop(unsafe { Box::from_raw(p as *mut Ep) });
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

unsafe extern "C" fn get_capability(
    this: *mut OrtEp,
    _graph: *const OrtGraph,
    _info: *mut OrtEpGraphSupportInfo,
) -> *mut OrtStatus {
    // SAFETY: as above.
    let ep = unsafe { me(this) };
    // Claim nothing: adding no nodes to `info` leaves every node to the CPU EP.
    status_boundary(&ep.factory.api, "GetCapability", || Ok(()))
}

unsafe extern "C" fn compile(
    this: *mut OrtEp,
    _graphs: *const *const OrtGraph,
    _fused: *const *const OrtNode,
    count: usize,
    _infos: *mut *mut OrtNodeComputeInfo,
    _ctx_nodes: *mut *mut OrtNode,
) -> *mut OrtStatus {
    // SAFETY: as above.
    let ep = unsafe { me(this) };
    status_boundary(&ep.factory.api, "Compile", || {
        crate::bail!(
            Unsupported,
            "asked to compile {count} graphs, but the epmem EP claims no nodes"
        )
    })
}

unsafe extern "C" fn release_node_compute_infos(
    _this: *mut OrtEp,
    _infos: *mut *mut OrtNodeComputeInfo,
    _count: usize,
) {
    // Compile never succeeds, so there is never anything to release.
}
