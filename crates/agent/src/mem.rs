//! Keeping the agent's resident memory down between jobs (glibc only; elsewhere no-ops).
//!
//! The store's pipeline allocates chunk buffers on many threads; glibc then keeps a malloc
//! arena per thread and holds on to freed memory. `limit_arenas` (at start) caps the arenas,
//! `trim` (after each checkpoint or restore preparation) returns free memory to the kernel, so
//! an idle agent is back near its idle size.

/// Caps glibc's malloc arenas (`M_ARENA_MAX`).
#[allow(unsafe_code)]
pub fn limit_arenas(n: i32) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; called before the worker threads start.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, n);
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = n;
}

/// Drops the store's recycled chunk buffers and returns free heap memory to the kernel
/// (`malloc_trim(0)`).
#[allow(unsafe_code)]
pub fn trim() {
    stasis_store::chunk::release_buffer_pool();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory; it is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
