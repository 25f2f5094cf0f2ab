//! The library version, as numbers and as a string.
//!
//! The constants become `#define`s in the header; a test checks them against
//! Cargo.toml, so bumping the crate version without them fails `cargo test`.

use std::ffi::c_char;

use crate::ffi::panic::ffi_boundary;

/// Major version: incompatible ABI changes.
pub const EPM_VERSION_MAJOR: u32 = 0;
/// Minor version: backwards-compatible additions.
pub const EPM_VERSION_MINOR: u32 = 1;
/// Patch version: fixes.
pub const EPM_VERSION_PATCH: u32 = 0;
/// The version the header describes, encoded like `epm_version()`.
pub const EPM_VERSION: u32 = (EPM_VERSION_MAJOR << 16) | (EPM_VERSION_MINOR << 8) | EPM_VERSION_PATCH;

const VERSION_STRING: &std::ffi::CStr =
    match std::ffi::CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(s) => s,
        Err(_) => panic!("the crate version contains a NUL byte"),
    };

/// The version of the loaded library: `(major << 16) | (minor << 8) | patch`.
///
/// Compare with `EPM_VERSION` (the header's) to detect a header/library
/// mismatch. Never fails; thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn epm_version() -> u32 {
    ffi_boundary! { -> u32 { EPM_VERSION } }
}

/// The version of the loaded library as a static string, e.g. "0.1.0".
/// Never NULL, never freed; thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn epm_version_string() -> *const c_char {
    ffi_boundary! { -> *const c_char { VERSION_STRING.as_ptr() } }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_cargo_toml() {
        assert_eq!(EPM_VERSION_MAJOR.to_string(), env!("CARGO_PKG_VERSION_MAJOR"));
        assert_eq!(EPM_VERSION_MINOR.to_string(), env!("CARGO_PKG_VERSION_MINOR"));
        assert_eq!(EPM_VERSION_PATCH.to_string(), env!("CARGO_PKG_VERSION_PATCH"));
        let v = epm_version();
        assert_eq!((v >> 16, (v >> 8) & 0xff, v & 0xff), (EPM_VERSION_MAJOR, EPM_VERSION_MINOR, EPM_VERSION_PATCH));
        // SAFETY: static NUL-terminated string.
        let s = unsafe { std::ffi::CStr::from_ptr(epm_version_string()) };
        assert_eq!(s.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }
}
