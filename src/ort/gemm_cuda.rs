//! The EP's GEMM on a GPU: `cublasGemmEx` with f32 accumulation, on the
//! stream ORT gives the node.
//!
//! Types and constants come from cudarc's cuBLAS bindings; the functions are
//! resolved here with `dlopen`, because cudarc 0.19.10's loader looks only
//! for `libcublas.so` and `.so.9`–`.so.12`, and the CUDA 13 runtimes that
//! onnxruntime-gpu 1.31 and torch load ship `libcublas.so.13` alone. A cuBLAS
//! the process has loaded already (ORT's CUDA EP loads one) is preferred, so
//! the EP and the CUDA EP share one library.

use std::ffi::{CStr, c_int, c_void};

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasOperation_t, cudaDataType, cudaStream_t,
};
use cudarc::driver::sys as cu;

use super::abi::*;
use crate::error::{EpmStatus, Error, Result};

type CreateFn = unsafe extern "C" fn(*mut cublasHandle_t) -> u32;
type DestroyFn = unsafe extern "C" fn(cublasHandle_t) -> u32;
type SetStreamFn = unsafe extern "C" fn(cublasHandle_t, cudaStream_t) -> u32;
#[allow(clippy::type_complexity)]
type GemmExFn = unsafe extern "C" fn(
    cublasHandle_t,
    cublasOperation_t,
    cublasOperation_t,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    cudaDataType,
    c_int,
    *const c_void,
    cudaDataType,
    c_int,
    *const c_void,
    *mut c_void,
    cudaDataType,
    c_int,
    cublasComputeType_t,
    cublasGemmAlgo_t,
) -> u32;

/// cuBLAS sonames tried, newest first.
const CANDIDATES: &[&CStr] = &[c"libcublas.so.13", c"libcublas.so.12", c"libcublas.so"];

struct Lib {
    create: CreateFn,
    destroy: DestroyFn,
    set_stream: SetStreamFn,
    gemm_ex: GemmExFn,
}

fn load() -> Result<Lib> {
    // SAFETY: dlopen/dlsym with NUL-terminated names; a handle we open is
    // never closed (the functions must stay valid for the process).
    unsafe {
        let mut h = std::ptr::null_mut();
        for flags in [libc::RTLD_NOW | libc::RTLD_NOLOAD, libc::RTLD_NOW | libc::RTLD_LOCAL] {
            for name in CANDIDATES {
                h = libc::dlopen(name.as_ptr(), flags);
                if !h.is_null() {
                    break;
                }
            }
            if !h.is_null() {
                break;
            }
        }
        crate::ensure!(
            !h.is_null(),
            DeviceUnavailable,
            "no cuBLAS library (tried libcublas.so.13, .so.12, .so): the EP's GEMM needs cuBLAS; \
             install the CUDA runtime ORT's CUDA EP uses, or put its directory on LD_LIBRARY_PATH"
        );
        let sym = |n: &CStr| -> Result<*mut c_void> {
            let p = libc::dlsym(h, n.as_ptr());
            crate::ensure!(!p.is_null(), DeviceUnavailable, "cuBLAS has no {}", n.to_string_lossy());
            Ok(p)
        };
        Ok(Lib {
            create: std::mem::transmute::<*mut c_void, CreateFn>(sym(c"cublasCreate_v2")?),
            destroy: std::mem::transmute::<*mut c_void, DestroyFn>(sym(c"cublasDestroy_v2")?),
            set_stream: std::mem::transmute::<*mut c_void, SetStreamFn>(sym(c"cublasSetStream_v2")?),
            gemm_ex: std::mem::transmute::<*mut c_void, GemmExFn>(sym(c"cublasGemmEx")?),
        })
    }
}

fn check(call: &str, status: u32) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    let name = match status {
        1 => "CUBLAS_STATUS_NOT_INITIALIZED",
        3 => "CUBLAS_STATUS_ALLOC_FAILED",
        7 => "CUBLAS_STATUS_INVALID_VALUE",
        8 => "CUBLAS_STATUS_ARCH_MISMATCH",
        11 => "CUBLAS_STATUS_MAPPING_ERROR",
        13 => "CUBLAS_STATUS_EXECUTION_FAILED",
        14 => "CUBLAS_STATUS_INTERNAL_ERROR",
        15 => "CUBLAS_STATUS_NOT_SUPPORTED",
        _ => "CUBLAS_STATUS_?",
    };
    Err(Error::new(EpmStatus::CudaError, format!("{call} failed: {name} ({status})")))
}

fn cu_check(call: &str, r: cu::CUresult) -> Result<()> {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::new(EpmStatus::CudaError, format!("{call} failed: {r:?}")))
    }
}

/// Makes the device's primary context current on this thread for a scope
/// and restores the caller's afterwards (ORT's threads may have none).
struct Current {
    restore: Option<cu::CUcontext>,
}

impl Current {
    fn enter(ctx: cu::CUcontext) -> Result<Self> {
        let mut cur: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the device layer initialized the driver
        // and probed these entry points when it opened the device.
        cu_check("cuCtxGetCurrent", unsafe { cu::cuCtxGetCurrent(&mut cur) })?;
        if cur == ctx {
            return Ok(Self { restore: None });
        }
        // SAFETY: ctx is the primary context we retained.
        cu_check("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(ctx) })?;
        Ok(Self { restore: Some(cur) })
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        if let Some(prev) = self.restore {
            // SAFETY: prev was current on this thread a moment ago.
            if let Err(e) = cu_check("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(prev) }) {
                log::warn!("epmem: restoring the caller's CUDA context: {e}");
            }
        }
    }
}

/// One cuBLAS handle on one GPU's primary context. Not for concurrent use:
/// the owner keeps it behind a lock (the stream is set per call).
pub(crate) struct Blas {
    lib: Lib,
    handle: cublasHandle_t,
    dev: cu::CUdevice,
    ctx: cu::CUcontext,
}

// SAFETY: a cuBLAS handle may be used from any thread, one at a time (the
// owner's lock); the context is the process-wide primary context.
unsafe impl Send for Blas {}

impl Blas {
    /// A handle on CUDA device `ordinal` (the device must be open already).
    pub fn open(ordinal: u32) -> Result<Self> {
        let lib = load()?;
        let mut dev: cu::CUdevice = 0;
        let mut ctx: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the device layer opened this ordinal.
        unsafe {
            cu_check("cuDeviceGet", cu::cuDeviceGet(&mut dev, ordinal as c_int))?;
            cu_check("cuDevicePrimaryCtxRetain", cu::cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
        }
        let made = (|| {
            let _c = Current::enter(ctx)?;
            let mut handle: cublasHandle_t = std::ptr::null_mut();
            // SAFETY: valid out-pointer, our context current.
            check("cublasCreate", unsafe { (lib.create)(&mut handle) })?;
            Ok(handle)
        })();
        match made {
            Ok(handle) => Ok(Self { lib, handle, dev, ctx }),
            Err(e) => {
                // SAFETY: balances the retain above.
                let _ = unsafe { cu::cuDevicePrimaryCtxRelease_v2(dev) };
                Err(e)
            }
        }
    }

    /// Row-major Y[m, n] = alpha · X[m, k] · op(W) + beta · Y, all of type
    /// `elem`, accumulated in f32, queued on `stream` (a `CUstream`).
    /// W is [k, n], or [n, k] with `trans_b`; Y's rows are `ldy` elements
    /// apart (≥ n: a part of a weight writes some columns of a wider Y).
    ///
    /// # Safety
    /// `x`, `w`, `y` are device addresses of at least m·k, k·n and
    /// (m − 1)·ldy + n elements that stay valid until the queued work completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm(
        &mut self,
        stream: u64,
        elem: ONNXTensorElementDataType,
        s: super::gemm_host::GemmShape,
        x: u64,
        w: u64,
        y: u64,
        ldy: usize,
    ) -> Result<()> {
        let dt = match elem {
            TENSOR_ELEMENT_FLOAT => cudaDataType::CUDA_R_32F,
            TENSOR_ELEMENT_FLOAT16 => cudaDataType::CUDA_R_16F,
            TENSOR_ELEMENT_BFLOAT16 => cudaDataType::CUDA_R_16BF,
            e => crate::bail!(Unsupported, "no GEMM for element type {e}"),
        };
        let dim = |v: usize, what: &str| -> Result<c_int> {
            c_int::try_from(v)
                .map_err(|_| Error::invalid_argument(format!("GEMM {what}={v} exceeds cuBLAS's int range")))
        };
        let (m, k, n) = (dim(s.m, "m")?, dim(s.k, "k")?, dim(s.n, "n")?);
        crate::ensure!(ldy >= s.n, InvalidArgument, "GEMM ldy={ldy} < n={}", s.n);
        let ldc = dim(ldy, "ldy")?;
        // Row-major Y = X · op(W) is column-major Yᵀ = op(W)ᵀ · Xᵀ: cuBLAS's
        // "A" is W (n×k after its op), its "B" is X (k×m, ld k), C is Y (ld n).
        let (op_w, ld_w) =
            if s.trans_b { (cublasOperation_t::CUBLAS_OP_T, k) } else { (cublasOperation_t::CUBLAS_OP_N, n) };
        let _c = Current::enter(self.ctx)?;
        // SAFETY: the handle is ours; the stream is ORT's live CUstream (or
        // ours); pointers per the caller; alpha/beta are f32 as
        // CUBLAS_COMPUTE_32F requires.
        unsafe {
            check("cublasSetStream", (self.lib.set_stream)(self.handle, stream as cudaStream_t))?;
            check(
                "cublasGemmEx",
                (self.lib.gemm_ex)(
                    self.handle,
                    op_w,
                    cublasOperation_t::CUBLAS_OP_N,
                    n,
                    m,
                    k,
                    &s.alpha as *const f32 as *const c_void,
                    w as *const c_void,
                    dt,
                    ld_w,
                    x as *const c_void,
                    dt,
                    k,
                    &s.beta as *const f32 as *const c_void,
                    y as *mut c_void,
                    dt,
                    ldc,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                ),
            )
        }
    }
}

impl Blas {
    /// Wait for all work in the device's primary context (ORT's CUDA EP
    /// streams included): the ordering of last resort when ORT gives a node
    /// no stream.
    pub fn synchronize_context(&self) -> Result<()> {
        let _c = Current::enter(self.ctx)?;
        // SAFETY: our context is current.
        cu_check("cuCtxSynchronize", unsafe { cu::cuCtxSynchronize() })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: our handle and our retain; cublasDestroy synchronizes the
        // handle's work.
        unsafe {
            if let Ok(_c) = Current::enter(self.ctx) {
                let _ = check("cublasDestroy", (self.lib.destroy)(self.handle)).map_err(|e| log::warn!("epmem: {e}"));
            }
            let _ = cu::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}
