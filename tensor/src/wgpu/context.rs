//! `WgpuContext`: one wgpu `Device` + `Queue` opened on an adapter with the adapter's real
//! limits, plus the runtime state (recorder, buffer pools, pipeline cache, error sink).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use wgpipe_shaders::RowGroup;

use super::autotune::{default_cache_path, mode_from, Tuner, AUTOTUNE_ENV};
use super::discovery::{discovery, AdapterInfo};
use super::pipelines::PipelineCache;
use super::runtime::Recorder;
use crate::error::{Error, Result};
use crate::gpu_pool::BufferPool;

/// Errors wgpu reported outside an error scope (validation of recorded commands, device loss),
/// collected by the device's handler and returned by the next call that checks.
#[derive(Default)]
pub(crate) struct ErrorSink {
    errors: Mutex<Vec<String>>,
    /// Set once the device is lost: every later call fails.
    lost: Mutex<Option<String>>,
}

impl ErrorSink {
    pub(crate) fn push(&self, msg: String) {
        self.errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(msg);
    }
    fn take(&self) -> Option<String> {
        if let Some(l) = self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Some(l);
        }
        let mut e = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_empty() {
            None
        } else {
            Some(std::mem::take(&mut *e).join("; "))
        }
    }
}

pub(crate) struct WgpuContext {
    pub(super) info: AdapterInfo,
    /// The name errors carry (as `Device::wgpu` names the device).
    pub(super) name: String,
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    pub(super) limits: wgpu::Limits,
    pub(super) sink: Arc<ErrorSink>,
    /// Submission epoch: bumped at every submit (see `pool`).
    pub(super) epoch: Arc<AtomicU64>,
    /// Storage buffers of tensors.
    pub(super) pool: Arc<BufferPool>,
    /// Read-back staging buffers.
    pub(super) staging: Arc<BufferPool>,
    pub(super) recorder: Mutex<Recorder>,
    pub(super) pipelines: PipelineCache,
    /// The adapter's subgroup size when it is fixed and the device has `SUBGROUP`.
    pub(super) subgroup_size: Option<u32>,
    /// The row kernels' workgroup (reduce, softmax, layer norm, ...) when the autotune does not
    /// pick one: a tree over 256 invocations per row on GPUs; one subgroup on CPU-backed adapters,
    /// where workgroup barriers are expensive.
    row_group: Mutex<RowGroup>,
    /// The kernel autotune (None when off; see `autotune`).
    tuner: Mutex<Option<Arc<Tuner>>>,
}

impl WgpuContext {
    /// Opens a new device (with its own queue) on adapter `index` of `list_adapters()`.
    pub(crate) fn open(index: usize) -> Result<WgpuContext> {
        let d = discovery();
        let (adapter, info) = match (d.adapters.get(index), d.infos.get(index)) {
            (Some(a), Some(i)) => (a, i.clone()),
            _ => {
                return Err(Error::Device(format!(
                    "no wgpu adapter {index}; adapters: [{}]",
                    d.infos
                        .iter()
                        .map(|a| format!("{}: {}", a.index, a.name))
                        .collect::<Vec<_>>()
                        .join(", ")
                )))
            }
        };
        let name = format!("wgpu:{index} ({})", info.name);
        // The adapter's real limits, not wgpu's small defaults (128 MiB bindings, 256 MiB
        // buffers); f16 only where the adapter has it.
        let limits = adapter.limits();
        let mut features = wgpu::Features::empty();
        for f in [wgpu::Features::SHADER_F16, wgpu::Features::SUBGROUP] {
            if adapter.features().contains(f) {
                features |= f;
            }
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("wgpipe"),
            required_features: features,
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| Error::Wgpu {
            device: name.clone(),
            msg: format!("request_device failed: {e}"),
        })?;

        let sink = Arc::new(ErrorSink::default());
        {
            let sink = sink.clone();
            device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| sink.push(e.to_string())));
        }
        {
            let sink = sink.clone();
            device.set_device_lost_callback(move |reason, msg| {
                if reason != wgpu::DeviceLostReason::Destroyed {
                    *sink.lost.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(format!("device lost ({reason:?}): {msg}"));
                }
            });
        }

        let epoch = Arc::new(AtomicU64::new(0));
        let pool = BufferPool::new(
            device.clone(),
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            limits.max_buffer_size,
            epoch.clone(),
            "wgpipe tensor",
        );
        let staging = BufferPool::new(
            device.clone(),
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            limits.max_buffer_size,
            epoch.clone(),
            "wgpipe read-back",
        );
        let recorder = Recorder::new(&device, &limits);
        let ainfo = adapter.get_info();
        let subgroup_size = (features.contains(wgpu::Features::SUBGROUP)
            && ainfo.subgroup_min_size == ainfo.subgroup_max_size
            && ainfo.subgroup_min_size.is_power_of_two())
        .then_some(ainfo.subgroup_min_size);
        let row_group = if info.is_software {
            match subgroup_size.filter(|s| wgpipe_shaders::ROW_SUBGROUP_SIZES.contains(s)) {
                Some(sg) => RowGroup::subgroup(sg),
                None => RowGroup::tree(8),
            }
        } else {
            RowGroup::tree(wgpipe_shaders::ROW_WG)
        };
        let (tune, reset) = mode_from(
            std::env::var(AUTOTUNE_ENV).ok().as_deref(),
            info.is_software,
        );
        let tuner =
            tune.then(|| Arc::new(Tuner::new(&tuner_key(&info), default_cache_path(), reset)));
        Ok(WgpuContext {
            info,
            name,
            device,
            queue,
            limits,
            sink,
            epoch,
            pool,
            staging,
            recorder: Mutex::new(recorder),
            pipelines: PipelineCache::default(),
            subgroup_size,
            row_group: Mutex::new(row_group),
            tuner: Mutex::new(tuner),
        })
    }

    /// The kernel autotune, when it is on.
    pub(super) fn tuner(&self) -> Option<Arc<Tuner>> {
        self.tuner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Seconds one run of `run` takes on this adapter, as the autotune times a candidate: the
    /// best of up to 3 after a warm-up run (which compiles its pipelines), each waited for, with
    /// earlier queued work finished before the clock starts. A run of over `LONG_RUN_SECS` is
    /// timed once: its own length dwarfs the noise, and on a software adapter three more runs of
    /// every candidate of a large product took minutes.
    pub(super) fn time_op<R>(&self, mut run: impl FnMut() -> Result<R>) -> Result<f64> {
        const LONG_RUN_SECS: f64 = 0.02;
        self.sync()?;
        drop(run()?);
        self.sync()?;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t0 = std::time::Instant::now();
            drop(run()?);
            self.sync()?;
            best = best.min(t0.elapsed().as_secs_f64());
            if best > LONG_RUN_SECS {
                break;
            }
        }
        Ok(best)
    }

    /// Turns the autotune on with `tuner`, or off with `None`.
    pub(crate) fn set_tuner(&self, tuner: Option<Tuner>) {
        *self.tuner.lock().unwrap_or_else(|p| p.into_inner()) = tuner.map(Arc::new);
    }

    /// Forgets the autotune's choices for this adapter (in memory and on disk) and turns it on.
    pub(crate) fn reset_autotune(&self) {
        match self.tuner() {
            Some(t) => t.reset(),
            None => self.set_tuner(Some(Tuner::new(
                &tuner_key(&self.info),
                default_cache_path(),
                true,
            ))),
        }
    }

    pub(crate) fn adapter_info(&self) -> &AdapterInfo {
        &self.info
    }

    /// The row kernels' workgroup when the autotune does not pick one.
    pub(super) fn row_group(&self) -> RowGroup {
        *self.row_group.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Invocations per row of the row kernels when the autotune does not pick them.
    pub(super) fn row_wg(&self) -> u32 {
        self.row_group().wg
    }

    /// Switches the row kernels' workgroup (tests run the GPU's and the CPU adapter's variants,
    /// and every other the autotune may pick, on one adapter).
    #[cfg(test)]
    pub(super) fn set_row_group(&self, group: RowGroup) {
        *self.row_group.lock().unwrap_or_else(|p| p.into_inner()) = group;
    }

    /// An `Error::Wgpu` on this device.
    pub(super) fn err(&self, msg: impl Into<String>) -> Error {
        Error::Wgpu {
            device: self.name.clone(),
            msg: msg.into(),
        }
    }

    /// Returns (and clears) the errors wgpu reported since the last check.
    pub(super) fn check(&self) -> Result<()> {
        match self.sink.take() {
            None => Ok(()),
            Some(msg) => Err(self.err(msg)),
        }
    }
}

impl Drop for WgpuContext {
    fn drop(&mut self) {
        // Submit what is recorded and let the device finish, so no work is cut off mid-flight.
        if let Ok(mut rec) = self.recorder.lock() {
            self.flush_locked(&mut rec);
        }
        let _ = self.device.poll(wgpu::PollType::wait_indefinitely());
    }
}

/// What an autotune choice is valid for: the adapter, its backend and its driver version.
pub(crate) fn tuner_key(info: &AdapterInfo) -> String {
    format!("{}|{}|{}", info.name, info.backend, info.driver)
}
