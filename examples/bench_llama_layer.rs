//! A Llama decoder layer's forward + backward on the CPU, timed: the benchmark of issue 57,
//! beside transformers' `LlamaDecoderLayer` (`scripts/bench_llama_layer.py`) at the same shape
//! (`scripts/bench_llama_shape.py`) on the same cores.
//!
//! `cargo run --release --example bench_llama_layer -- [ITERS] [f32|bf16]` prints the median
//! milliseconds of one step (forward, backward of `sum(out * r)`) after warm-up.

use std::time::Instant;

use wgpipe::autograd::{ForwardCtx, Tape};
use wgpipe::models::models::{LlamaDecoderLayer, LlamaLayerConfig};
use wgpipe::models::RopeScaling;
use wgpipe::tensor::{DType, Device, Tensor};

// The same numbers as scripts/bench_llama_shape.py.
const B: usize = 4;
const T: usize = 256;
const HIDDEN: usize = 512;
const HEADS: usize = 8;
const KV_HEADS: usize = 4;
const INTER: usize = 1408;

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let iters: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(20);
    let dtype = match args.next().as_deref() {
        None | Some("f32") => DType::F32,
        Some("bf16") => DType::BF16,
        Some(other) => return Err(format!("dtype {other:?}: f32 or bf16").into()),
    };
    let cpu = Device::cpu();
    let cfg = LlamaLayerConfig {
        hidden_size: HIDDEN,
        intermediate_size: INTER,
        num_attention_heads: HEADS,
        num_key_value_heads: KV_HEADS,
        head_dim: HIDDEN / HEADS,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::Default,
        attention_bias: false,
        mlp_bias: false,
    };
    let layer = LlamaDecoderLayer::random(&cfg, 0, &cpu)?;
    let x = Tensor::rand_normal(&[B, T, HIDDEN], 0.0, 1.0, 1, &cpu)?;
    let r = Tensor::rand_normal(&[B, T, HIDDEN], 0.0, 1.0, 2, &cpu)?;
    let ctx = ForwardCtx::train(0, 0, 0).with_compute(dtype);
    let step = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let tape = Tape::new();
        let h = tape.leaf(x.clone()).to_dtype(dtype)?;
        let y = layer.forward(&h, &ctx)?.to_dtype(DType::F32)?;
        let loss = y.mul(&tape.constant(r.clone()))?.sum_all()?;
        tape.backward(&loss)?;
        for (_, p) in wgpipe::autograd::Module::parameters(&layer) {
            p.zero_grad();
        }
        Ok(())
    };
    wgpipe::tensor::on_cpu_pool(|| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        for _ in 0..3 {
            step()?;
        }
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t0 = Instant::now();
            step()?;
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        let dt = if dtype == DType::F32 { "f32" } else { "bf16" };
        println!(
            "wgpipe LlamaDecoderLayer {dt} B={B} T={T} hidden={HIDDEN}: {:.2} ms ({} threads)",
            times[times.len() / 2],
            wgpipe::tensor::cpu_threads()
        );
        Ok(())
    })
}
