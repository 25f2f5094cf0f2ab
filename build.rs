//! The shared library's SONAME: `libepmem.so.<major>`, major from Cargo.toml.
//!
//! Within a major the C ABI only grows (docs/ABI.md: structs grow only at the
//! end, the smallest accepted size is frozen; functions are added, never
//! changed), so every 0.x release is a compatible successor of the one before
//! and the SONAME is
//! `libepmem.so.0` for all of 0.x, and a release that breaks the C ABI raises
//! the major (to 1, even before the API is called stable). A program linked
//! against any 0.x records `NEEDED libepmem.so.0`; `make install` installs
//! `libepmem.so.<major>.<minor>.<patch>` with the SONAME link and the
//! development link `libepmem.so` (see the Makefile).
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").expect("cargo sets CARGO_PKG_VERSION_MAJOR");
    let soname = format!("libepmem.so.{major}");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    // The testing variant (--features testing, for the C tests only) is
    // shipped as libepmem_testing.so (see the Makefile): its SONAME names that
    // file, so a test binary never asks the loader for the product's SONAME
    // and cannot pick up an installed libepmem.so.0 instead.
    if std::env::var_os("CARGO_FEATURE_TESTING").is_some() {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libepmem_testing.so");
        return;
    }
    // Only the cdylib gets it: the staticlib, the rlib and the binaries are unaffected.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");

    // A program linked with `-L target/<profile> -lepmem` (the C tests, the
    // examples in scripts/long-run.sh, the GPU probes) records the SONAME, so
    // the loader looks for libepmem.so.<major> next to libepmem.so: give the
    // build tree that link, as an install does. OUT_DIR is
    // <target>/<profile>/build/epmem-<hash>/out, so the profile directory is
    // three levels up; the link dangles until the library is linked.
    let Ok(out) = std::env::var("OUT_DIR") else { return };
    let Some(profile_dir) = Path::new(&out).ancestors().nth(3) else {
        return;
    };
    let link = profile_dir.join(&soname);
    if std::fs::symlink_metadata(&link).is_err()
        && let Err(e) = std::os::unix::fs::symlink("libepmem.so", &link)
    {
        println!("cargo:warning=could not create {}: {e}", link.display());
    }
}
