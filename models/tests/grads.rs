//! Gradients of every layer and loss against central differences (f32, CPU).

mod common;

use common::*;
use wgpipe_autograd::ForwardCtx;
use wgpipe_models::layers::*;
use wgpipe_models::models::amoebanet::{Cell, CellShape};
use wgpipe_models::models::resnet::BasicBlock;
use wgpipe_models::{cross_entropy, mse};
use wgpipe_tensor::ops::Conv2dParams;

fn eval() -> ForwardCtx {
    ForwardCtx::eval()
}
fn train() -> ForwardCtx {
    ForwardCtx::train(1, 0, 0)
}

#[test]
fn linear() {
    let l = Linear::new(5, 3, 1, &cpu()).unwrap();
    grad_check_module(&l, &rand(&[2, 4, 5], 2), &eval(), true);
}

#[test]
fn layer_norm() {
    let ln = LayerNorm::new(6, &cpu()).unwrap();
    ln.weight.set_value(rand(&[6], 3));
    ln.bias.set_value(rand(&[6], 4));
    grad_check_module(&ln, &rand(&[3, 6], 5), &eval(), true);
}

#[test]
fn embedding_and_positions() {
    let e = TokenPositionEmbedding::new(7, 4, 3, 0.0, 1, &cpu()).unwrap();
    let ids = t(&[0., 6., 3., 3., 1., 2.], &[2, 3]);
    grad_check_module(&e, &ids, &eval(), false);
}

#[test]
fn attention() {
    let a = CausalSelfAttention::new(4, 2, 0.0, 1, &cpu()).unwrap();
    grad_check_module(&a, &rand(&[2, 3, 4], 6), &eval(), true);
}

#[test]
fn transformer_block_with_dropout() {
    // Dropout in training: the mask is replayed from ctx, so differences are well defined.
    let b = TransformerBlock::new(4, 2, 0.2, 1, &cpu()).unwrap();
    grad_check_module(&b, &rand(&[2, 3, 4], 7), &train(), true);
}

#[test]
fn conv2d_stride_padding_groups() {
    let c = grouped_strided_conv((3, 2), 3);
    grad_check_module(&c, &rand(&[2, 4, 5, 4], 8), &eval(), true);
    let d = Conv2d::with_params(
        3,
        3,
        (3, 3),
        Conv2dParams {
            padding: (2, 2),
            dilation: (2, 2),
            groups: 3,
            ..Conv2dParams::default()
        },
        false,
        4,
        &cpu(),
    )
    .unwrap();
    grad_check_module(&d, &rand(&[1, 3, 4, 4], 9), &eval(), true);
}

#[test]
fn batchnorm_train_and_eval() {
    let bn = BatchNorm2d::new(3, &cpu()).unwrap();
    bn.weight.set_value(rand(&[3], 10));
    bn.bias.set_value(rand(&[3], 11));
    grad_check_module(&bn, &rand(&[4, 3, 2, 2], 12), &train(), true);
    bn.running_var
        .set_value(rand(&[3], 13).abs().unwrap().add_scalar(0.5).unwrap());
    grad_check_module(&bn, &rand(&[4, 3, 2, 2], 14), &eval(), true);
}

#[test]
fn pools() {
    // Distinct values spaced far apart, so no max changes under the perturbation.
    let v: Vec<f32> = (0..50).map(|i| ((i * 37) % 50) as f32 * 0.1).collect();
    let x = t(&v, &[1, 2, 5, 5]);
    grad_check_module(&MaxPool2d::new(3, 2, 1), &x, &eval(), true);
    grad_check_module(&AvgPool2d::new(3, 2, 1), &x, &eval(), true);
    grad_check_module(&GlobalAvgPool, &x, &eval(), true);
    grad_check_module(&Flatten::default(), &x, &eval(), true);
}

#[test]
fn composite_blocks() {
    let dev = cpu();
    let b = BasicBlock::new(2, 4, 2, 1, &dev).unwrap();
    // ReLUs after batch norm sit near their kink: a small step keeps differences one-sided.
    grad_check_module_eps(&b, &rand(&[2, 2, 4, 4], 15), &train(), false, 1e-3);
    // A reduction cell alone reads its input as both h_(i-1) and h_(i-2).
    let shape = CellShape {
        c_prev_prev: 2,
        c_prev: 2,
        c: 4,
        reduction: true,
        reduction_prev: false,
    };
    let c = Cell::new(shape, None, None, 2, &dev).unwrap();
    grad_check_module_eps(&c, &rand(&[2, 2, 4, 4], 16), &train(), false, 1e-3);
}

#[test]
fn losses() {
    let targets = t(&[2., 0., 1., 2.], &[2, 2]);
    grad_check_fn(|x| cross_entropy(x, &targets), &rand(&[2, 2, 3], 17));
    let target = rand(&[3, 2], 18);
    grad_check_fn(|x| mse(x, &target), &rand(&[3, 2], 19));
}
