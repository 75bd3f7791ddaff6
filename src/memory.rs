//! Process memory hygiene around loading.

/// Returns heap memory freed by a large, short-lived build (such as converting a 262k-token
/// GGUF vocabulary, which allocates ~150 MB of temporaries) to the operating system.
///
/// glibc keeps freed small allocations in its arenas, so without this the resident size stays
/// at the conversion's peak for the life of the process. A no-op where glibc is not the allocator.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages to the kernel; it touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Bytes the operating system says it can still hand out (Linux's `MemAvailable`, capped by a
/// cgroup's limit where one is set); `None` where it does not say.
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    let mut available = kib.saturating_mul(1024);
    // A container's limit is lower than what the host has free.
    let cgroup = |path: &str| -> Option<u64> { std::fs::read_to_string(path).ok()?.trim().parse().ok() };
    if let (Some(limit), Some(used)) = (cgroup("/sys/fs/cgroup/memory.max"), cgroup("/sys/fs/cgroup/memory.current")) {
        available = available.min(limit.saturating_sub(used));
    }
    Some(available)
}
