//! Split backward (input part now, weight part later, as zero-bubble pipelines run it) must give
//! exactly the gradients of the full backward, bit for bit, for every op family with parameters,
//! and the input part alone must leave every parameter gradient untouched.

use wgpipe_autograd::tensor::ops::{Conv2dParams, Pool2dParams};
use wgpipe_autograd::tensor::{Device, Result, Tensor};
use wgpipe_autograd::{Param, Tape, Var};

/// Deterministic values in about [-1, 1] (a multiplicative hash of the index and seed).
fn values(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n as u64)
        .map(|i| {
            let h = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ seed.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::cpu()).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec().unwrap().into_iter().map(f32::to_bits).collect()
}

/// A graph: `(tape, input leaf, params) -> output`.
type Graph = fn(&Tape, &Var, &[Param]) -> Result<Var>;

/// Runs `graph` with a full backward and with a split one (checking that the input part gives
/// no parameter gradient), and compares input and parameter gradients bit for bit.
fn check(name: &str, input_shape: &[usize], param_shapes: &[&[usize]], graph: Graph) {
    let make_params = || -> Vec<Param> {
        param_shapes
            .iter()
            .enumerate()
            .map(|(i, s)| Param::new(format!("p{i}"), values(s, 100 + i as u64)))
            .collect()
    };
    let x = values(input_shape, 7);
    let run = |split: bool| -> (Vec<u32>, Vec<Vec<u32>>) {
        let params = make_params();
        let tape = Tape::new();
        let input = tape.leaf(x.clone());
        let out = graph(&tape, &input, &params).unwrap();
        let g = values(out.shape(), 11);
        let gx = if split {
            let (grads, weights) = tape.backward_split(&out, &g).unwrap();
            for p in &params {
                assert!(
                    p.grad().is_none(),
                    "{name}: input part wrote {}'s gradient",
                    p.name()
                );
            }
            assert!(
                !weights.is_empty(),
                "{name}: nothing deferred to the weight part"
            );
            weights.run().unwrap();
            grads.get(&input).cloned()
        } else {
            tape.backward_with(&out, &g).unwrap().get(&input).cloned()
        };
        let gx = bits(&gx.unwrap_or_else(|| panic!("{name}: no input gradient")));
        let gp = params
            .iter()
            .map(|p| {
                bits(
                    &p.grad()
                        .unwrap_or_else(|| panic!("{name}: {} has no gradient", p.name())),
                )
            })
            .collect();
        (gx, gp)
    };
    let (full_x, full_p) = run(false);
    let (split_x, split_p) = run(true);
    assert_eq!(full_x, split_x, "{name}: input gradients differ");
    assert_eq!(full_p, split_p, "{name}: parameter gradients differ");
}

#[test]
fn linear_with_broadcast_bias_and_activations() {
    check("linear", &[4, 6], &[&[6, 5], &[5]], |t, x, p| {
        let w = t.stored_param(&p[0]);
        let b = t.stored_param(&p[1]);
        x.matmul(&w)?.add(&b)?.gelu()?.tanh()?.relu()
    });
}

#[test]
fn layer_norm_and_softmax() {
    check("layer_norm", &[3, 8], &[&[8], &[8]], |t, x, p| {
        let (g, b) = (t.stored_param(&p[0]), t.stored_param(&p[1]));
        x.layer_norm(&g, &b, 1e-5)?.softmax(-1)?.log()
    });
}

#[test]
fn parameter_transformed_before_use() {
    // The transpose and the scaling of the weight are parameter-only nodes: their gradients
    // come in the weight part.
    check("transformed weight", &[2, 3], &[&[4, 3]], |t, x, p| {
        let w = t.stored_param(&p[0]).t()?.mul_scalar(0.5)?;
        x.matmul(&w)?.square()
    });
}

#[test]
fn split_of_a_packed_weight_and_of_the_data() {
    // Multi-output nodes on both sides: the weight's split (parameter-only) runs in the weight
    // part, the data's in the input part; one piece of each goes unused.
    check("split", &[2, 9], &[&[3, 9]], |t, x, p| {
        let w = t.stored_param(&p[0]).split(3, 1)?;
        let xs = x.chunk(3, 1)?;
        let h = xs[0].matmul(&w[0])?.add(&xs[2].matmul(&w[2])?)?.tanh()?;
        h.matmul(&w[0].t()?)
    });
}

#[test]
fn parameter_used_twice_and_times_itself() {
    check("tied", &[2, 4], &[&[4, 4], &[4]], |t, x, p| {
        let w = t.stored_param(&p[0]);
        let s = t.stored_param(&p[1]).mul(&t.stored_param(&p[1]))?;
        let h = x.matmul(&w)?.mul(&s)?.sigmoid()?;
        h.matmul(&w)?.add(x)
    });
}

#[test]
fn embedding_lookup() {
    // Stage 0 of a language model: the input is data (token ids as constants), the table a
    // parameter; the lookup's output is data, so the layers after it run in the input part.
    check("embedding", &[3, 4], &[&[10, 4]], |t, x, p| {
        let ids = Tensor::from_vec(vec![1.0, 7.0, 3.0], &[3], &Device::cpu())?;
        let e = t.stored_param(&p[0]).index_select(0, &ids)?;
        e.add(x)?.mul(&e)
    });
}

#[test]
fn conv_and_pool() {
    check(
        "conv2d",
        &[2, 2, 5, 5],
        &[&[3, 2, 3, 3], &[3]],
        |t, x, p| {
            let conv = Conv2dParams {
                padding: (1, 1),
                ..Conv2dParams::default()
            };
            let pool = Pool2dParams {
                kernel: (2, 2),
                stride: (2, 2),
                padding: (0, 0),
            };
            let (w, b) = (t.stored_param(&p[0]), t.stored_param(&p[1]));
            x.conv2d(&w, Some(&b), conv)?.relu()?.max_pool2d(pool)
        },
    );
}

#[test]
fn split_backward_frees_what_the_weight_part_does_not_need() {
    // A chain of data-only ops after the last parameter use: none of them is deferred.
    let p = Param::new("w", values(&[4, 4], 1));
    let tape = Tape::new();
    let x = tape.leaf(values(&[2, 4], 2));
    let y = x.matmul(&tape.stored_param(&p)).unwrap();
    let out = y.relu().unwrap().exp().unwrap().tanh().unwrap();
    let (_, weights) = tape.backward_split(&out, &values(&[2, 4], 3)).unwrap();
    assert_eq!(
        weights.len(),
        1,
        "only the matmul has a parameter-side input"
    );
}

#[test]
fn split_backward_is_once_per_tape() {
    let tape = Tape::new();
    let x = tape.leaf(values(&[2], 1));
    let y = x.square().unwrap();
    let g = values(&[2], 2);
    tape.backward_split(&y, &g).unwrap();
    let e = tape
        .backward_split(&y, &g)
        .err()
        .expect("second backward must fail");
    assert!(e.to_string().contains("backward already ran"), "{e}");
}

#[test]
fn output_computed_from_parameters_alone() {
    // An embedding lookup whose ids are a plain tensor: nothing depends on data, so the input
    // part has nothing to do and the weight part must start from the seed itself.
    let run = |split: bool| -> Vec<u32> {
        let table = Param::new("table", values(&[6, 3], 1));
        let tape = Tape::new();
        let ids = Tensor::from_vec(vec![0.0, 4.0, 4.0], &[3], &Device::cpu()).unwrap();
        let out = tape
            .stored_param(&table)
            .index_select(0, &ids)
            .unwrap()
            .tanh()
            .unwrap()
            .sum_all()
            .unwrap();
        let seed = Tensor::ones(&[], &Device::cpu()).unwrap();
        let seed = seed.reshape(out.shape()).unwrap();
        if split {
            let (_, weights) = tape.backward_split(&out, &seed).unwrap();
            assert!(table.grad().is_none());
            weights.run().unwrap();
        } else {
            tape.backward_with(&out, &seed).unwrap();
        }
        bits(&table.grad().expect("the table has a gradient"))
    };
    assert_eq!(run(false), run(true));
}

#[test]
fn a_lookup_marked_as_data_moves_the_work_after_it_to_the_input_part() {
    // As an embedding layer does: the rows looked up by data ids count as data, so the ops
    // after the lookup run in the input part and only the table's gradient is deferred.
    let run = |split: bool| -> Vec<u32> {
        let table = Param::new("table", values(&[6, 3], 1));
        let w = Param::new("w", values(&[3, 3], 2));
        let tape = Tape::new();
        let ids = Tensor::from_vec(vec![0.0, 4.0, 4.0], &[3], &Device::cpu()).unwrap();
        let rows = tape
            .stored_param(&table)
            .index_select(0, &ids)
            .unwrap()
            .depending_on_data();
        assert!(rows.is_data());
        let out = rows.matmul(&tape.stored_param(&w)).unwrap().tanh().unwrap();
        let seed = values(out.shape(), 3);
        if split {
            let (_, weights) = tape.backward_split(&out, &seed).unwrap();
            assert_eq!(
                weights.len(),
                2,
                "the matmul and the lookup wait for the weight part"
            );
            weights.run().unwrap();
        } else {
            tape.backward_with(&out, &seed).unwrap();
        }
        let mut b = bits(&table.grad().unwrap());
        b.extend(bits(&w.grad().unwrap()));
        b
    };
    assert_eq!(run(false), run(true));
}
