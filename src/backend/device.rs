//! Device strings (`cpu`, `cuda[:N]`, `metal[:N]`, `auto`) to candle devices.

use candle_core::Device;

use crate::backend::error::{CandleError, Result};
use crate::core::{DeviceCapabilities, DeviceDescriptor};

/// Whether this build can drive CUDA GPUs (feature `cuda`).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Whether this build can drive Metal GPUs: feature `metal`, or any macOS build (Cargo.toml turns
/// candle's `metal` on there through a target-specific dependency, which sets no feature of ours).
pub const METAL_BUILT: bool = cfg!(any(feature = "metal", target_os = "macos"));

/// Opens the device a string names; a device this build or machine lacks is a typed error.
pub fn parse_device(spec: &str) -> Result<Device> {
    let spec_l = spec.trim().to_ascii_lowercase();
    let (kind, ordinal) = match spec_l.split_once(':') {
        Some((k, n)) => {
            let n = n.parse::<usize>().map_err(|_| CandleError::Device {
                spec: spec.to_owned(),
                reason: format!("`{n}` is not a device ordinal"),
            })?;
            (k, n)
        }
        None => (spec_l.as_str(), 0),
    };
    let unavailable = |reason: String| CandleError::Device { spec: spec.to_owned(), reason };
    match kind {
        "cpu" => Ok(Device::Cpu),
        "auto" => Ok(best_available()),
        "cuda" => {
            if !CUDA_BUILT {
                return Err(unavailable("this build of candlewick has no CUDA support (feature `cuda`)".into()));
            }
            Device::new_cuda(ordinal).map_err(|e| unavailable(e.to_string()))
        }
        "metal" => {
            if !METAL_BUILT {
                return Err(unavailable(
                    "this build of candlewick has no Metal support (built for macOS, or with feature `metal`)".into(),
                ));
            }
            Device::new_metal(ordinal).map_err(|e| unavailable(e.to_string()))
        }
        other => Err(unavailable(format!("unknown device kind `{other}` (use cpu, cuda[:N], metal[:N] or auto)"))),
    }
}

/// The best device this build and machine offer: CUDA, then Metal, then the CPU.
pub fn best_available() -> Device {
    if CUDA_BUILT && candle_core::utils::cuda_is_available() {
        if let Ok(d) = Device::new_cuda(0) {
            return d;
        }
    }
    if METAL_BUILT && candle_core::utils::metal_is_available() {
        if let Ok(d) = Device::new_metal(0) {
            return d;
        }
    }
    Device::Cpu
}

/// The contract's description of a candle device.
pub fn describe(device: &Device) -> DeviceDescriptor {
    let (kind, ordinal) = match device.location() {
        candle_core::DeviceLocation::Cpu => ("cpu", 0),
        candle_core::DeviceLocation::Cuda { gpu_id } => ("cuda", gpu_id),
        candle_core::DeviceLocation::Metal { gpu_id } => ("metal", gpu_id),
    };
    DeviceDescriptor { kind: kind.to_owned(), ordinal }
}

/// Every device this build can reach, with what each computes in.
pub fn available_devices() -> Vec<(DeviceDescriptor, DeviceCapabilities)> {
    let mut out = vec![(
        describe(&Device::Cpu),
        DeviceCapabilities { dtypes: vec!["f32".into(), "f16".into(), "bf16".into()], asynchronous: false },
    )];
    for (enabled, avail, kind) in [
        (CUDA_BUILT, candle_core::utils::cuda_is_available(), "cuda"),
        (METAL_BUILT, candle_core::utils::metal_is_available(), "metal"),
    ] {
        if enabled && avail {
            out.push((
                DeviceDescriptor { kind: kind.into(), ordinal: 0 },
                DeviceCapabilities { dtypes: vec!["f32".into(), "f16".into(), "bf16".into()], asynchronous: true },
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_and_auto_open() {
        assert!(parse_device("cpu").unwrap().is_cpu());
        parse_device("auto").unwrap();
    }

    #[test]
    fn missing_or_unknown_devices_are_typed_errors() {
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(parse_device("cuda:0"), Err(CandleError::Device { .. })));
        #[cfg(not(any(feature = "metal", target_os = "macos")))]
        assert!(matches!(parse_device("metal"), Err(CandleError::Device { .. })));
        assert!(matches!(parse_device("tpu"), Err(CandleError::Device { .. })));
        assert!(matches!(parse_device("cuda:x"), Err(CandleError::Device { .. })));
    }

    /// A macOS build has Metal without naming the feature, and `auto` takes the GPU there.
    #[test]
    fn auto_takes_metal_where_there_is_one() {
        if cfg!(target_os = "macos") {
            assert!(METAL_BUILT);
        }
        if METAL_BUILT && candle_core::utils::metal_is_available() {
            assert!(parse_device("auto").unwrap().is_metal());
        }
    }
}

/// The candle backend bound to one device.
#[derive(Debug, Clone)]
pub struct CandleBackend {
    device: Device,
}

impl CandleBackend {
    /// A backend on the device a string names (`cpu`, `cuda[:N]`, `metal[:N]`, `auto`).
    pub fn new(device: &str) -> Result<Self> {
        Ok(Self { device: parse_device(device)? })
    }

    /// The candle device models are prepared on.
    pub fn device(&self) -> &Device {
        &self.device
    }
}
