//! Reproduces the *shape* of GPipe's Tables 1-3 (Huang et al., 2018) on a simulated cluster.
//!
//! Real arithmetic on the CPU, simulated time: every virtual accelerator of a [`SimCluster`] does
//! its arithmetic on the host CPU but has its own FLOP counter, memory cap and clock; the step
//! time is the simulated makespan of the GPipe schedule over the measured FLOPs and bytes.
//!
//! * Table 2: normalised throughput (samples / simulated step time) of a Transformer LM and an
//!   AmoebaNet-D-style CNN for K = 1, 2, 4, 8 and M = 1, 4, 32, re-materialization on, free links.
//! * Table 3: the same at M = 32 over a PCIe-like link (10 GB/s, 10 us).
//! * Table 1: the largest number of Transformer blocks that trains (two Adam steps without an
//!   `OutOfMemory`) on K devices of a stated capacity, naive (no re-materialization, M = 1)
//!   against re-materialized (M = 8), found by doubling then bisection.
//!
//! `cargo run --release --example bench_gpipe_tables` (a few minutes on 2 cores).

use std::time::Instant;

use wgpipe::autograd::{Adam, Module};
use wgpipe::models::{cross_entropy, parameter_count, AmoebaNet, TransformerLm};
use wgpipe::pipeline::{Balance, CheckpointMode, LinkSpec, LossFn, Pipeline, SimCluster};
use wgpipe::tensor::{Device, Tensor};

type Res<T> = Result<T, Box<dyn std::error::Error>>;
type Layers = Vec<Box<dyn Module>>;

/// Compute rate of one virtual accelerator: a 15 TFLOP/s V100 scaled down 32x, because our
/// Transformer is 32x narrower (d_model 64 vs 2048) and so does 32x fewer FLOPs per byte of
/// boundary activation; this keeps compute : link time per hand-off at the paper's scale.
const RATE: f64 = 15e12 / 32.0;
/// PCIe-3-like link without NVLink (Table 3).
const PCIE: LinkSpec = LinkSpec {
    bandwidth_bytes_per_sec: 10e9,
    latency_sec: 10e-6,
};
const KS: [usize; 4] = [1, 2, 4, 8];
const MS: [usize; 3] = [1, 4, 32];

/// Table 2's Transformer: the paper's 48 is cut to 24 blocks of a tiny width.
const LM_BLOCKS: usize = 24;
const D_MODEL: usize = 64;
const HEADS: usize = 4;
const SEQ: usize = 32;
const VOCAB: usize = 64;
/// Mini-batch (sequences / images); M = 32 gives 2 per micro-batch.
const BATCH: usize = 64;

/// Table 1: per-device memory and batch.
const CAP_MIB: usize = 24;
const T1_BATCH: usize = 32;
const T1_REMAT_M: usize = 8;

fn lm(blocks: usize) -> TransformerLm {
    TransformerLm {
        vocab: VOCAB,
        d_model: D_MODEL,
        heads: HEADS,
        layers: blocks,
        seq_len: SEQ,
        dropout: 0.0,
        tie_embeddings: true,
    }
}

fn amoeba() -> AmoebaNet {
    AmoebaNet {
        normal_cells: AMOEBA_N,
        filters: AMOEBA_F,
        num_classes: 10,
        in_channels: 3,
    }
}
const AMOEBA_N: usize = 6;
const AMOEBA_F: usize = 16;
const IMG: usize = 16;

/// Token ids `[n, SEQ]` (and next-token-ish targets), deterministic.
fn tokens(n: usize, salt: usize) -> Res<Tensor> {
    let v: Vec<f32> = (0..n * SEQ)
        .map(|i| ((i * 7 + salt * 13 + (i / SEQ) * 3) % VOCAB) as f32)
        .collect();
    Ok(Tensor::from_vec(v, &[n, SEQ], &Device::cpu())?)
}

/// One model family for Table 2.
struct Family {
    name: String,
    make: Box<dyn Fn() -> Res<Layers>>,
    x: Tensor,
    y: Tensor,
    /// The micro-batch input shape without the batch axis (for `Balance::ByFlops`).
    item_shape: Vec<usize>,
    paper: [[f64; 3]; 3],
    paper_t3: [f64; 3],
}

/// The simulated step (forward + backward of every micro-batch) of `fam` on K devices.
fn sim_step(fam: &Family, k: usize, m: usize, link: LinkSpec) -> Res<(f64, f64, Vec<usize>)> {
    let cluster = SimCluster::uniform(&Device::cpu(), k, u64::MAX, RATE, link);
    let mut shape = vec![BATCH / m];
    shape.extend(&fam.item_shape);
    let mut pipe = Pipeline::builder((fam.make)()?)
        .sim(cluster)
        .balance(Balance::ByFlops { input_shape: shape })
        .micro_batches(m)
        .checkpoint(CheckpointMode::Always)
        .build()?;
    let loss: &LossFn = &cross_entropy;
    let r = pipe.train_step(&fam.x, &fam.y, loss)?;
    let sim = r.simulated.as_ref().ok_or("no simulated report")?;
    Ok((sim.makespan_secs, sim.bubble_fraction, pipe.balance()))
}

fn table2(fam: &Family) -> Res<()> {
    let t0 = Instant::now();
    // throughput[m][k] in samples per simulated second.
    let mut thr = [[0.0f64; 4]; 3];
    let mut bub = [[0.0f64; 4]; 3];
    let mut bal8 = Vec::new();
    for (mi, &m) in MS.iter().enumerate() {
        for (ki, &k) in KS.iter().enumerate() {
            let (t, b, bal) = sim_step(fam, k, m, LinkSpec::FREE)?;
            thr[mi][ki] = BATCH as f64 / t;
            bub[mi][ki] = b;
            if k == 8 {
                bal8 = bal;
            }
        }
    }
    let base = thr[0][1];
    println!(
        "\n### Table 2: {} (free links, re-materialization on)\n",
        fam.name
    );
    println!("Normalised to K=2, M=1 (as in the paper); paper's value in brackets; simulated bubble after the slash.\n");
    println!("| M | K=1 | K=2 | K=4 | K=8 |");
    println!("|---|---|---|---|---|");
    for (mi, &m) in MS.iter().enumerate() {
        let mut row = format!(
            "| M={m} | {:.2} / {:.0}% ",
            thr[mi][0] / base,
            bub[mi][0] * 100.0
        );
        for ki in 1..4 {
            row += &format!(
                "| {:.2} [{}] / {:.0}% ",
                thr[mi][ki] / base,
                fam.paper[mi][ki - 1],
                bub[mi][ki] * 100.0
            );
        }
        println!("{row}|");
    }
    println!(
        "\nK=1 sits below K=2, M=1 (and M=1 gains a little with K) because a stage re-computes a \
         micro-batch while it waits for that micro-batch's gradient; K=1 has no wait to hide it in."
    );
    println!(
        "K=2, M=1: {:.0} samples/s simulated; balance at K=8: {bal8:?}; wall {:.1} s",
        base,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn table3(fams: &[Family]) -> Res<()> {
    let t0 = Instant::now();
    println!("\n### Table 3: M=32 over a PCIe-like link (10 GB/s, 10 us latency) vs free links\n");
    println!("Normalised to K=2 of the same link; paper (GPUs without NVLink) in brackets.\n");
    println!("| model | link | K=2 | K=4 | K=8 |");
    println!("|---|---|---|---|---|");
    for fam in fams {
        for (name, link) in [("PCIe", PCIE), ("free", LinkSpec::FREE)] {
            let thr: Vec<f64> = [2, 4, 8]
                .iter()
                .map(|&k| sim_step(fam, k, 32, link).map(|r| BATCH as f64 / r.0))
                .collect::<Res<_>>()?;
            let cell = |i: usize| {
                if name == "PCIe" {
                    format!("{:.2} [{}]", thr[i] / thr[0], fam.paper_t3[i])
                } else {
                    format!("{:.2}", thr[i] / thr[0])
                }
            };
            println!(
                "| {} | {name} | {} | {} | {} |",
                fam.name,
                cell(0),
                cell(1),
                cell(2)
            );
        }
    }
    println!("\nwall {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}

/// Whether a Transformer of `blocks` blocks trains on `k` devices of `CAP_MIB` MiB: two full
/// steps (forward, backward, Adam update) without an `OutOfMemory`. Other errors are errors.
fn fits(blocks: usize, k: usize, remat: bool) -> Res<bool> {
    let (mode, m) = if remat {
        (CheckpointMode::Always, T1_REMAT_M)
    } else {
        (CheckpointMode::Never, 1)
    };
    let cap = (CAP_MIB << 20) as u64;
    let cluster = SimCluster::uniform(&Device::cpu(), k, cap, RATE, LinkSpec::FREE);
    let x = tokens(T1_BATCH, 0)?;
    let y = tokens(T1_BATCH, 5)?;
    let loss: &LossFn = &cross_entropy;
    let run = || -> Res<()> {
        let mut pipe = Pipeline::builder(lm(blocks).build(1, &Device::cpu())?)
            .sim(cluster)
            .balance(Balance::ByMemory {
                input_shape: vec![T1_BATCH / m, SEQ],
                optimizer_factor: 4.0,
            })
            .micro_batches(m)
            .checkpoint(mode)
            .optimizer(|| Box::new(Adam::new(1e-3)))
            .build()?;
        pipe.train_step(&x, &y, loss)?;
        pipe.optimizer_step()?;
        pipe.train_step(&x, &y, loss)?;
        pipe.optimizer_step()?;
        Ok(())
    };
    match run() {
        Ok(()) => Ok(true),
        Err(e) if e.to_string().contains("out of memory") => Ok(false),
        Err(e) => Err(e),
    }
}

/// The largest block count that fits (0 if even the smallest that can be cut into `k` stages
/// does not): doubling, then bisection.
fn largest(k: usize, remat: bool) -> Res<(usize, usize)> {
    let mut trials = 0;
    let mut probe = |n: usize| {
        trials += 1;
        fits(n, k, remat)
    };
    // The model has blocks + 3 elements; K stages need at least K of them.
    let mut lo = k.saturating_sub(3).max(1);
    if !probe(lo)? {
        return Ok((0, trials));
    }
    let mut hi = lo * 2;
    while probe(hi)? {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if probe(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok((lo, trials))
}

fn table1() -> Res<()> {
    let t0 = Instant::now();
    println!(
        "\n### Table 1: largest Transformer that trains, {CAP_MIB} MiB per device (d_model {D_MODEL}, {HEADS} heads, seq {SEQ}, vocab {VOCAB}, batch {T1_BATCH}, Adam)\n"
    );
    println!("Naive: no re-materialization (CheckpointMode::Never), M=1. Re-mat: CheckpointMode::Always, M={T1_REMAT_M}. Cut balanced by memory (params x 4 + activations). \"Trains\" = two Adam steps without OutOfMemory.\n");
    println!("| K | naive blocks (params) | re-mat blocks (params) | re-mat / naive | paper |");
    println!("|---|---|---|---|---|");
    let paper = [
        "Naive-1: 3 (282M), Pipeline-1: 13 (786M)",
        "",
        "",
        "Pipeline-8: 103 (5.3B)",
    ];
    for (i, &k) in KS.iter().enumerate() {
        let (naive, tn) = largest(k, false)?;
        let (remat, tr) = largest(k, true)?;
        let params = |n: usize| -> Res<String> {
            if n == 0 {
                return Ok("-".into());
            }
            let p = parameter_count(&lm(n).build(1, &Device::cpu())?);
            Ok(format!("{n} ({:.2}M)", p as f64 / 1e6))
        };
        let ratio = if naive > 0 {
            format!("{:.1}x", remat as f64 / naive as f64)
        } else {
            "-".into()
        };
        println!(
            "| {k} | {} | {} | {ratio} | {} |",
            params(naive)?,
            params(remat)?,
            paper[i]
        );
        eprintln!(
            "  (K={k}: {tn} + {tr} trial runs, {:.1} s so far)",
            t0.elapsed().as_secs_f64()
        );
    }
    println!("\nwall {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}

fn main() -> Res<()> {
    let t0 = Instant::now();
    println!("# GPipe tables, simulated (real arithmetic on the CPU, simulated time)\n");
    println!(
        "Virtual accelerator: {:.3} TFLOP/s (a 15 TFLOP/s V100 scaled by 1/32, see source), no memory cap for Tables 2-3. \
         Links: free (infinite bandwidth, 0 latency) for Table 2; PCIe-like 10 GB/s + 10 us for Table 3. \
         The model and the mini-batch ({BATCH}) are FIXED across K (the paper scales the batch to memory); \
         stages are cut by FLOPs; re-materialization = CheckpointMode::Always; GPipe fill-drain schedule. \
         Simulated step = forward + recompute + backward of all micro-batches (the optimizer update is not in it).",
        RATE / 1e12
    );
    let lm_make = || -> Res<Layers> { Ok(lm(LM_BLOCKS).build(1, &Device::cpu())?) };
    let am_make = || -> Res<Layers> { Ok(amoeba().build(1, &Device::cpu())?) };
    let lm_params = parameter_count(&lm_make()?);
    let am_params = parameter_count(&am_make()?);
    let fams = [
        Family {
            name: format!(
                "Transformer ({LM_BLOCKS} blocks, d {D_MODEL}, seq {SEQ}, {:.2}M params)",
                lm_params as f64 / 1e6
            ),
            make: Box::new(lm_make),
            x: tokens(BATCH, 0)?,
            y: tokens(BATCH, 5)?,
            item_shape: vec![SEQ],
            paper: [[1.0, 1.07, 1.3], [1.7, 3.2, 4.8], [1.8, 3.4, 6.3]],
            paper_t3: [1.0, 1.8, 3.3],
        },
        Family {
            name: format!(
                "AmoebaNet-D ({AMOEBA_N} normal cells/stage, {AMOEBA_F} filters, {IMG}x{IMG} images, {:.2}M params)",
                am_params as f64 / 1e6
            ),
            make: Box::new(am_make),
            x: Tensor::rand_normal(&[BATCH, 3, IMG, IMG], 0.0, 1.0, 7, &Device::cpu())?,
            y: Tensor::from_vec(
                (0..BATCH).map(|i| (i % 10) as f32).collect(),
                &[BATCH],
                &Device::cpu(),
            )?,
            item_shape: vec![3, IMG, IMG],
            paper: [[1.0, 1.13, 1.38], [1.07, 1.26, 1.72], [1.21, 1.84, 3.48]],
            paper_t3: [1.0, 1.7, 2.7],
        },
    ];
    for fam in &fams {
        table2(fam)?;
    }
    table3(&fams)?;
    table1()?;
    println!("\ntotal wall time {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}
