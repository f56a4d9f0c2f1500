//! `share_cpu_threads`: kernels called by threads that share the CPU split their work over fewer
//! threads, and give the same bits as when they use the whole pool.

use wgpipe_tensor::rng::uniform_vec;
use wgpipe_tensor::{on_cpu_pool, share_cpu_threads, Device, Tensor};

fn t(shape: &[usize], seed: u64) -> Tensor {
    Tensor::from_vec(
        uniform_vec(seed, 0, shape.iter().product(), -1.0, 1.0),
        shape,
        &Device::cpu(),
    )
    .unwrap()
}

/// Ops whose CPU kernels choose how to split by the thread count: one big matmul (gemm's own
/// threads), many small ones (one per task), a transposed operand, elementwise work over the
/// parallel threshold, layer norm rows, an embedding gradient (index_add by columns), a bias
/// gradient (column sums).
fn workload() -> Vec<Vec<u32>> {
    let a = t(&[256, 200], 1);
    let b = t(&[200, 300], 2);
    let qa = t(&[16, 64, 32], 3);
    let qb = t(&[16, 32, 64], 4);
    let x = t(&[300, 256], 5);
    let g = t(&[256], 6);
    let idx = Tensor::from_vec(
        (0..600).map(|i| ((i * 7) % 50) as f32).collect(),
        &[600],
        &Device::cpu(),
    )
    .unwrap();
    let outs = [
        a.matmul(&b).unwrap(),
        qa.matmul(&qb).unwrap(),
        a.matmul(&t(&[300, 200], 7).t().unwrap()).unwrap(),
        x.mul(&x)
            .unwrap()
            .add(&x)
            .unwrap()
            .unary(wgpipe_tensor::UnaryOp::Gelu)
            .unwrap(),
        x.layer_norm(&g, &g, 1e-5).unwrap().0,
        Tensor::index_add(0, &idx, &t(&[600, 256], 8), 50).unwrap(),
        // a bias gradient: column sums, in bands of columns (past 512K values)
        t(&[2100, 256], 9).sum(&[0], false).unwrap(),
    ];
    outs.iter()
        .map(|o| o.to_vec().unwrap().iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// [`workload`] inside `depth` nested [`share_cpu_threads`] calls.
fn nested(depth: usize) -> Vec<Vec<u32>> {
    if depth == 0 {
        workload()
    } else {
        share_cpu_threads(|| nested(depth - 1))
    }
}

#[test]
fn kernels_give_the_same_bits_whatever_threads_they_share() {
    for pool_threads in [2, 4] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(pool_threads)
            .build()
            .unwrap();
        pool.install(|| {
            let whole = workload();
            // Nested calls on one thread count as that many sharing threads: 2 leaves each
            // kernel half the pool, `pool_threads` leaves it one thread (no rayon at all).
            let half = nested(2);
            assert_eq!(half, whole, "half of {pool_threads} threads");
            let one = nested(pool_threads);
            assert_eq!(one, whole, "one of {pool_threads} threads");
        });
    }
}

/// A global pool of at least two threads, so `on_cpu_pool` really moves to another thread
/// (this binary's other test uses pools of its own).
fn two_thread_global_pool() {
    // Already built (by an earlier call) is fine: it is built here or with one thread per core.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build_global();
    assert!(
        rayon::current_num_threads() >= 2,
        "the global pool runs {} thread(s); this test needs 2",
        rayon::current_num_threads()
    );
}

#[test]
fn on_cpu_pool_runs_on_a_pool_thread_and_gives_the_same_bits() {
    two_thread_global_pool();
    assert_eq!(
        rayon::current_thread_index(),
        None,
        "the test thread is outside the pool"
    );
    let outside = workload();
    let (index, inside) = on_cpu_pool(|| (rayon::current_thread_index(), workload()));
    assert!(index.is_some(), "f ran outside the pool");
    assert_eq!(inside, outside);
    // Nested: already on a pool thread, f runs right there.
    let nested = on_cpu_pool(|| {
        let here = rayon::current_thread_index();
        on_cpu_pool(move || rayon::current_thread_index() == here)
    });
    assert!(nested);
}

#[test]
fn a_panic_in_on_cpu_pool_reaches_the_caller() {
    two_thread_global_pool();
    let r = std::panic::catch_unwind(|| on_cpu_pool(|| -> u32 { panic!("boom in the pool") }));
    let msg = r.expect_err("the panic was lost");
    assert_eq!(msg.downcast_ref::<&str>(), Some(&"boom in the pool"));
    // The pool still works.
    assert_eq!(on_cpu_pool(|| 7), 7);
}
