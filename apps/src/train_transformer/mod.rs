//! The main job: a character-level Transformer LM trained through a K-stage pipeline.
//!
//! `cargo run --release --example train_transformer -- --help` lists the flags. [`run`] is the
//! whole program (the example's `main` only parses the flags), so tests call it directly.
//!
//! Here: the flags, their checks, the data and the run, one function per phase; in
//! `sampling.rs` the text sampled from the trained model.

mod sampling;

use std::path::PathBuf;

use clap::Parser;

use crate::autograd::optim::{AdamConfig, LrSchedule};
use crate::autograd::{AdamW, Var};
use crate::bail;
use std::sync::atomic::AtomicBool;

use crate::args::{describe_replicas, describe_stages, Model, PipelineArgs};
use crate::error::{AppError, AppResult, Context};
use crate::files::{load_pipeline, save_pipeline};
use crate::limits::{check_memory, check_range, check_real, memory_limit_bytes, MemoryPart};
use crate::lm::{held_out_loss, ids_tensor};
use crate::metrics::write_curves;
use crate::models::data::TextDataset;
use crate::models::{cross_entropy, TransformerLm};
use crate::output::{out_path, report_outputs};
use crate::pipeline::{LossFn, Pipeline, PlanReport, StepReport};
use crate::placement::Placement;
use crate::plan::{build_or_plan, print_predicted_vs_measured, PlanRun};
use crate::tensor::{Device, Tensor};
use crate::train::{ctrl_c_flag, train_loop, LoopConfig, LoopResult};
use sampling::sample_after_training;

/// Characters of the built-in synthetic corpus (see `wgpipe_models::data::text`).
pub const SYNTHETIC_CHARS: usize = 300_000;

#[derive(Parser, Clone, Debug)]
#[command(
    args_override_self = true,
    name = "train_transformer",
    about = "Train a character-level Transformer LM through a GPipe pipeline (K stages, M micro-batches)"
)]
pub struct TransformerArgs {
    #[command(flatten)]
    pub pipe: PipelineArgs,
    /// Transformer blocks (the model has layers + 3 elements: embedding, blocks, norm, head;
    /// 1..=1024).
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Model width (1..=16384).
    #[arg(long, default_value_t = 64)]
    pub d_model: usize,
    /// Attention heads (must divide --d-model; 1..=1024).
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Context length in tokens (1..=65536).
    #[arg(long, default_value_t = 64)]
    pub seq_len: usize,
    /// Total training steps (a resumed run continues up to this step).
    #[arg(long, default_value_t = 400)]
    pub steps: u64,
    /// Sequences per mini-batch (split into --micro-batches; 1..=1048576).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Peak learning rate of AdamW (linear warm-up, then cosine decay to a tenth; 0..=10).
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f32,
    /// Dropout probability (masks are keyed by seed, step, micro-batch and layer, so recompute
    /// and --resume replay them exactly).
    #[arg(long, default_value_t = 0.0)]
    pub dropout: f32,
    /// A UTF-8 text file to train on, byte-level (default: the built-in synthetic corpus).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Characters of text to sample from the trained model (0..=100000).
    #[arg(long, default_value_t = 160)]
    pub sample_len: usize,
    /// Sampling temperature (0 = greedy; 0..=100).
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f32,
    /// Give the head its own weight and bias instead of the token embedding table (tied by
    /// default, as GPT-2: the first and last stage hold copies whose gradients are summed).
    #[arg(long)]
    pub untie_embeddings: bool,
}

impl TransformerArgs {
    /// The flags as parsed from `args` (without the program name).
    pub fn parse_from_args<I, S>(args: I) -> AppResult<TransformerArgs>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        crate::args::parse_args("train_transformer", args)
    }

    /// The flags of this process's command line, noting whether the pipeline's shape was
    /// given (for `--plan auto`); exits with clap's message on bad flags.
    pub fn from_command_line() -> TransformerArgs {
        let (mut args, matches) = crate::args::from_command_line::<TransformerArgs>();
        args.pipe.shape_given = crate::plan::shape_given(&matches);
        args
    }
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// The step the run started from (non-zero when resumed).
    pub start_step: u64,
    /// Loss of every step run, in order.
    pub losses: Vec<f32>,
    /// Mean loss on held-out text after training.
    pub eval_loss: f32,
    /// `ln(vocab)`: the loss of guessing uniformly.
    pub uniform_loss: f32,
    pub tokens_per_sec: f64,
    pub wall_secs: f64,
    pub sample: String,
    pub trace: PathBuf,
    pub timeline: PathBuf,
    /// Stopped by Ctrl-C before `--steps`.
    pub interrupted: bool,
    /// The last step's report.
    pub last_report: Option<StepReport>,
    /// The planner's report when the pipeline was planned (`--plan`).
    pub plan: Option<crate::pipeline::PlanReport>,
}

/// Loads the text: the file given, or the synthetic corpus.
fn load_data(args: &TransformerArgs) -> AppResult<(TextDataset, String)> {
    match &args.data {
        Some(p) => {
            let d = TextDataset::from_file(p, args.seq_len).context("--data")?;
            let what = format!("{} ({} bytes, byte-level, vocab 256)", p.display(), d.len());
            Ok((d, what))
        }
        None => {
            let d = TextDataset::synthetic(args.pipe.seed, SYNTHETIC_CHARS);
            let what = format!(
                "the built-in synthetic corpus ({} characters of grammar sentences, vocab {})",
                d.len(),
                d.vocab_size()
            );
            Ok((d, what))
        }
    }
}

/// The flags' ranges and the rules between them, checked before anything is allocated.
fn check_flags(args: &TransformerArgs) -> AppResult<()> {
    check_range("layers", args.layers, 1, 1024)?;
    check_range("d-model", args.d_model, 1, 16384)?;
    check_range("heads", args.heads, 1, 1024)?;
    check_range("seq-len", args.seq_len, 1, 65536)?;
    check_range("batch", args.batch, 1, 1 << 20)?;
    check_range("steps", args.steps, 0, 1 << 40)?;
    check_range("sample-len", args.sample_len, 0, 100_000)?;
    check_real("lr", args.lr as f64, 0.0, 10.0)?;
    check_real("dropout", args.dropout as f64, 0.0, 0.99)?;
    check_real("temperature", args.temperature as f64, 0.0, 100.0)?;
    if !args.d_model.is_multiple_of(args.heads) {
        return Err(AppError(format!(
            "--heads {} must divide --d-model {}",
            args.heads, args.d_model
        )));
    }
    args.pipe.validate(
        args.layers + 3,
        &format!(
            "embedding + {} blocks + final norm + head; raise --layers",
            args.layers
        ),
        args.batch,
        "sequences",
    )
}

/// Refuses flags whose model, optimizer state or activations would not fit in memory.
fn check_transformer_memory(args: &TransformerArgs, vocab: usize) -> AppResult<()> {
    let (d, l, t, b) = (
        args.d_model as f64,
        args.layers as f64,
        args.seq_len as f64,
        args.batch as f64,
    );
    let v = vocab as f64;
    // Embeddings and head, then per block: attention 4 d^2, MLP 8 d^2, norms and biases.
    let params = v * d + t * d + l * (12.0 * d * d + 13.0 * d) + 2.0 * d + d * v + v;
    // Parameters, gradients, two AdamW moments, and the copy an atomic step keeps.
    let model = params * 4.0 * 5.0;
    // Kept for backward per block: about 16 d per token plus the attention matrix; logits.
    let acts = b * t * (l * (16.0 * d + 2.0 * t * args.heads as f64) + 3.0 * v) * 4.0;
    let p = &args.pipe;
    let parts = [
        MemoryPart {
            what: "the model (parameters, gradients and optimizer state)",
            bytes: model,
            flags: vec![
                ("d-model", d, 64.0),
                ("layers", l, 4.0),
                ("seq-len", t, 64.0),
            ],
        },
        MemoryPart {
            what: "the activations of one mini-batch",
            bytes: acts,
            flags: vec![
                ("batch", b, 32.0),
                ("seq-len", t, 64.0),
                ("d-model", d, 64.0),
                ("layers", l, 4.0),
            ],
        },
    ];
    let host = memory_limit_bytes();
    check_memory(&parts, host, "the memory available on this machine")?;
    if p.device == crate::placement::DeviceChoice::Sim {
        let sim = p.sim_spec().memory_bytes() as f64 * p.stages as f64;
        check_memory(
            &parts,
            sim,
            "--sim-memory-gib times --stages, the memory of the simulated cluster",
        )?;
    }
    Ok(())
}

/// The whole program: trains, reports, samples, writes the pictures.
pub fn run(args: TransformerArgs) -> AppResult<TrainSummary> {
    run_with(args, ctrl_c_flag())
}

/// [`run`] with another stop flag than Ctrl-C's: training stops after the step during which it
/// became true (then saves with `--save`).
pub fn run_with(args: TransformerArgs, stop: &AtomicBool) -> AppResult<TrainSummary> {
    let mut args = args;
    // Under MPI every rank checks these against the others' at build, with the pipeline's own.
    args.pipe.run_settings = vec![
        ("--steps".into(), args.steps.to_string()),
        ("--batch".into(), args.batch.to_string()),
        ("--lr".into(), args.lr.to_string()),
    ];
    let p = &args.pipe;
    check_flags(&args)?;
    let (data, data_what) = load_data(&args)?;
    check_transformer_memory(&args, data.vocab_size())?;
    let (train, val) = split_data(&args, &data)?;
    let vocab = data.vocab_size();
    let cfg = TransformerLm {
        vocab,
        d_model: args.d_model,
        heads: args.heads,
        layers: args.layers,
        seq_len: args.seq_len,
        dropout: args.dropout,
        tie_embeddings: !args.untie_embeddings,
    };
    let loss_fn = |y: &Var, t: &Tensor| cross_entropy(y, t);
    let (mut pipe, plan, placement) = build_lm_pipeline(&args, &cfg, &train, &loss_fn)?;

    let warmup = (args.steps / 10).clamp(1, 30);
    let schedule = LrSchedule::WarmupCosine {
        warmup_steps: warmup,
        total_steps: args.steps,
        min_lr: args.lr / 10.0,
    };
    let lc_seed = p.seed;
    let mut start_step = 0;
    if let Some(path) = &p.resume {
        let (step, _) = load_pipeline(
            &mut pipe,
            path,
            &format!("{cfg:?}"),
            p.resume_other_settings,
        )?;
        start_step = step;
    }
    print_setup(
        &args,
        &cfg,
        &data_what,
        &placement,
        &pipe,
        plan.as_ref(),
        start_step,
    );

    let lc = LoopConfig {
        start: start_step,
        steps: args.steps,
        base_lr: args.lr,
        schedule,
        clip: Some(1.0),
        quiet: p.quiet,
        items_per_step: args.batch * args.seq_len,
        unit: "tok",
        stop,
        stop_at: p.stop_at,
    };
    let (b, t) = (args.batch, args.seq_len);
    let r = train_loop(
        &mut pipe,
        &lc,
        |step| {
            let (x, y) = train.batch(b, t, lc_seed, step)?;
            Ok((ids_tensor(&x, &[b, t])?, ids_tensor(&y, &[b, t])?))
        },
        &loss_fn,
    )?;
    let (wall, tokens_per_sec) = (r.wall_secs, r.items_per_sec);
    let end_step = r.end_step(start_step);
    let losses = r.losses.clone();
    save_trained(&mut pipe, p, &cfg, &data_what, end_step)?;

    let eval = report_held_out_loss(&mut pipe, &args, &val, &r, start_step, vocab)?;
    let (trace, timeline) = write_outputs(&pipe, &args, &r, end_step, eval, vocab, plan.as_ref())?;
    let sample = sample_after_training(&mut pipe, &args, &data, &val)?;
    Ok(TrainSummary {
        start_step,
        losses,
        eval_loss: eval,
        uniform_loss: (vocab as f32).ln(),
        tokens_per_sec,
        wall_secs: wall,
        sample,
        trace,
        timeline,
        interrupted: r.interrupted,
        last_report: r.last_report,
        plan,
    })
}

/// The training and held-out text.
fn split_data(args: &TransformerArgs, data: &TextDataset) -> AppResult<(TextDataset, TextDataset)> {
    let p = &args.pipe;
    // Hold out 5% of the text, and at least one evaluation batch of M sequences.
    let held = (p.micro_batches * args.seq_len + 1).max(data.len() / 20);
    if data.len() < held + args.seq_len + 1 {
        bail!(
            "the text has {} tokens: too short for --seq-len {} (it needs {} for training and {held} held out)",
            data.len(),
            args.seq_len,
            args.seq_len + 1
        );
    }
    Ok(data.split(1.0 - held as f64 / data.len() as f64)?)
}

/// The pipeline of the flags (or the one the planner chose, with its report) for the model
/// `cfg`, and the devices it runs on.
fn build_lm_pipeline(
    args: &TransformerArgs,
    cfg: &TransformerLm,
    train: &TextDataset,
    loss_fn: &LossFn,
) -> AppResult<(Pipeline, Option<PlanReport>, Placement)> {
    let p = &args.pipe;
    let rank_local = p.builds_rank_local();
    let model = if rank_local {
        Model::Factory(cfg.factory(p.seed, &Device::cpu()))
    } else {
        Model::Layers(
            cfg.build(p.seed, &Device::cpu())
                .context("building the model")?,
        )
    };

    let placement = p.placement()?;
    let mb = args.batch / p.micro_batches;
    let sample_in = ids_tensor(&vec![0; mb * args.seq_len], &[mb, args.seq_len])?;
    let adam = AdamConfig {
        lr: args.lr,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let copies = (1..p.local_replicas())
        .map(|_| cfg.build(p.seed, &Device::cpu()))
        .collect::<Result<Vec<_>, _>>()
        .context("building the model's replicas")?;
    let (x, y) = train.batch(args.batch, args.seq_len, p.seed, 0)?;
    let (x, y) = (
        ids_tensor(&x, &[args.batch, args.seq_len])?,
        ids_tensor(&y, &[args.batch, args.seq_len])?,
    );
    let run = PlanRun {
        inputs: &x,
        targets: &y,
        loss: loss_fn,
        batch: args.batch,
        min_micro_batch: 1,
        seed: p.seed,
    };
    let make_copy = {
        let (cfg, seed) = (cfg.clone(), p.seed);
        // A failure leaves the copy empty, which the builder reports as a model mismatch.
        Box::new(move || cfg.build(seed, &Device::cpu()).unwrap_or_default())
    };
    let (pipe, plan) = build_or_plan(
        model,
        copies,
        make_copy,
        p,
        &placement,
        &sample_in,
        &run,
        move || Box::new(AdamW::with_config(adam)),
    )?;
    Ok((pipe, plan, placement))
}

/// What the run is about to train: the model, the data, the devices and stages, the schedule,
/// the loss's references and where a resumed run starts.
fn print_setup(
    args: &TransformerArgs,
    cfg: &TransformerLm,
    data_what: &str,
    placement: &Placement,
    pipe: &Pipeline,
    plan: Option<&PlanReport>,
    start_step: u64,
) {
    let (p, vocab, n_params) = (&args.pipe, cfg.vocab, cfg.parameter_count());
    crate::say!(
        "TransformerLm: vocab {vocab}, d_model {}, {} heads, {} blocks, seq_len {} — {} parameters",
        args.d_model,
        args.heads,
        args.layers,
        args.seq_len,
        n_params
    );
    crate::say!("data: {data_what}");
    crate::say!("devices: {}", placement.description);
    crate::say_part!("{}", describe_stages(pipe));
    crate::say_part!("{}", describe_replicas(p));
    if plan.is_none() {
        crate::say!(
            "mini-batch {} sequences = {} micro-batches; schedule {} ({} chunk(s) per device), checkpoint {}, balance {}",
            args.batch,
            p.micro_batches,
            pipe.schedule().name,
            p.chunks(),
            p.checkpoint,
            p.balance
        );
    } else {
        crate::say!(
            "mini-batch {} sequences = {} micro-batches; schedule {} as planned",
            args.batch,
            pipe.schedule().num_micro_batches,
            pipe.schedule().name
        );
    }
    crate::say!(
        "loss references (nats/char): uniform ln({vocab}) = {:.2}{}",
        (vocab as f32).ln(),
        if args.data.is_none() {
            "; unigram 2.92, bigram 1.75, grammar floor 0.30"
        } else {
            ""
        }
    );
    if let Some(r) = &p.resume {
        crate::say!("resumed from {} at step {start_step}", r.display());
    }
    if start_step >= args.steps {
        crate::say!(
            "nothing to train: the checkpoint is at step {start_step}, --steps is {}",
            args.steps
        );
    }
}

/// With `--save`, the trained pipeline saved (gathered to one rank first for a one-file save).
fn save_trained(
    pipe: &mut Pipeline,
    p: &PipelineArgs,
    cfg: &TransformerLm,
    data_what: &str,
    end_step: u64,
) -> AppResult<()> {
    // Over MPI each rank held and trained only its own stages. Evaluation and sampling run across
    // the ranks as they are; a one-file checkpoint holds the whole model, so such a `--save` (not
    // a sharded `--save DIR/`, where each rank writes its own stages) gathers every stage to every
    // rank first (the explicit choice for a model small enough to hold whole; nothing to do in one
    // process). A model that cannot be built again comes out empty, which gather_stages names.
    if p.save
        .as_deref()
        .is_some_and(|s| !crate::files::is_folder_path(s))
    {
        pipe.gather_stages(|| cfg.build(p.seed, &Device::cpu()).unwrap_or_default())
            .map_err(|e| crate::error::AppError(format!("gathering the stages: {e}")))?;
    }
    if let Some(path) = &p.save {
        save_pipeline(
            pipe,
            path,
            &[
                ("model".into(), format!("{cfg:?}")),
                ("data".into(), data_what.to_string()),
            ],
        )?;
        crate::say!("saved checkpoint at step {end_step} to {}", path.display());
    }
    Ok(())
}

/// The loss on held-out text after training, printed with the training's figures.
fn report_held_out_loss(
    pipe: &mut Pipeline,
    args: &TransformerArgs,
    val: &TextDataset,
    r: &LoopResult,
    start_step: u64,
    vocab: usize,
) -> AppResult<f32> {
    let (wall, tokens_per_sec) = (r.wall_secs, r.items_per_sec);
    let (end_step, losses) = (r.end_step(start_step), &r.losses);
    pipe.set_train(false);
    let eval = held_out_loss(pipe, val, args.batch, args.seq_len, 8)?;
    if let (Some(first), Some(last)) = (losses.first(), losses.last()) {
        let k = losses.len().min(10);
        let tail = r.tail_loss(k);
        crate::say!(
            "\ntrained steps {start_step}..{end_step} in {wall:.1} s ({tokens_per_sec:.0} tokens/s): loss {first:.3} -> {last:.3} (mean of last {k}: {tail:.3}); held-out loss {eval:.3} (uniform {:.3})",
            (vocab as f32).ln()
        );
    } else {
        crate::say!(
            "\nheld-out loss {eval:.3} (uniform {:.3})",
            (vocab as f32).ln()
        );
    }
    Ok(eval)
}

/// The loss curve, `--metrics`, the trace and the timeline (and the plan's predictions beside
/// the measured step); the trace's and the timeline's paths.
fn write_outputs(
    pipe: &Pipeline,
    args: &TransformerArgs,
    r: &LoopResult,
    end_step: u64,
    eval: f32,
    vocab: usize,
    plan: Option<&PlanReport>,
) -> AppResult<(PathBuf, PathBuf)> {
    let p = &args.pipe;
    let trace = out_path(&p.trace, "trace.json");
    let timeline = out_path(&p.timeline, "timeline.svg");
    let mut references = vec![(format!("uniform ln({vocab})"), (vocab as f32).ln())];
    if args.data.is_none() {
        references.extend(
            [("unigram", 2.92), ("bigram", 1.75), ("grammar floor", 0.30)]
                .map(|(n, v)| (n.to_string(), v)),
        );
    }
    let last_step = end_step.saturating_sub(1);
    write_curves(
        &r.metrics,
        Some(("held_out_loss", last_step, eval)),
        &references,
        "train_transformer: loss per step (nats/char)",
        &timeline,
        "loss.svg",
        p.metrics.as_deref(),
    )?;
    if let Some(rep) = &r.last_report {
        report_outputs(pipe, rep, "train_transformer", &trace, &timeline)?;
        if let Some(plan) = plan {
            print_predicted_vs_measured(plan, rep);
        }
    }
    Ok((trace, timeline))
}
