//! CPU kernels candle lacks, plugged in as custom ops.

pub mod q8_0;
