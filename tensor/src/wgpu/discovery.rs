//! Adapter discovery: one wgpu instance per process (Vulkan, Metal, DX12 as compiled in), its
//! adapters listed once, in a stable order, with what wgpipe needs to know about each.

use std::sync::OnceLock;

/// One wgpu adapter as discovered on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterInfo {
    /// Position in `list_adapters` (what `Device::wgpu(index)` takes).
    pub index: usize,
    pub name: String,
    /// `Vulkan`, `Metal` or `Dx12`.
    pub backend: String,
    pub is_discrete: bool,
    /// A CPU implementation: lavapipe / llvmpipe, WARP, SwiftShader, or any `Cpu` device type.
    pub is_software: bool,
    /// wgpu's device type (`DiscreteGpu`, `IntegratedGpu`, `Cpu`, ...).
    pub device_type: String,
    /// Driver name and version, as the driver reports them.
    pub driver: String,
    /// Whether the adapter has `SHADER_F16`.
    pub shader_f16: bool,
}

pub(super) struct Discovery {
    /// Adapters in the order of `infos` (kept alive for `WgpuContext::open`).
    pub(super) adapters: Vec<wgpu::Adapter>,
    pub(super) infos: Vec<AdapterInfo>,
}

static DISCOVERY: OnceLock<Discovery> = OnceLock::new();

/// True for the CPU implementations of Vulkan / DX12 / Metal.
pub(super) fn is_software(info: &wgpu::AdapterInfo) -> bool {
    if info.device_type == wgpu::DeviceType::Cpu {
        return true;
    }
    let name = format!("{} {}", info.name, info.driver).to_lowercase();
    [
        "llvmpipe",
        "lavapipe",
        "swiftshader",
        "microsoft basic render",
        "warp",
    ]
    .iter()
    .any(|s| name.contains(s))
}

fn backend_rank(b: wgpu::Backend) -> u8 {
    match b {
        wgpu::Backend::Vulkan => 0,
        wgpu::Backend::Metal => 1,
        wgpu::Backend::Dx12 => 2,
        _ => 3,
    }
}

/// The window-system extensions wgpu enables on a Vulkan instance wherever they exist (X11 and
/// Wayland surfaces), which a compute-only process never uses.
#[cfg(all(unix, not(target_os = "macos"), not(target_os = "android")))]
const WINDOW_SYSTEM_EXTENSIONS: [&std::ffi::CStr; 3] = [
    c"VK_KHR_xlib_surface",
    c"VK_KHR_xcb_surface",
    c"VK_KHR_wayland_surface",
];

/// A Vulkan instance without [`WINDOW_SYSTEM_EXTENSIONS`] (`None` where Vulkan cannot be
/// loaded: then the plain instance says what there is). Why: Mesa's device-select layer
/// (installed with Mesa's Vulkan drivers, lavapipe included) connects to the display server of
/// every window system whose surface extension the instance enabled, to find the default GPU;
/// on a headless machine libwayland then prints `error: XDG_RUNTIME_DIR is invalid or not set`
/// on every run. Without the extensions it does not look. Safe although wgpu-hal asks callbacks
/// not to remove extensions: it checks its list of enabled extensions before each use of these
/// three (creating an X11 or Wayland surface), which wgpipe never does.
#[cfg(all(unix, not(target_os = "macos"), not(target_os = "android")))]
fn compute_only_vulkan(flags: wgpu::InstanceFlags) -> Option<wgpu::Instance> {
    use wgpu::hal;
    let desc = hal::InstanceDescriptor {
        name: "wgpipe",
        flags,
        memory_budget_thresholds: Default::default(),
        backend_options: Default::default(),
        telemetry: None,
        display: None,
    };
    let strip: Box<hal::vulkan::CreateInstanceCallback> =
        Box::new(|args: hal::vulkan::CreateInstanceCallbackArgs| {
            args.extensions
                .retain(|e| !WINDOW_SYSTEM_EXTENSIONS.contains(e));
        });
    // SAFETY: the callback only removes extensions this process never uses (see above).
    let hal_instance = unsafe { hal::vulkan::Instance::init_with_callback(&desc, Some(strip)) };
    // SAFETY: a valid Vulkan instance, handed over whole.
    hal_instance
        .ok()
        .map(|i| unsafe { wgpu::Instance::from_hal::<hal::api::Vulkan>(i) })
}

/// Elsewhere the plain instance (no Mesa device-select layer to wake).
#[cfg(not(all(unix, not(target_os = "macos"), not(target_os = "android"))))]
fn compute_only_vulkan(_flags: wgpu::InstanceFlags) -> Option<wgpu::Instance> {
    None
}

fn discover() -> Discovery {
    // An instance without validation layers (they are slow and usually absent); WGPU_DEBUG /
    // WGPU_VALIDATION still turn them on.
    let desc = wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12,
        flags: wgpu::InstanceFlags::empty().with_env(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    };
    // Instance creation and enumeration talk to system drivers; a broken driver must not take
    // the process down, so a panic there means "no adapters".
    let found = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let instance = compute_only_vulkan(desc.flags).unwrap_or_else(|| wgpu::Instance::new(desc));
        pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()))
    }))
    .unwrap_or_default();

    let mut found: Vec<(wgpu::Adapter, wgpu::AdapterInfo)> = found
        .into_iter()
        .map(|a| {
            let info = a.get_info();
            (a, info)
        })
        .collect();
    // Stable order: hardware before software, then backend, name, bus id.
    found.sort_by(|(_, x), (_, y)| {
        (
            is_software(x),
            backend_rank(x.backend),
            &x.name,
            &x.device_pci_bus_id,
        )
            .cmp(&(
                is_software(y),
                backend_rank(y.backend),
                &y.name,
                &y.device_pci_bus_id,
            ))
    });

    let infos = found
        .iter()
        .enumerate()
        .map(|(index, (a, i))| AdapterInfo {
            index,
            name: i.name.clone(),
            backend: format!("{:?}", i.backend),
            is_discrete: i.device_type == wgpu::DeviceType::DiscreteGpu,
            is_software: is_software(i),
            device_type: format!("{:?}", i.device_type),
            driver: format!("{} {}", i.driver, i.driver_info).trim().to_string(),
            shader_f16: a.features().contains(wgpu::Features::SHADER_F16),
        })
        .collect();
    Discovery {
        adapters: found.into_iter().map(|(a, _)| a).collect(),
        infos,
    }
}

pub(super) fn discovery() -> &'static Discovery {
    DISCOVERY.get_or_init(discover)
}

/// Every wgpu adapter on this machine, in a stable order (the same for the whole process).
pub fn list_adapters() -> Vec<AdapterInfo> {
    discovery().infos.clone()
}
