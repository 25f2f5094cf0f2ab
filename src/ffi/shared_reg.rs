//! One host copy of the weights, page-locked once, feeding the residency
//! managers of several devices (tensor- or pipeline-parallel stacks whose
//! GPUs each stream their own shard or layers from the same host bytes).
//!
//! ```c
//! epm_shared_host_registration_create(dev0, host, bytes, &reg);  // page-locks once
//! epm_residency_attach_host_registration(res0, reg, &r0);        // cuda:0's manager
//! epm_residency_attach_host_registration(res1, reg, &r1);        // cuda:1's manager
//! epm_shared_host_registration_destroy(reg);  // the managers keep it alive
//! ```

use crate::device::HostRange;
use crate::ffi::device::EpmDevice;
use crate::ffi::prelude::*;
use crate::ffi::residency::{EpmHostRangeId, EpmResidency};
use crate::transfer::pinning::SharedHostRegistration;

/// A host range page-locked once for every device of one kind (CUDA:
/// `cuMemHostRegister` with PORTABLE | READ_ONLY). Refcounted: this handle
/// and each manager that attached it keep it registered.
pub struct EpmSharedHostRegistration {
    _opaque: [u8; 0],
}
impl_handle!(EpmSharedHostRegistration => SharedHostRegistration, tag = 0x22);

/// Page-lock `[host, host+bytes)` once, through `dev`, read-only and visible
/// as page-locked to every device of `dev`'s kind in the process, so the
/// residency managers of several devices can copy from the same bytes with
/// no second registration and no staging copy.
///
/// Ownership: `*out` is a new handle; destroy it with
/// `epm_shared_host_registration_destroy`. The bytes are unregistered when
/// that handle and every attachment (`epm_residency_attach_host_registration`)
/// are gone; the range must stay allocated and unmodified until then.
/// NULL: `dev` is INVALID_HANDLE, `host`/`out` NULL_POINTER. Errors:
/// INVALID_ARGUMENT for 0 bytes or a range that wraps; INVALID_STATE when any
/// of the bytes are already page-locked (by this or another device); the
/// device's error when it refuses (locked-memory limit). Threading: safe from
/// any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_shared_host_registration_create(
    dev: *mut EpmDevice,
    host: *const c_void,
    bytes: usize,
    out: *mut *mut EpmSharedHostRegistration,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let (p, n) = try_host_range!(host, bytes);
        let out = try_out!(out);
        // SAFETY: non-NULL, non-overflowing; the C caller keeps the range
        // allocated until the last holder of the registration is gone.
        let range = unsafe { HostRange::new(p, n) };
        out.set(handle::insert::<EpmSharedHostRegistration>(Arc::new(SharedHostRegistration::new(&dev, range)?))?);
        Ok(())
    }
}

/// Drop the caller's reference to a shared registration. Managers that
/// attached it keep the bytes registered until they detach
/// (`epm_residency_unregister_host_range`) or are destroyed; the last holder
/// waits for the registering device and unregisters.
///
/// NULL is a no-op returning OK. Errors: INVALID_HANDLE for a destroyed,
/// wrong-typed or garbage handle. Threading: the handle must not be used after.
#[unsafe(no_mangle)]
pub extern "C" fn epm_shared_host_registration_destroy(reg: *mut EpmSharedHostRegistration) -> EpmStatus {
    ffi_boundary! { handle::destroy(reg) }
}

/// Let `res` copy directly from a shared registration: every weight of `res`
/// inside the range is paged in straight from the shared host bytes, and
/// `res` registers nothing itself (its `source_registrations` and
/// `registered_bytes` stay put; `attached_bytes` grows by the range).
///
/// Ownership: `*out_range` names the attachment inside `res`; detach with
/// `epm_residency_unregister_host_range(res, *out_range)` (it waits for
/// `res`'s device first) or by destroying `res`. The attachment keeps the
/// registration alive even after `epm_shared_host_registration_destroy`.
/// NULL: `res`/`reg` INVALID_HANDLE, `out_range` NULL_POINTER. Errors:
/// INVALID_ARGUMENT when `reg` was made through a device of another kind
/// (host vs CUDA). Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_attach_host_registration(
    res: *mut EpmResidency,
    reg: *mut EpmSharedHostRegistration,
    out_range: *mut EpmHostRangeId,
) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        let reg = try_handle!(reg);
        let out = try_out!(out_range);
        out.set(res.attach_host_registration(&reg)?.0);
        Ok(())
    }
}
