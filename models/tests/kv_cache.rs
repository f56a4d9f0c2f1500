//! Cached decoding (issue 58): a Llama fed its prompt once and then one token per call, each
//! call's keys and values kept per micro-batch in its attention layers, gives the logits of the
//! full forward over the whole sequence at every position; calls out of order and attention
//! layers that keep no cache are refused.

mod common;

use common::*;
use wgpipe_autograd::{ForwardCtx, Tape};
use wgpipe_models::forward_all;
use wgpipe_models::hf::{load_gpt2, load_llama};
use wgpipe_tensor::{DType, Device, Tensor};

fn ids(v: &[u32], dev: &Device) -> Tensor {
    let f: Vec<f32> = v.iter().map(|&i| i as f32).collect();
    Tensor::from_vec(f, &[1, v.len()], dev).unwrap()
}

#[test]
fn cached_logits_equal_the_full_forward_at_every_position() {
    let dir = fixture_path("llama_tok");
    let (_, layers) = load_llama(&dir, 0..5, &cpu()).unwrap();
    // All 128 positions the model takes: the cache's buffers grow from 64 positions to 128.
    let seq: Vec<u32> = (0..128).map(|i| (i * 37 + 5) % 384).collect();
    let tape = Tape::no_grad();
    let full = forward_all(
        &layers,
        &tape.constant(ids(&seq, &cpu())),
        &ForwardCtx::eval(),
    )
    .unwrap();
    let full = vals(full.value()); // [1, 128, 384]
    let v = 384;
    for (mb, prompt) in [(0u64, 6usize), (1, 1)] {
        let ctx = ForwardCtx {
            micro_batch: mb,
            ..ForwardCtx::eval()
        };
        let pre = forward_all(
            &layers,
            &tape.constant(ids(&seq[..prompt], &cpu())),
            &ctx.at_kv_position(0),
        )
        .unwrap();
        assert_near(&vals(pre.value()), &full[..prompt * v], 1e-5, "prefill");
        for p in prompt..seq.len() {
            let step = forward_all(
                &layers,
                &tape.constant(ids(&seq[p..p + 1], &cpu())),
                &ctx.at_kv_position(p),
            )
            .unwrap();
            assert_eq!(step.shape(), &[1, 1, v]);
            assert_near(
                &vals(step.value()),
                &full[p * v..(p + 1) * v],
                1e-5,
                &format!("micro-batch {mb} position {p}"),
            );
        }
    }
    // Under bf16 compute the cache holds bf16 keys and values; the logits stay within bf16's
    // reach of the f32 ones.
    let ctx = ForwardCtx::eval().with_compute(DType::BF16);
    forward_all(
        &layers,
        &tape.constant(ids(&seq[..4], &cpu())),
        &ctx.at_kv_position(0),
    )
    .unwrap();
    let step = forward_all(
        &layers,
        &tape.constant(ids(&seq[4..5], &cpu())),
        &ctx.at_kv_position(4),
    )
    .unwrap();
    let got = vals(&step.value().to_dtype(DType::F32).unwrap());
    assert_near(&got, &full[4 * v..5 * v], 4e-2, "bf16 position 4");
}

#[test]
fn out_of_order_calls_and_cacheless_attention_are_refused() {
    let dir = fixture_path("llama_tok");
    let (_, layers) = load_llama(&dir, 0..5, &cpu()).unwrap();
    let tape = Tape::no_grad();
    let run = |t: &[u32], p: usize, mb: u64| {
        let ctx = ForwardCtx {
            micro_batch: mb,
            ..ForwardCtx::eval()
        };
        forward_all(
            &layers,
            &tape.constant(ids(t, &cpu())),
            &ctx.at_kv_position(p),
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
    };
    let e = run(&[1], 3, 9).unwrap_err();
    assert!(e.contains("no KV cache for micro-batch 9"), "{e}");
    run(&[1, 2, 3], 0, 0).unwrap();
    let e = run(&[4], 5, 0).unwrap_err();
    assert!(e.contains("holds 3 positions; a call at position 5"), "{e}");
    let e = run(&[4, 5], 3, 0).unwrap_err();
    assert!(e.contains("one token per call"), "{e}");

    let (_, gpt2) = load_gpt2(&fixture_path("gpt2"), 0..5, &cpu()).unwrap();
    let e = forward_all(
        &gpt2,
        &tape.constant(ids(&[1, 2], &cpu())),
        &ForwardCtx::eval().at_kv_position(0),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("keeps no KV cache"), "{e}");
}
