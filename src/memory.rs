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

/// Asks the kernel to back a large, fresh, untouched buffer with transparent huge pages where
/// it allows them on request (`madvise` mode): a 2 MiB page is one fault instead of 512.
pub fn prefer_huge_pages(buf: &mut [u8]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (buf.as_mut_ptr() as usize).next_multiple_of(HUGE);
        let end = (buf.as_mut_ptr() as usize + buf.len()) / HUGE * HUGE;
        if end > start {
            // SAFETY: the range lies inside `buf`; MADV_HUGEPAGE changes how its pages are
            // backed, never their contents.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
}
