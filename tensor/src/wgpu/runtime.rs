//! The runtime: dispatches are recorded into one command encoder (one open compute pass) per
//! device and submitted at sync points (read-back, `synchronize`, an upload into a buffer that
//! recorded work still reads) or every [`FLUSH_EVERY`] dispatches. Each dispatch's parameter block
//! (shapes, strides, scalars as u32 words) is appended to one host-side arena, written with a
//! single `write_buffer` just before the submit, and bound at its offset.

use std::num::NonZeroU64;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use wgpipe_shaders::Kernel;

use super::context::WgpuContext;
use crate::error::Result;
use crate::gpu_pool::GpuBuffer;

/// Dispatches recorded before a submit is forced.
pub(crate) const FLUSH_EVERY: usize = 64;
/// Bytes of the per-submission parameter arena.
const PARAMS_CAPACITY: u64 = 64 * 1024;

pub(crate) struct Recorder {
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    dispatches: usize,
    params: Vec<u8>,
    params_buf: wgpu::Buffer,
    align: u64,
}

impl Recorder {
    pub(super) fn new(device: &wgpu::Device, limits: &wgpu::Limits) -> Self {
        let params_buf = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("wgpipe params"),
            size: PARAMS_CAPACITY,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Recorder {
            encoder: None,
            pass: None,
            dispatches: 0,
            params: Vec::with_capacity(PARAMS_CAPACITY as usize),
            params_buf,
            align: u64::from(limits.min_storage_buffer_offset_alignment.max(4)),
        }
    }

    fn encoder(&mut self, device: &wgpu::Device) -> &mut wgpu::CommandEncoder {
        self.pass = None;
        self.encoder.get_or_insert_with(|| {
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("wgpipe batch"),
            })
        })
    }

    fn pass(&mut self, device: &wgpu::Device) -> &mut wgpu::ComputePass<'static> {
        if self.pass.is_none() {
            let pass = self
                .encoder(device)
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("wgpipe kernels"),
                    timestamp_writes: None,
                })
                .forget_lifetime();
            self.pass = Some(pass);
        }
        self.pass.as_mut().expect("pass just opened")
    }
}

/// A buffer argument of a dispatch: the buffer and how many bytes of it to bind.
pub(crate) struct Arg<'a> {
    pub(crate) buffer: &'a wgpu::Buffer,
    pub(crate) bytes: u64,
}

impl<'a> Arg<'a> {
    pub(crate) fn of(b: &'a GpuBuffer) -> Self {
        Arg {
            buffer: b.buffer(),
            bytes: b.bytes(),
        }
    }

    /// `b` bound as whole vec4s (its size rounded up to 16 bytes), for a kernel that declares it
    /// `array<vec4<f32>>`; `None` where the buffer does not hold the rounded size.
    pub(crate) fn vec4(b: &'a GpuBuffer) -> Option<Self> {
        let bytes = b.bytes().div_ceil(16) * 16;
        (bytes <= b.buffer().size()).then_some(Arg {
            buffer: b.buffer(),
            bytes,
        })
    }
}

/// Splits `groups` workgroups into an (x, y) grid with both sides at most `max`; kernels
/// rebuild the linear index as `y * num_workgroups.x + x` and bounds-check it.
pub(crate) fn split_grid(groups: u64, max: u32) -> Option<(u32, u32)> {
    let max = u64::from(max.max(1));
    if groups <= max {
        return Some((groups as u32, 1));
    }
    let y = groups.div_ceil(max);
    if y > max {
        return None;
    }
    Some((groups.div_ceil(y) as u32, y as u32))
}

impl WgpuContext {
    fn lock(&self) -> MutexGuard<'_, Recorder> {
        self.recorder.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records one dispatch of `kernel` over `groups` workgroups (split into a 2-D grid) times
    /// `z` layers, with `params` as its parameter block and `args` bound in the kernel's binding
    /// order (inputs, then outputs).
    pub(super) fn dispatch(
        &self,
        kernel: Kernel,
        params: &[u32],
        args: &[Arg<'_>],
        groups: u64,
        z: u32,
    ) -> Result<()> {
        if groups == 0 || z == 0 {
            return Ok(());
        }
        let max = self.limits.max_compute_workgroups_per_dimension;
        let (x, y) = split_grid(groups, max).ok_or_else(|| {
            self.err(format!(
                "{kernel:?}: {groups} workgroups do not fit a {max} x {max} grid"
            ))
        })?;
        self.dispatch_grid(kernel, params, args, [x, y, z])
    }

    /// Records one dispatch with an explicit workgroup grid (no limit checks: wgpu validates).
    pub(super) fn dispatch_grid(
        &self,
        kernel: Kernel,
        params: &[u32],
        args: &[Arg<'_>],
        grid: [u32; 3],
    ) -> Result<()> {
        let pipe = self.pipeline(kernel)?;
        if args.len() != pipe.bindings.len() {
            return Err(self.err(format!(
                "{kernel:?}: {} buffers given for {} bindings",
                args.len(),
                pipe.bindings.len()
            )));
        }
        let words: &[u32] = if params.is_empty() { &[0] } else { params };
        let block = (words.len() * 4) as u64;
        if block > PARAMS_CAPACITY {
            return Err(self.err(format!(
                "{kernel:?}: parameter block of {block} bytes is too large"
            )));
        }
        let mut rec = self.lock();
        let mut offset = (rec.params.len() as u64).div_ceil(rec.align) * rec.align;
        if offset + block > PARAMS_CAPACITY {
            self.flush_locked(&mut rec);
            offset = 0;
        }
        rec.params.resize(offset as usize, 0);
        rec.params.extend_from_slice(bytemuck::cast_slice(words));

        let mut entries = Vec::with_capacity(args.len() + 1);
        entries.push(wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &rec.params_buf,
                offset,
                size: NonZeroU64::new(block),
            }),
        });
        for (a, &(binding, _)) in args.iter().zip(&pipe.bindings) {
            entries.push(wgpu::BindGroupEntry {
                binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: a.buffer,
                    offset: 0,
                    size: NonZeroU64::new(a.bytes.max(4).div_ceil(4) * 4),
                }),
            });
        }
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipe.layout,
            entries: &entries,
        });
        let pass = rec.pass(&self.device);
        pass.set_pipeline(&pipe.pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
        rec.dispatches += 1;
        if rec.dispatches >= FLUSH_EVERY {
            self.flush_locked(&mut rec);
        }
        Ok(())
    }

    /// Ends the pass, writes the parameter arena and submits the batch (if any).
    pub(super) fn flush_locked(&self, rec: &mut Recorder) {
        rec.pass = None;
        if let Some(encoder) = rec.encoder.take() {
            if !rec.params.is_empty() {
                self.queue.write_buffer(&rec.params_buf, 0, &rec.params);
            }
            self.queue.submit([encoder.finish()]);
            rec.params.clear();
            rec.dispatches = 0;
            self.epoch.fetch_add(1, Ordering::Relaxed);
            // Lets wgpu retire finished submissions (and free what they held) without waiting.
            let _ = self.device.poll(wgpu::PollType::Poll);
        }
    }

    /// Submits everything recorded so far.
    pub(super) fn flush(&self) {
        let mut rec = self.lock();
        self.flush_locked(&mut rec);
    }

    /// Writes `data` at the start of `dst`. If `dst` was freed during the batch being recorded
    /// (recorded work may still read it), that batch is submitted first: `write_buffer` runs
    /// before any command recorded after the last submit.
    pub(super) fn upload(&self, dst: &GpuBuffer, data: &[f32]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let mut rec = self.lock();
        if dst.freed_epoch() == Some(self.epoch.load(Ordering::Relaxed)) && rec.encoder.is_some() {
            self.flush_locked(&mut rec);
        }
        self.queue
            .write_buffer(dst.buffer(), 0, bytemuck::cast_slice(data));
        drop(rec);
        self.check()
    }

    /// Reads `count` f32 values of `src` starting at element `offset`: a copy into a staging
    /// buffer, a submit, a map and a wait.
    pub(super) fn read(&self, src: &GpuBuffer, offset: usize, count: usize) -> Result<Vec<f32>> {
        if count == 0 {
            return Ok(Vec::new());
        }
        let bytes = (count * 4) as u64;
        let staging = self.staging.alloc(bytes).map_err(|m| self.err(m))?;
        {
            let mut rec = self.lock();
            rec.encoder(&self.device).copy_buffer_to_buffer(
                src.buffer(),
                (offset * 4) as u64,
                staging.buffer(),
                0,
                bytes,
            );
            self.flush_locked(&mut rec);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        staging
            .buffer()
            .map_async(wgpu::MapMode::Read, 0..bytes, move |r| {
                let _ = tx.send(r);
            });
        loop {
            self.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| self.err(format!("waiting for the device failed: {e}")))?;
            match rx.try_recv() {
                Ok(Ok(())) => break,
                Ok(Err(e)) => {
                    self.check()?;
                    return Err(self.err(format!("mapping the read-back buffer failed: {e}")));
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => continue,
                Err(e) => return Err(self.err(format!("read-back callback lost: {e}"))),
            }
        }
        let data = {
            let view = staging
                .buffer()
                .get_mapped_range(0..bytes)
                .map_err(|e| self.err(format!("read-back view failed: {e}")))?;
            bytemuck::pod_collect_to_vec::<u8, f32>(&view)
        };
        staging.buffer().unmap();
        self.check()?;
        Ok(data)
    }

    /// Submits everything and waits until the device is idle; returns any error wgpu reported.
    pub(super) fn sync(&self) -> Result<()> {
        self.flush();
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| self.err(format!("waiting for the device failed: {e}")))?;
        self.check()
    }
}

#[cfg(test)]
mod tests {
    use super::split_grid;

    #[test]
    fn grids_respect_the_limit() {
        assert_eq!(split_grid(10, 65535), Some((10, 1)));
        let (x, y) = split_grid(65536, 65535).unwrap();
        assert!(x <= 65535 && y <= 65535 && u64::from(x) * u64::from(y) >= 65536);
        let g = 65535u64 * 1000 + 7;
        let (x, y) = split_grid(g, 65535).unwrap();
        assert!(x <= 65535 && u64::from(x) * u64::from(y) >= g);
        assert_eq!(split_grid(65536 * 65536, 65535), None);
    }
}
