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
