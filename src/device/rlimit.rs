//! Process resource limits the core plans around.

/// The soft RLIMIT_MEMLOCK in bytes, `None` when unlimited or unreadable:
/// page-locking host ranges past it fails, so residency registers sources
/// only while they fit (see residency::page_in).
pub fn memlock_limit() -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `r` is a valid, writable rlimit; getrlimit writes only it.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return None;
    }
    (r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur as u64)
}

#[cfg(test)]
mod tests {
    /// The kernel's own account of the limit, as /proc/self/limits prints it.
    fn proc_limits_soft_memlock() -> Option<u64> {
        let text = std::fs::read_to_string("/proc/self/limits").unwrap();
        let line = text.lines().find(|l| l.starts_with("Max locked memory")).unwrap();
        let soft = line.trim_start_matches("Max locked memory").split_whitespace().next().unwrap();
        if soft == "unlimited" { None } else { Some(soft.parse().unwrap()) }
    }

    #[test]
    fn memlock_limit_matches_proc_limits() {
        assert_eq!(super::memlock_limit(), proc_limits_soft_memlock());
    }
}
