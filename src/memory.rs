//! Process memory hygiene: after loading, and after the steps that free large buffers.

/// Returns heap memory freed by a large, short-lived build (such as converting a 262k-token
/// GGUF vocabulary, which allocates ~150 MB of temporaries) or a long step to the operating system.
///
/// glibc keeps freed small allocations in its arenas, so without this the resident size stays
/// at the conversion's peak for the life of the process. It also raises its mmap threshold (up
/// to 32 MiB) to the size of every mapped block freed, so that buffers of a few MiB (a prompt
/// chunk's, a regrown cache layer's) come from its arenas and stay resident once freed: after a
/// 32,768-token Gemma 3 270M prompt and one decode step the process held 572 MiB, 474 of them
/// live. A fixed low threshold returned them at once but cost long prompts 13–20% of their
/// prefill speed (a page fault per 4 KiB of every fresh buffer); a trim after the few calls that
/// leave such memory behind costs a few milliseconds. A no-op where glibc is not the allocator.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages to the kernel; it touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Bytes the operating system says it can still hand out (Linux's `MemAvailable`, capped by a
/// cgroup's limit and an address-space limit where one is set); `None` where it does not say.
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
    // A process whose address space is capped (`ulimit -v`, RLIMIT_AS) fails an allocation past
    // the cap, however much memory the machine has: what is left under it counts too.
    if let Some(left) = address_space_left() {
        available = available.min(left);
    }
    Some(available)
}

/// Bytes of address space left under RLIMIT_AS, when one is set.
#[cfg(not(unix))]
fn address_space_left() -> Option<u64> {
    None
}

/// Bytes of address space left under RLIMIT_AS, when one is set.
#[cfg(unix)]
fn address_space_left() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    // The first field of statm is the process's virtual size in pages.
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().next()?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    // rlim_t is u64 on Linux, not on every Unix.
    #[allow(clippy::unnecessary_cast)]
    let cap = limit.rlim_cur as u64;
    Some(cap.saturating_sub(pages.saturating_mul(page)))
}
