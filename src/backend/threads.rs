//! How many CPU threads compute: candle's worker pool (candle's ops and our kernels), rayon's
//! global pool (load-time work, the dense GEMM) and the GEMM's split count all follow one number.
//!
//! Those pools are process-wide and sized once, at first use, from `CANDLE_NUM_THREADS` /
//! `RAYON_NUM_THREADS`. So the first load fixes the count for the process (its `threads=`, or
//! those variables, or candle's default: the physical cores); a later load asking for another
//! count is refused rather than silently ignored.

use std::sync::Mutex;

use crate::backend::error::{CandleError, Result};

/// Above this a request is a mistake, not a machine: each thread reserves a stack.
pub const MAX_THREADS: usize = 1024;

/// The count fixed by the first configuration, if any.
static FIXED: Mutex<Option<usize>> = Mutex::new(None);

/// Fixes the compute threads at `requested` (first call) or checks it against the fixed count,
/// and returns the count in force.
pub fn configure(requested: Option<usize>) -> Result<usize> {
    if let Some(n) = requested {
        if n == 0 || n > MAX_THREADS {
            return Err(CandleError::InvalidOption {
                argument: "threads",
                value: n.to_string(),
                accepted: format!("1 to {MAX_THREADS}"),
            });
        }
    }
    let mut fixed = FIXED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(current) = *fixed {
        return match requested {
            Some(n) if n != current => Err(CandleError::InvalidOption {
                argument: "threads",
                value: n.to_string(),
                accepted: format!(
                    "only {current}: this process already computes with {current} threads, fixed by the first \
                     model loaded (candle's thread pool cannot be resized)"
                ),
            }),
            _ => Ok(current),
        };
    }
    if let Some(n) = requested {
        // Read by candle's pool and rayon's at their first use, and by the GEMM at every call.
        std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        // Fails only when something built rayon's pool already; candle's count still applies.
        let _ = rayon::ThreadPoolBuilder::new().num_threads(n).build_global();
    }
    let current = candle_core::utils::barrier_pool().n_workers() + 1;
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // candle's GEMM asks for the count at every call and, with neither variable set,
        // counts the physical cores by parsing /proc/cpuinfo each time: 5% of a batched decode
        // step in the server went to the kernel formatting that file.
        std::env::set_var("RAYON_NUM_THREADS", current.to_string());
    }
    *fixed = Some(current);
    Ok(current)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_counts_are_refused_before_anything_is_fixed() {
        assert!(configure(Some(0)).is_err());
        assert!(configure(Some(MAX_THREADS + 1)).is_err());
        let n = configure(None).unwrap();
        assert!(n >= 1);
        assert_eq!(configure(Some(n)).unwrap(), n);
        assert!(configure(Some(n + 1)).is_err(), "a second count is refused, not ignored");
    }
}
