//! The two built-in kernels ([`Device::checksum_async`], [`Device::spin_async`]),
//! embedded as PTX and JIT-compiled by the driver the first time one is used.
//!
//! [`Device::checksum_async`]: crate::device::Device::checksum_async
//! [`Device::spin_async`]: crate::device::Device::spin_async

use std::ffi::{CStr, c_uint, c_void};

use cudarc::driver::sys;

use super::driver::Handle;
use super::{CudaDevice, lock};
use crate::device::{DevicePtr, RawStream};
use crate::error::Result;

/// NUL-terminated: cuModuleLoadData reads PTX as a C string.
pub(super) const PTX: &str = concat!(include_str!("kernels.ptx"), "\0");
const CHECKSUM: &CStr = c"epm_checksum";
const SPIN: &CStr = c"epm_spin";
/// A multiple of 32: the checksum's warp reduction shuffles over full warps.
const CHECKSUM_BLOCK: u32 = 256;
/// Blocks per multiprocessor for the grid-stride checksum: enough to hide
/// memory latency, few enough that atomics on `out` stay negligible.
const CHECKSUM_BLOCKS_PER_SM: u32 = 8;
const JIT_LOG_BYTES: usize = 8192;

#[derive(Debug, Clone, Copy)]
pub(super) struct Kernels {
    pub(super) module: Handle<sys::CUmodule>,
    checksum: Handle<sys::CUfunction>,
    spin: Handle<sys::CUfunction>,
}

/// Grid size for `words` u32 words.
pub(super) fn checksum_grid(words: u64, sm_count: u32) -> u32 {
    let needed = words.div_ceil(CHECKSUM_BLOCK as u64).max(1);
    needed.min((sm_count.max(1) * CHECKSUM_BLOCKS_PER_SM) as u64) as u32
}

/// Load a PTX module into the current context (the driver JIT-compiles it
/// for this GPU); a failure carries the JIT's error log. `ptx` is
/// NUL-terminated.
pub(super) fn load_module(ptx: &str, what: &str) -> Result<sys::CUmodule> {
    crate::ensure!(ptx.ends_with('\0'), Internal, "{what} is not NUL-terminated");
    let mut module: sys::CUmodule = std::ptr::null_mut();
    let mut log = vec![0u8; JIT_LOG_BYTES];
    let mut opts = [sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER, sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
    // The size option's value is the integer itself, cast to a pointer.
    let mut vals: [*mut c_void; 2] = [log.as_mut_ptr().cast(), JIT_LOG_BYTES as *mut c_void];
    // SAFETY: `ptx` is NUL-terminated (checked); the option arrays have two
    // entries each and the log buffer holds JIT_LOG_BYTES bytes while the call runs.
    let r = unsafe {
        cu!(cuModuleLoadDataEx(
            &mut module,
            ptx.as_ptr().cast(),
            opts.len() as c_uint,
            opts.as_mut_ptr(),
            vals.as_mut_ptr()
        ))
    };
    if let Err(e) = r {
        let text = String::from_utf8_lossy(&log[..log.iter().position(|&b| b == 0).unwrap_or(0)]).into_owned();
        return Err(e.context(format!("loading {what} (JIT log: {:?})", text.trim())));
    }
    Ok(module)
}

impl CudaDevice {
    /// The loaded module, loading it on first use (our context must be current).
    pub(super) fn kernels(&self) -> Result<Kernels> {
        let mut slot = lock(&self.kernels);
        if let Some(k) = *slot {
            return Ok(k);
        }
        let module = load_module(PTX, "epmem's built-in PTX")?;
        let function = |name: &CStr| -> Result<Handle<sys::CUfunction>> {
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: valid out-pointer, a loaded module, a NUL-terminated name.
            unsafe { cu!(cuModuleGetFunction(&mut f, module, name.as_ptr())) }?;
            Ok(Handle(f))
        };
        let k = match (function(CHECKSUM), function(SPIN)) {
            (Ok(checksum), Ok(spin)) => Kernels { module: Handle(module), checksum, spin },
            (Err(e), _) | (_, Err(e)) => {
                // SAFETY: the module loaded above; nothing else holds it.
                if let Err(u) = unsafe { cu!(cuModuleUnload(module)) } {
                    log::warn!("epmem: unloading the built-in PTX module: {u}");
                }
                return Err(e);
            }
        };
        *slot = Some(k);
        Ok(k)
    }

    pub(super) fn cu_checksum(&self, p: DevicePtr, n: usize, out: DevicePtr, s: RawStream) -> Result<()> {
        crate::ensure!(n.is_multiple_of(4), InvalidArgument, "checksum length {n} is not a multiple of 4");
        crate::ensure!(p.is_multiple_of(4), InvalidArgument, "checksum input {p:#x} is not 4-byte aligned");
        crate::ensure!(out.is_multiple_of(8), InvalidArgument, "checksum output {out:#x} is not 8-byte aligned");
        let stream = self.stream(s)?;
        let _g = self.enter()?;
        self.check_device_range("checksum output", out, 8, true)?;
        self.check_device_range("checksum input", p, n, false)?;
        // SAFETY: `out` is 8 writable device bytes (checked above).
        unsafe { cu!(cuMemsetD8Async(out, 0, 8, stream.0)) }?;
        if n == 0 {
            return Ok(());
        }
        let k = self.kernels()?;
        let (mut ptr, mut words, mut dst) = (p, (n / 4) as u64, out);
        let mut params: [*mut c_void; 3] = [(&raw mut ptr).cast(), (&raw mut words).cast(), (&raw mut dst).cast()];
        let grid = checksum_grid(words, self.sm_count);
        // SAFETY: three parameters matching epm_checksum(.u64, .u64, .u64),
        // read by the driver during the call; ranges and alignment checked above.
        unsafe {
            cu!(cuLaunchKernel(
                k.checksum.0,
                grid,
                1,
                1,
                CHECKSUM_BLOCK,
                1,
                1,
                0,
                stream.0,
                params.as_mut_ptr(),
                std::ptr::null_mut()
            ))
        }
    }

    pub(super) fn cu_spin(&self, micros: u32, s: RawStream) -> Result<()> {
        let stream = self.stream(s)?;
        let _g = self.enter()?;
        let k = self.kernels()?;
        let mut nanos = micros as u64 * 1000;
        let mut params: [*mut c_void; 1] = [(&raw mut nanos).cast()];
        // SAFETY: one parameter matching epm_spin(.u64), read during the call.
        unsafe {
            cu!(cuLaunchKernel(k.spin.0, 1, 1, 1, 1, 1, 1, 0, stream.0, params.as_mut_ptr(), std::ptr::null_mut()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_is_a_c_string_with_both_entries() {
        assert!(PTX.ends_with('\0') && !PTX[..PTX.len() - 1].contains('\0'));
        assert!(PTX.contains(".version 7.0") && PTX.contains(".target sm_70") && PTX.contains(".address_size 64"));
        for name in [CHECKSUM, SPIN] {
            let entry = format!(".visible .entry {}(", name.to_str().unwrap());
            assert!(PTX.contains(&entry), "missing {entry}");
        }
    }

    #[test]
    fn ptx_parameters_match_the_launches() {
        // Three u64 parameters for checksum, one for spin, in this order.
        let params = |entry: &str| -> Vec<String> {
            let start = PTX.find(&format!(".entry {entry}(")).unwrap();
            let body = &PTX[start..start + PTX[start..].find(')').unwrap()];
            body.lines().filter(|l| l.contains(".param")).map(|l| l.trim().trim_end_matches(',').to_string()).collect()
        };
        assert_eq!(
            params("epm_checksum"),
            [".param .u64 epm_checksum_p", ".param .u64 epm_checksum_words", ".param .u64 epm_checksum_out"]
        );
        assert_eq!(params("epm_spin"), [".param .u64 epm_spin_nanos"]);
        assert_eq!(CHECKSUM_BLOCK % 32, 0);
    }

    #[test]
    fn checksum_grid_is_bounded_and_never_empty() {
        assert_eq!(checksum_grid(0, 132), 1);
        assert_eq!(checksum_grid(1, 132), 1);
        assert_eq!(checksum_grid(256 * 3 + 1, 132), 4);
        assert_eq!(checksum_grid(1 << 30, 132), 132 * 8);
        assert_eq!(checksum_grid(1 << 30, 0), 8);
    }
}
