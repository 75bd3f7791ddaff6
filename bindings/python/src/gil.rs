//! Locks taken without holding the GIL while waiting.
//!
//! A thread that waits for a Rust lock with the GIL held deadlocks against a holder of that lock
//! who needs the GIL back (to check for Ctrl-C between steps, to build a result). So no binding
//! ever blocks on a lock with the GIL held: it tries the lock, and when the lock is taken it waits
//! for it with the GIL released, then tries again.

use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use pyo3::Python;

/// Locks `mutex`, waiting (if it must) with the GIL released. A poisoned lock comes back as
/// `Err`, with its guard, as `Mutex::lock` gives it.
pub fn lock_released<'a, T: Send>(
    py: Python<'_>,
    mutex: &'a Mutex<T>,
) -> Result<MutexGuard<'a, T>, PoisonError<MutexGuard<'a, T>>> {
    loop {
        match mutex.try_lock() {
            Ok(guard) => return Ok(guard),
            Err(TryLockError::Poisoned(poisoned)) => return Err(poisoned),
            // Wait until the holder lets go; another thread may take it first, so try again.
            Err(TryLockError::WouldBlock) => py.detach(|| drop(mutex.lock())),
        }
    }
}
