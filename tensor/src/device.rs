//! Devices: the CPU, wgpu adapters (one wgpu `Device` + `Queue` each), and virtual devices that
//! share a backing device's arithmetic but keep their own memory accounting and FLOP counter
//! (the simulated cluster builds on these).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::backend::Kernels;
use crate::cpu::CpuKernels;
use crate::error::{Error, Result};
use crate::memory::{MemoryStats, MemoryTracker};

pub use crate::wgpu::AdapterInfo;

/// Which arithmetic a device runs on.
#[derive(Clone)]
pub(crate) enum Backend {
    Cpu,
    Wgpu(Arc<crate::wgpu::WgpuContext>),
}

/// A place tensors live and ops run. Cheap to clone; two clones are the same device.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    id: usize,
    name: String,
    backend: Backend,
    /// The backend's kernels (f32; ops reach them through their dtype policy, see
    /// `dtype_policy`).
    kernels: Arc<dyn Kernels>,
    memory: MemoryTracker,
    flops: AtomicU64,
}

static NEXT_ID: AtomicUsize = AtomicUsize::new(0);
static CPU: OnceLock<Device> = OnceLock::new();

/// The environment variable that overrides [`Device::best`]: `cpu`, `wgpu` (first non-software
/// adapter, else any), `wgpu:N` (adapter N of [`Device::adapters`]), or `auto`.
pub const DEVICE_ENV: &str = "WGPIPE_DEVICE";

/// The environment variable that moves the tests' wgpu kernels off lavapipe (see
/// [`Device::test_wgpu`]): a spec as [`Device::parse`] reads it, e.g. `gpu` or `wgpu:1`.
pub const TEST_WGPU_ENV: &str = "WGPIPE_TEST_WGPU";

impl Device {
    fn make(name: String, backend: Backend) -> Device {
        let memory = MemoryTracker::new(&name);
        let kernels: Arc<dyn Kernels> = match &backend {
            Backend::Cpu => Arc::new(CpuKernels),
            Backend::Wgpu(c) => c.clone(),
        };
        Device {
            inner: Arc::new(DeviceInner {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                name,
                backend,
                kernels,
                memory,
                flops: AtomicU64::new(0),
            }),
        }
    }

    /// The process-wide CPU device.
    pub fn cpu() -> Device {
        CPU.get_or_init(|| Device::make("cpu".into(), Backend::Cpu))
            .clone()
    }

    /// A new CPU device with its own name and accounting (e.g. one per pipeline stage).
    pub fn new_cpu(name: &str) -> Device {
        Device::make(name.into(), Backend::Cpu)
    }

    /// A virtual device: the arithmetic of `self`, its own name, memory counters, optional
    /// capacity and FLOP counter. The simulated cluster is made of these.
    pub fn virtual_device(&self, name: &str, capacity: Option<usize>) -> Device {
        let d = Device::make(name.into(), self.inner.backend.clone());
        d.memory().set_capacity(capacity);
        d
    }

    /// Every wgpu adapter on this machine (Vulkan, Metal, DX12), in a stable order.
    pub fn adapters() -> Vec<AdapterInfo> {
        crate::wgpu::list_adapters()
    }

    /// Opens a new wgpu device (with its own queue) on adapter `index` of [`Device::adapters`].
    /// Calling it twice gives two devices on one adapter.
    pub fn wgpu(index: usize) -> Result<Device> {
        let ctx = crate::wgpu::WgpuContext::open(index)?;
        let name = format!("wgpu:{index} ({})", ctx.adapter_info().name);
        Ok(Device::make(name, Backend::Wgpu(Arc::new(ctx))))
    }

    /// Opens a device on the first adapter whose name contains `needle` (case-insensitive),
    /// e.g. `"llvmpipe"` for Mesa's lavapipe.
    pub fn wgpu_by_name(needle: &str) -> Result<Device> {
        let needle = needle.to_lowercase();
        let all = Device::adapters();
        let hit = all
            .iter()
            .find(|a| a.name.to_lowercase().contains(&needle))
            .ok_or_else(|| {
                Error::Device(format!(
                    "no wgpu adapter named like '{needle}'; adapters: [{}]",
                    all.iter()
                        .map(|a| a.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
        Device::wgpu(hit.index)
    }

    /// The first software adapter (lavapipe, WARP, SwiftShader), which tests use to run every WGSL
    /// kernel without a GPU. `Err` says why there is none.
    pub fn software_wgpu() -> Result<Device> {
        let all = Device::adapters();
        match all.iter().find(|a| a.is_software) {
            Some(a) => Device::wgpu(a.index),
            None => Err(Error::Device(format!(
                "no software wgpu adapter (install mesa-vulkan-drivers for lavapipe); adapters: [{}]",
                all.iter().map(|a| a.name.as_str()).collect::<Vec<_>>().join(", ")
            ))),
        }
    }

    /// The wgpu device the tests run their kernels on: the first software adapter (lavapipe), so
    /// that `cargo test` runs every WGSL kernel on any machine with Mesa, or the adapter that
    /// `WGPIPE_TEST_WGPU` names, so that the same tests run on a real GPU
    /// (`scripts/gpu-check.sh` sets it to the GPU's `wgpu:N`). Each call opens a new device.
    /// `Err` says why there is none.
    pub fn test_wgpu() -> Result<Device> {
        Device::test_wgpu_from(std::env::var(TEST_WGPU_ENV).ok())
    }

    /// [`Device::test_wgpu`] with the variable's value given (tests can't set it: other tests
    /// of the process read it at the same time).
    fn test_wgpu_from(spec: Option<String>) -> Result<Device> {
        let Some(spec) = spec else {
            return Device::software_wgpu();
        };
        let d = Device::parse(&spec)
            .map_err(|e| Error::Device(format!("{TEST_WGPU_ENV}={spec}: {e}")))?;
        if d.is_wgpu() {
            Ok(d)
        } else {
            Err(Error::Device(format!(
                "{TEST_WGPU_ENV}={spec} names the CPU; it must name a wgpu adapter (gpu, wgpu:N, wgpu:NAME)"
            )))
        }
    }

    /// A discrete GPU, else an integrated one, else the CPU. Software adapters are never picked:
    /// the CPU backend is faster than them.
    pub fn best() -> Device {
        let all = Device::adapters();
        let pick =
            all.iter()
                .filter(|a| !a.is_software)
                .min_by_key(|a| if a.is_discrete { 0 } else { 1 });
        match pick {
            Some(a) => Device::wgpu(a.index).unwrap_or_else(|_| Device::cpu()),
            None => Device::cpu(),
        }
    }

    /// [`Device::best`], unless `WGPIPE_DEVICE` says otherwise.
    pub fn from_env() -> Result<Device> {
        match std::env::var(DEVICE_ENV) {
            Ok(v) => Device::parse(&v),
            Err(_) => Ok(Device::best()),
        }
    }

    /// Parses `cpu`, `auto`, `wgpu`, `wgpu:N` or `wgpu:NAME`.
    pub fn parse(spec: &str) -> Result<Device> {
        let spec = spec.trim();
        match spec {
            "cpu" => Ok(Device::cpu()),
            "auto" | "" => Ok(Device::best()),
            "wgpu" | "gpu" => {
                let all = Device::adapters();
                let pick = all
                    .iter()
                    .filter(|a| !a.is_software)
                    .min_by_key(|a| if a.is_discrete { 0 } else { 1 })
                    .or(all.first());
                match pick {
                    Some(a) => Device::wgpu(a.index),
                    None => Err(Error::Device(
                        "no wgpu adapter found (no Vulkan/Metal/DX12 driver)".into(),
                    )),
                }
            }
            s if s.starts_with("wgpu:") => {
                let rest = &s[5..];
                match rest.parse::<usize>() {
                    Ok(i) => Device::wgpu(i),
                    Err(_) => Device::wgpu_by_name(rest),
                }
            }
            other => Err(Error::Device(format!(
                "unknown device '{other}': expected cpu, auto, wgpu, wgpu:N or wgpu:NAME"
            ))),
        }
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }
    /// Unique per device in this process.
    pub fn id(&self) -> usize {
        self.inner.id
    }
    pub fn is_cpu(&self) -> bool {
        matches!(self.inner.backend, Backend::Cpu)
    }
    pub fn is_wgpu(&self) -> bool {
        matches!(self.inner.backend, Backend::Wgpu(_))
    }
    /// True when both devices run on the same arithmetic (same wgpu device, or both CPU), so a
    /// tensor can move between them without a copy through the host.
    pub fn same_backend(&self, other: &Device) -> bool {
        match (&self.inner.backend, &other.inner.backend) {
            (Backend::Cpu, Backend::Cpu) => true,
            (Backend::Wgpu(a), Backend::Wgpu(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
    pub fn memory(&self) -> &MemoryTracker {
        &self.inner.memory
    }
    pub fn memory_stats(&self) -> MemoryStats {
        self.inner.memory.stats()
    }
    /// FLOPs of the ops run on this device so far (as counted by the op front-ends).
    pub fn flops(&self) -> u64 {
        self.inner.flops.load(Ordering::Relaxed)
    }
    pub(crate) fn add_flops(&self, n: u64) {
        self.inner.flops.fetch_add(n, Ordering::Relaxed);
        crate::work::count_flops(n);
    }
    /// Waits until the device has finished all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.kernels().synchronize()
    }
    /// Adapter details when this is a wgpu device.
    pub fn adapter_info(&self) -> Option<AdapterInfo> {
        match &self.inner.backend {
            Backend::Wgpu(c) => Some(c.adapter_info().clone()),
            Backend::Cpu => None,
        }
    }
    /// Forgets the kernel autotune's choices for this adapter (matmul variants, the row
    /// kernels' workgroup sizes; in memory and in its cache file; see `WGPIPE_AUTOTUNE`) and
    /// turns the autotune on: the next use of each kernel's shape class is timed again. Nothing
    /// to do on the CPU.
    pub fn reset_autotune(&self) {
        if let Backend::Wgpu(c) = &self.inner.backend {
            c.reset_autotune();
        }
    }
    /// The wgpu context behind this device (crate tests reach the runtime through it).
    #[cfg(test)]
    pub(crate) fn wgpu_context(&self) -> Option<&Arc<crate::wgpu::WgpuContext>> {
        match &self.inner.backend {
            Backend::Wgpu(c) => Some(c),
            Backend::Cpu => None,
        }
    }
    /// The backend's kernels as they are: f32 operands only (but for `widen`, `to_host` and the
    /// native half matmul). Ops with tensor operands call them through [`Device::run`] and their
    /// dtype policy (see `dtype_policy`).
    pub(crate) fn kernels(&self) -> &dyn Kernels {
        &*self.inner.kernels
    }
    /// The backend's name in errors: "cpu" or "wgpu".
    pub(crate) fn backend_name(&self) -> &'static str {
        match &self.inner.backend {
            Backend::Cpu => "cpu",
            Backend::Wgpu(_) => "wgpu",
        }
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        self.inner.id == other.inner.id
    }
}
impl Eq for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({})", self.inner.name)
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.inner.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unset, the tests' device is the software adapter; set, it is the adapter named, and a
    /// value that names no wgpu adapter is an error that quotes the variable.
    #[test]
    fn test_wgpu_follows_its_variable() {
        match (Device::test_wgpu_from(None), Device::software_wgpu()) {
            (Ok(a), Ok(b)) => assert_eq!(a.name(), b.name()),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
            (a, b) => panic!("unset: {a:?}, software adapter: {b:?}"),
        }
        for bad in ["cpu", "wgpu:999", "nonsense"] {
            let e = Device::test_wgpu_from(Some(bad.into()))
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("{TEST_WGPU_ENV}={bad}")), "{e}");
        }
        for a in Device::adapters() {
            let d = Device::test_wgpu_from(Some(format!("wgpu:{}", a.index))).unwrap();
            assert_eq!(d.name(), format!("wgpu:{} ({})", a.index, a.name));
        }
    }
}
