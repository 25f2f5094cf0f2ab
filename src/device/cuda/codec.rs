//! The decode kernel of compressed weights ([`Device::decode_async`]): CUDA C
//! in codec.cu, compiled by scripts/build-ptx.sh to the committed codec.ptx,
//! JIT-compiled by the driver the first time a decode runs.
//!
//! [`Device::decode_async`]: crate::device::Device::decode_async

use std::ffi::{CStr, c_void};

use cudarc::driver::sys;

use super::driver::Handle;
use super::kernels::load_module;
use super::{CudaDevice, lock};
use crate::codec::{BLOCK_VALUES, DecodePiece, Dtype};
use crate::device::{DevicePtr, RawStream, check_piece};
use crate::error::Result;

/// NUL-terminated: cuModuleLoadData reads PTX as a C string.
pub(super) const PTX: &str = concat!(include_str!("codec.ptx"), "\0");
const DECODE: &CStr = c"epm_codec_decode";
/// Threads per block: codec.cu's EPM_THREADS (two 16-value slices each, one
/// 4096-value block).
const THREADS: u32 = 128;
/// 16-value slices per thread: codec.cu's EPM_SLICES.
#[cfg(test)]
const SLICES: usize = 2;

#[derive(Debug, Clone, Copy)]
pub(super) struct CodecKernel {
    pub(super) module: Handle<sys::CUmodule>,
    decode: Handle<sys::CUfunction>,
}

/// `EpmDecodeParams` of codec.cu, field for field (136 bytes, 8-aligned).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DecodeParams {
    pub dst: u64,
    pub offsets: u64,
    pub codes: u64,
    pub lows: u64,
    pub escapes: u64,
    pub n_values: u64,
    pub n_escapes: u64,
    pub dtype: u32,
    pub k: u32,
    pub code_bits: u32,
    pub blocks: u32,
    pub table: [u8; 16],
    /// Format v2 (0s in v1): the level-3 index, the level-3 bytes (moved
    /// back like `escapes`), the bound on level-3 reads, the escape code
    /// width (0 = v1: `escapes` is a byte stream) and the escape table.
    pub offsets3: u64,
    pub escapes3: u64,
    pub n_escapes3: u64,
    pub k2: u32,
    pub reserved: u32,
    pub table2: [u8; 16],
}

impl DecodeParams {
    /// The kernel's parameters for `piece`, staged at `src`, decoding into
    /// `dst` (the piece's output). The kernel indexes blocks from 0, so a
    /// piece of blocks `[a, b)` is the weight of those blocks alone: stream
    /// pointers at the staged parts, `b − a` blocks, its values; its escape
    /// offsets stay absolute, so the escape pointer is moved back by the
    /// piece's first staged escape byte (wrapping arithmetic: only bytes at
    /// or past the staged part are ever read; v1 reads escape `i` at
    /// `escapes + i`, v2 its code at bit `i·k2`), and `n_escapes`, which
    /// bounds every escape read, is the piece's last. Level-3 likewise.
    /// For [`crate::codec::DecodeDesc::whole`] these are the buffer's own streams.
    pub(crate) fn new(src: DevicePtr, dst: DevicePtr, piece: &DecodePiece) -> Self {
        let desc = piece.desc();
        let [offsets, codes, lows, escapes, offsets3, escapes3] = piece.staged_offsets().map(|o| src + o as u64);
        let v2 = desc.k2() > 0;
        Self {
            dst,
            offsets,
            codes,
            lows,
            escapes: escapes.wrapping_sub(piece.escape_base() as u64),
            n_values: piece.values() as u64,
            n_escapes: piece.escape_end() as u64,
            dtype: if desc.dtype() == Dtype::Fp16 { 2 } else { 1 },
            k: desc.k(),
            code_bits: desc.code_bits(),
            blocks: piece.blocks() as u32,
            table: desc.table(),
            offsets3: if v2 { offsets3 } else { 0 },
            escapes3: if v2 { escapes3.wrapping_sub(piece.escape3_base() as u64) } else { 0 },
            n_escapes3: piece.escape3_end() as u64,
            k2: desc.k2(),
            reserved: 0,
            table2: desc.table2(),
        }
    }
}

impl CudaDevice {
    /// The codec module, loaded on first use (our context must be current).
    fn codec_kernel(&self) -> Result<CodecKernel> {
        let mut slot = lock(&self.codec);
        if let Some(k) = *slot {
            return Ok(k);
        }
        let module = load_module(PTX, "epmem's codec PTX")?;
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: valid out-pointer, a loaded module, a NUL-terminated name.
        if let Err(e) = unsafe { cu!(cuModuleGetFunction(&mut f, module, DECODE.as_ptr())) } {
            // SAFETY: the module loaded above; nothing else holds it.
            if let Err(u) = unsafe { cu!(cuModuleUnload(module)) } {
                log::warn!("epmem: unloading the codec PTX module: {u}");
            }
            return Err(e);
        }
        let k = CodecKernel { module: Handle(module), decode: Handle(f) };
        *slot = Some(k);
        Ok(k)
    }

    pub(super) fn cu_decode(&self, src: DevicePtr, dst: DevicePtr, piece: &DecodePiece, s: RawStream) -> Result<()> {
        check_piece(src, dst, piece)?;
        let stream = self.stream(s)?;
        let _g = self.enter()?;
        self.check_device_range("decode source", src, piece.staged_len(), false)?;
        self.check_device_range("decode destination", dst, piece.raw_len(), true)?;
        let k = self.codec_kernel()?;
        let mut params = DecodeParams::new(src, dst, piece);
        let mut args: [*mut c_void; 1] = [(&raw mut params).cast()];
        debug_assert_eq!(piece.blocks(), piece.values().div_ceil(BLOCK_VALUES));
        // SAFETY: one by-value parameter matching epm_codec_decode(EpmDecodeParams)
        // (layout pinned by a test against the PTX), read by the driver during
        // the call; both ranges were checked above and the kernel bounds every
        // read by the lengths in `params`, which the piece's validated buffer gave.
        unsafe {
            cu!(cuLaunchKernel(
                k.decode.0,
                piece.blocks() as u32,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream.0,
                args.as_mut_ptr(),
                std::ptr::null_mut()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_has_the_entry_with_one_parameter_block_of_the_params_size() {
        assert!(PTX.ends_with('\0') && !PTX[..PTX.len() - 1].contains('\0'));
        assert!(PTX.contains(".address_size 64"));
        let entry = format!(".visible .entry {}(", DECODE.to_str().unwrap());
        let start = PTX.find(&entry).expect("the decode entry point");
        let params: Vec<&str> = PTX[start..start + PTX[start..].find(')').unwrap()]
            .lines()
            .filter(|l| l.contains(".param"))
            .map(|l| l.trim().trim_end_matches(','))
            .collect();
        let want = format!(".param .align 8 .b8 epm_codec_decode_param_0[{}]", std::mem::size_of::<DecodeParams>());
        assert_eq!(params, [want.as_str()]);
        assert_eq!(std::mem::align_of::<DecodeParams>(), 8);
        assert_eq!(std::mem::offset_of!(DecodeParams, dtype), 56);
        assert_eq!(std::mem::offset_of!(DecodeParams, table), 72);
        assert_eq!(std::mem::offset_of!(DecodeParams, offsets3), 88);
        assert_eq!(std::mem::offset_of!(DecodeParams, k2), 112);
        assert_eq!(std::mem::offset_of!(DecodeParams, table2), 120);
        assert_eq!(std::mem::size_of::<DecodeParams>(), 136);
        // The threads' slices cover exactly one codec block.
        assert_eq!(THREADS as usize * SLICES * 16, BLOCK_VALUES);
    }

    #[test]
    fn ptx_is_what_codec_cu_says_it_is() {
        // The .cu and the PTX name the same constants; a .cu edited without
        // rebuilding the PTX is caught on the GPU by scripts/build-ptx.sh --check.
        let cu = include_str!("codec.cu");
        assert!(cu.contains("#define EPM_BLOCK_VALUES 4096"));
        assert!(cu.contains(&format!("#define EPM_SLICES {SLICES}\n")));
        assert!(cu.contains("#define EPM_THREADS (256 / EPM_SLICES)"));
        assert!(PTX.contains(&format!(".maxntid {THREADS}, 1, 1")));
    }
}
