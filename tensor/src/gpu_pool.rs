//! Size-bucketed buffer pool: buffers come in power-of-two buckets and go back to their bucket
//! when the tensor that held them is dropped, so steady-state training allocates nothing.
//!
//! Accounting is separate: `Storage::reserve` charges the device's memory tracker for the
//! tensor's logical bytes before a buffer is taken from here, and pooled (free) buffers are not
//! counted. Reuse is safe without waiting for the GPU because every use of a buffer is ordered on
//! the device's one queue (a buffer freed by one dispatch and reused by the next is written after
//! it is read); the one exception, `queue.write_buffer`, which runs before the commands still
//! being recorded, is handled by the caller through [`GpuBuffer::freed_epoch`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Smallest bucket, in bytes.
const MIN_BUCKET: u64 = 256;

pub(crate) struct BufferPool {
    device: wgpu::Device,
    usage: wgpu::BufferUsages,
    max_buffer_size: u64,
    /// Free buffers per bucket size, with the submission epoch in which each was freed.
    free: Mutex<HashMap<u64, Vec<(wgpu::Buffer, u64)>>>,
    free_bytes: AtomicU64,
    /// The epoch of the batch being recorded (bumped by the runtime at every submit).
    epoch: Arc<AtomicU64>,
    label: &'static str,
}

/// A buffer taken from a [`BufferPool`]; it returns there when dropped.
pub(crate) struct GpuBuffer {
    buffer: Option<wgpu::Buffer>,
    /// Logical size in bytes (what the tensor uses; the buffer may be larger).
    bytes: u64,
    /// Epoch in which this buffer was last freed, if it came from the free list.
    freed_epoch: Option<u64>,
    pool: Arc<BufferPool>,
}

impl BufferPool {
    pub(crate) fn new(
        device: wgpu::Device,
        usage: wgpu::BufferUsages,
        max_buffer_size: u64,
        epoch: Arc<AtomicU64>,
        label: &'static str,
    ) -> Arc<Self> {
        Arc::new(BufferPool {
            device,
            usage,
            max_buffer_size,
            free: Mutex::new(HashMap::new()),
            free_bytes: AtomicU64::new(0),
            epoch,
            label,
        })
    }

    /// The bucket a request of `bytes` is served from: the next power of two (at least
    /// [`MIN_BUCKET`]); a request whose power of two would pass the adapter's largest buffer gets
    /// its exact size, rounded to 16 bytes where that fits (so that kernels can bind any buffer
    /// as whole vec4s, see `Arg::vec4`), else to 4.
    pub(crate) fn bucket(&self, bytes: u64) -> u64 {
        let p = bytes.max(MIN_BUCKET).next_power_of_two();
        if p <= self.max_buffer_size {
            p
        } else if bytes.div_ceil(16) * 16 <= self.max_buffer_size {
            bytes.div_ceil(16) * 16
        } else {
            bytes.div_ceil(4) * 4
        }
    }

    /// A buffer of at least `bytes`, reused when one is free. `Err` carries wgpu's message (a
    /// buffer past the adapter's limits, or out of device memory after emptying the pool).
    pub(crate) fn alloc(self: &Arc<Self>, bytes: u64) -> Result<GpuBuffer, String> {
        let bucket = self.bucket(bytes);
        if bucket > self.max_buffer_size {
            return Err(format!(
                "a buffer of {bytes} bytes exceeds the adapter's max_buffer_size of {} bytes",
                self.max_buffer_size
            ));
        }
        let reused = self
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&bucket)
            .and_then(|v| v.pop());
        if let Some((buffer, epoch)) = reused {
            self.free_bytes.fetch_sub(bucket, Ordering::Relaxed);
            return Ok(GpuBuffer {
                buffer: Some(buffer),
                bytes,
                freed_epoch: Some(epoch),
                pool: self.clone(),
            });
        }
        let buffer = match self.create(bucket) {
            Ok(b) => b,
            Err(first) => {
                // Out of memory (or another failure): give the pooled buffers back and retry once.
                if self.trim() == 0 {
                    return Err(first);
                }
                self.create(bucket)?
            }
        };
        Ok(GpuBuffer {
            buffer: Some(buffer),
            bytes,
            freed_epoch: None,
            pool: self.clone(),
        })
    }

    /// Creates a buffer inside error scopes, so a failure is a message, not a panic.
    pub(crate) fn create(&self, size: u64) -> Result<wgpu::Buffer, String> {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(self.label),
            size,
            usage: self.usage,
            mapped_at_creation: false,
        });
        let v = pollster::block_on(validation.pop());
        let o = pollster::block_on(oom.pop());
        match v.or(o) {
            None => Ok(buffer),
            Some(e) => Err(format!("creating a buffer of {size} bytes failed: {e}")),
        }
    }

    fn give_back(&self, buffer: wgpu::Buffer) {
        let size = buffer.size();
        let epoch = self.epoch.load(Ordering::Relaxed);
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(size)
            .or_default()
            .push((buffer, epoch));
        self.free_bytes.fetch_add(size, Ordering::Relaxed);
    }

    /// Drops every free buffer; returns the bytes released.
    pub(crate) fn trim(&self) -> u64 {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        free.clear();
        self.free_bytes.swap(0, Ordering::Relaxed)
    }
}

impl GpuBuffer {
    pub(crate) fn buffer(&self) -> &wgpu::Buffer {
        self.buffer.as_ref().expect("buffer present until drop")
    }
    /// Logical size in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
    /// The epoch in which the buffer was last freed (None for a fresh buffer).
    pub(crate) fn freed_epoch(&self) -> Option<u64> {
        self.freed_epoch
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.buffer.take() {
            self.pool.give_back(b);
        }
    }
}
