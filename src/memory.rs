//! Process memory hygiene: around loading, and for the buffers steps allocate and free.

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

/// Allocations from this size on are mapped on their own and unmapped when freed.
const MMAP_THRESHOLD: usize = 1 << 20;

/// Makes freed large buffers go back to the operating system for the rest of the process (once;
/// not where `MALLOC_MMAP_THRESHOLD_` already sets the policy, nor where glibc is not the allocator).
///
/// glibc maps a large allocation on its own, but raises that threshold (up to 32 MiB) to the size
/// of every mapped block freed, so that later buffers of that size come from its arenas and stay
/// resident once freed. A step allocates and frees buffers of MiBs, and a cache layer regrows into
/// a larger one: after the first decode of a 32,768-token Gemma 3 270M prompt the process held
/// 572 MiB, 474 of them live; with a fixed threshold, 481. The cost is a page fault per 4 KiB of
/// a fresh large buffer (about 50 MB per 512-token prefill chunk: within run-to-run noise).
pub fn return_large_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
                // SAFETY: mallopt only sets the allocator's parameters; a fixed threshold also
                // turns off glibc's adjustment of it.
                unsafe {
                    libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
                }
            }
        });
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
