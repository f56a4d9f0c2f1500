//! Compiled pipelines, one per kernel variant, built on first use and cached.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use wgpipe_shaders::{Access, Kernel};

use super::context::WgpuContext;
use crate::error::Result;

/// A compiled kernel variant and its bind group layout.
pub(crate) struct Pipeline {
    pub(super) pipeline: wgpu::ComputePipeline,
    pub(super) layout: wgpu::BindGroupLayout,
    /// The bindings after the parameter block, in the order buffers are passed.
    pub(super) bindings: Vec<(u32, Access)>,
}

#[derive(Default)]
pub(crate) struct PipelineCache {
    map: Mutex<HashMap<Kernel, Arc<Pipeline>>>,
}

fn storage_entry(binding: u32, read_only: bool) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}

impl WgpuContext {
    /// The pipeline of `kernel`, compiled on first use. Shader or pipeline errors come back as
    /// `Error::Wgpu` (caught in an error scope).
    pub(super) fn pipeline(&self, kernel: Kernel) -> Result<Arc<Pipeline>> {
        if let Some(p) = self
            .pipelines
            .map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&kernel)
        {
            return Ok(p.clone());
        }
        // Compiled outside the lock (compilation can take a while); a racing thread may compile
        // the same variant, and the first insert wins.
        let built = Arc::new(self.build_pipeline(kernel)?);
        let mut map = self.pipelines.map.lock().unwrap_or_else(|p| p.into_inner());
        Ok(map.entry(kernel).or_insert(built).clone())
    }

    /// The kernels compiled on this device so far (tests: which variant ran).
    #[cfg(test)]
    pub(super) fn compiled_kernels(&self) -> Vec<Kernel> {
        let map = self.pipelines.map.lock().unwrap_or_else(|p| p.into_inner());
        map.keys().copied().collect()
    }

    fn build_pipeline(&self, kernel: Kernel) -> Result<Pipeline> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let source = kernel.source();
        let label = format!("{kernel:?}");
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(&label),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
        let bindings = kernel.bindings();
        let mut entries = vec![storage_entry(0, true)];
        entries.extend(
            bindings
                .iter()
                .map(|&(b, a)| storage_entry(b, a == Access::Read)),
        );
        let layout = self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(&label),
                entries: &entries,
            });
        let pipeline_layout = self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(&label),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(&label),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some(kernel.entry_point()),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(self.err(format!("compiling kernel {label} failed: {e}")));
        }
        Ok(Pipeline {
            pipeline,
            layout,
            bindings,
        })
    }
}
