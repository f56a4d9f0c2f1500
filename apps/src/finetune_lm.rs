//! Fine-tuning a language model from a Hugging Face folder (a Llama or a GPT-2) through a
//! K-stage pipeline, then saving it back as a folder transformers loads.
//!
//! `cargo run --release --example finetune_lm -- --from DIR --help` lists the flags. Every
//! pipeline flag of the main job works (stages, schedule, balance, precision, replicas,
//! `--transport mpi`); under MPI each rank reads only its own stages' tensors from the folder
//! and, with `--save-hf`, writes its own shard. The text: `--data` files (plain text, or JSON
//! Lines with a `text` field) through the folder's `tokenizer.json` (or `--tokenizer`), 5% held
//! out; without `--data`, the built-in synthetic corpus, its characters taken as token ids.
//! `--prompt` prints the model's continuation after training.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;

use crate::args::{describe_stages, Model, PipelineArgs};
use crate::autograd::optim::{AdamConfig, LrSchedule};
use crate::autograd::{AdamW, Module, Var};
use crate::error::{AppError, AppResult, Context};
use crate::finetune::{freeze_first, save_folder};
use crate::generate::{generate, Sampling};
use crate::limits::{check_range, check_real};
use crate::lm::{held_out_loss, ids_tensor};
use crate::metrics::write_curves;
use crate::models::cross_entropy;
use crate::models::data::tokenizer::{read_documents, HfTokenizer};
use crate::models::data::TextDataset;
use crate::models::hf::{
    checkpoint_factory, gpt2_of, llama_of, load_layers, HfCheckpoint, HfFolder,
};
use crate::output::{out_path, report_outputs};
use crate::pipeline::Pipeline;
use crate::plan::{build_or_plan, PlanRun};
use crate::tensor::{DType, Device, Tensor};
use crate::train::{ctrl_c_flag, train_loop, LoopConfig};

#[derive(Parser, Clone, Debug)]
#[command(
    args_override_self = true,
    name = "finetune_lm",
    about = "Fine-tune a Llama or a GPT-2 from a Hugging Face folder through a GPipe pipeline, and save it back"
)]
pub struct FinetuneArgs {
    /// The Hugging Face folder: config.json (model_type llama or gpt2) and model.safetensors,
    /// or model.safetensors.index.json and its shards.
    #[arg(long)]
    pub from: PathBuf,
    #[command(flatten)]
    pub pipe: PipelineArgs,
    /// Training steps (0: load, evaluate and save only).
    #[arg(long, default_value_t = 20)]
    pub steps: u64,
    /// Sequences per mini-batch (split into --micro-batches; 1..=1048576).
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens per sequence (1..=65536, at most the model's positions; default: 32, or the
    /// model's positions if fewer).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Peak learning rate of AdamW (linear warm-up, then cosine decay to a tenth; 0..=10).
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f32,
    /// Write the fine-tuned model to this folder as transformers writes it (one shard per
    /// device, each written by the rank that trains it, and the index).
    #[arg(long)]
    pub save_hf: Option<PathBuf>,
    /// The dtype of the saved tensors: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub save_dtype: DType,
    /// Text to train on: plain text files (each a document) or JSON Lines (`.jsonl`, a `text`
    /// field per line); default: the built-in synthetic corpus, characters as token ids.
    #[arg(long, num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// The tokenizer of --data and --prompt (default: tokenizer.json in the --from folder).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// After training, print the model's continuation of this text.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Tokens to generate after --prompt (1..=100000).
    #[arg(long, default_value_t = 32)]
    pub new_tokens: usize,
    /// Sampling temperature (0 = greedy; 0..=100).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample among the k most likely tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Sample among the most likely tokens holding this much probability (0..=1; 1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sequences generated at once from --prompt (a multiple of --micro-batches; default:
    /// one per micro-batch). The first is printed.
    #[arg(long)]
    pub rows: Option<usize>,
    /// Freeze the embedding and the first N decoder layers (0: the embedding alone); a tied
    /// head is frozen with its table.
    #[arg(long)]
    pub freeze: Option<usize>,
    /// Generate without the KV cache (each token runs the whole sequence again; GPT-2 always
    /// does, its attention keeps no cache).
    #[arg(long)]
    pub no_kv_cache: bool,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct FinetuneSummary {
    pub model: String,
    pub parameters: usize,
    /// Seconds from opening the folder to a built pipeline (this rank).
    pub load_secs: f64,
    pub eval_before: f32,
    pub losses: Vec<f32>,
    pub eval_after: f32,
    /// The ids generated after `--prompt` (empty without it), and their text.
    pub generated: Vec<u32>,
    pub generated_text: String,
    /// This process's peak resident memory (Linux's VmHWM), bytes; `None` elsewhere.
    pub peak_resident_bytes: Option<u64>,
}

impl FinetuneArgs {
    /// The flags as parsed from `args` (without the program name).
    pub fn parse_from_args<I, S>(args: I) -> AppResult<FinetuneArgs>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        crate::args::parse_args("finetune_lm", args)
    }

    /// The flags of this process's command line; exits with clap's message on bad flags.
    pub fn from_command_line() -> FinetuneArgs {
        let (mut args, matches) = crate::args::from_command_line::<FinetuneArgs>();
        args.pipe.shape_given = crate::plan::shape_given(&matches);
        args
    }
}

/// The whole program: load, evaluate, train, evaluate, save.
pub fn run(args: FinetuneArgs) -> AppResult<FinetuneSummary> {
    check_range("batch", args.batch, 1, 1 << 20)?;
    if let Some(t) = args.seq_len {
        check_range("seq-len", t, 1, 65536)?;
    }
    check_range("steps", args.steps, 0, 1 << 40)?;
    check_real("lr", args.lr as f64, 0.0, 10.0)?;
    check_range("new-tokens", args.new_tokens, 1, 100_000)?;
    check_real("temperature", args.temperature as f64, 0.0, 100.0)?;
    check_real("top-p", args.top_p as f64, 0.0, 1.0)?;
    let config = args.from.join("config.json");
    let text = std::fs::read_to_string(&config)
        .map_err(|e| AppError(format!("--from: {}: {e}", config.display())))?;
    let model_type = serde_json::from_str::<serde_json::Value>(&text)
        .map_err(|e| AppError(format!("--from: {} is not JSON: {e}", config.display())))?
        .get("model_type")
        .and_then(|v| v.as_str().map(String::from));
    let checkpoint = Arc::new(HfCheckpoint::open(&args.from).context("--from")?);
    match model_type.as_deref() {
        Some("llama") => {
            let llama = llama_of(&args.from).context("--from")?;
            let c = &llama.config;
            let sizes = [c.vocab_size, c.max_position_embeddings];
            run_model(&args, llama, checkpoint, sizes, "Llama", true)
        }
        Some("gpt2") => {
            let gpt2 = gpt2_of(&args.from, &checkpoint).context("--from")?;
            let sizes = [gpt2.config.vocab_size, gpt2.config.n_positions];
            run_model(&args, gpt2, checkpoint, sizes, "GPT-2", false)
        }
        other => Err(AppError(format!(
            "--from: {} has model_type {other:?}; this example fine-tunes \"llama\" and \"gpt2\"",
            config.display()
        ))),
    }
}

/// The layers of `model` read from `checkpoint`, whole, on the host.
fn load_whole<M: HfFolder>(
    model: &M,
    checkpoint: &HfCheckpoint,
) -> AppResult<Vec<Box<dyn Module>>> {
    load_layers(model, checkpoint, 0..model.num_layers(), &Device::cpu()).context("--from")
}

/// [`run`] for one kind of model (`kind`, as printed), of `[vocabulary, positions]` (the longest
/// sequence it takes), whose attention layers keep a KV cache or not (`caches`).
fn run_model<M: HfFolder>(
    args: &FinetuneArgs,
    model: M,
    checkpoint: Arc<HfCheckpoint>,
    [vocab, positions]: [usize; 2],
    kind: &str,
    caches: bool,
) -> AppResult<FinetuneSummary> {
    let p = &args.pipe;
    let n = model.num_layers();
    p.validate(n, "the model's layers", args.batch, "sequences")?;
    let seq_len = args.seq_len.unwrap_or(positions.min(32));
    if seq_len > positions {
        return Err(AppError(format!(
            "--seq-len {seq_len} is longer than the model's {positions} positions"
        )));
    }
    let text = Text::load(args, vocab)?;
    let data = &text.data;
    let (train, val) = data.split(0.95)?;
    let started = Instant::now();
    let placement = p.placement()?;
    let built = if p.builds_rank_local() {
        // Read straight onto this rank's device: a 262 MB table loaded on the host and then
        // moved would be held twice for a moment (measured: +350 MB of peak on the ranks
        // holding the embedding and the head of a 1.1B Llama).
        let device = placement.build_device(true);
        Model::Factory(checkpoint_factory(&model, checkpoint.clone(), &device).context("--from")?)
    } else {
        // Loading the whole model refuses tensors no layer takes, as the factory checks first.
        Model::Layers(load_whole(&model, &checkpoint)?)
    };
    let copies = (1..p.local_replicas())
        .map(|_| load_whole(&model, &checkpoint))
        .collect::<AppResult<Vec<_>>>()?;
    let (b, t) = (args.batch, seq_len);
    let (x, y) = batch_tensors(&train, b, t, p.seed, 0)?;
    let loss_fn = |l: &Var, t: &Tensor| cross_entropy(l, t);
    let run = PlanRun {
        inputs: &x,
        targets: &y,
        loss: &loss_fn,
        batch: b,
        min_micro_batch: 1,
        seed: p.seed,
    };
    let make_copy = {
        let (model, checkpoint) = (model.clone(), checkpoint.clone());
        // A failure leaves the copy empty, which the builder reports as a model mismatch.
        Box::new(move || load_whole(&model, &checkpoint).unwrap_or_default())
    };
    let adam = AdamConfig {
        lr: args.lr,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let mb = (b / p.micro_batches).max(1);
    let sample = Tensor::zeros(&[mb, t], &Device::cpu())?;
    let (mut pipe, _plan) = build_or_plan(
        built,
        copies,
        make_copy,
        p,
        &placement,
        &sample,
        &run,
        move || Box::new(AdamW::with_config(adam)),
    )?;
    let load_secs = started.elapsed().as_secs_f64();
    let parameters: usize = pipe.stages().iter().map(|s| s.num_params()).sum();
    crate::say!(
        "{kind} from {}: {n} layers, vocab {vocab}, {parameters} parameters (a tied table once per copy); loaded in {load_secs:.1} s",
        args.from.display()
    );
    crate::say!("devices: {}", placement.description);
    crate::say_part!("{}", describe_stages(&pipe));
    crate::say!("data: {}", text.what);

    pipe.set_train(false);
    if let Some(n) = args.freeze {
        let frozen = freeze_first(&pipe, n + 1);
        crate::say!(
            "frozen: the embedding and {n} decoder layer(s), {frozen} tensors on this rank"
        );
    }
    let eval_before = held_out_loss(&mut pipe, &val, b, t, 4)?;
    crate::say!(
        "held-out loss before: {eval_before:.4} (perplexity {:.2})",
        eval_before.exp()
    );
    pipe.set_train(true);
    let lc = LoopConfig {
        start: 0,
        steps: args.steps,
        base_lr: args.lr,
        schedule: LrSchedule::WarmupCosine {
            warmup_steps: (args.steps / 10).clamp(1, 30),
            total_steps: args.steps.max(1),
            min_lr: args.lr / 10.0,
        },
        clip: Some(1.0),
        quiet: p.quiet,
        items_per_step: b * t,
        unit: "tok",
        stop: ctrl_c_flag(),
        stop_at: p.stop_at,
    };
    let seed = p.seed;
    let r = train_loop(
        &mut pipe,
        &lc,
        |step| batch_tensors(&train, b, t, seed, step),
        &loss_fn,
    )?;
    pipe.set_train(false);
    let eval_after = held_out_loss(&mut pipe, &val, b, t, 4)?;
    crate::say!(
        "held-out loss after {} steps: {eval_after:.4} (perplexity {:.2})",
        r.losses.len(),
        eval_after.exp()
    );
    write_outputs(&pipe, p, &r, eval_after, vocab)?;
    let (generated, generated_text) = match &args.prompt {
        Some(prompt) => {
            let ids = text.encode(prompt)?;
            let sampling = Sampling {
                temperature: args.temperature,
                top_k: args.top_k,
                top_p: args.top_p,
                seed: p.seed,
                kv_cache: caches && !args.no_kv_cache,
            };
            let clock = Instant::now();
            let rows = args.rows.unwrap_or(pipe.num_micro_batches());
            let new = generate(
                &mut pipe,
                rows,
                &ids,
                args.new_tokens,
                positions,
                vocab,
                &sampling,
            )?;
            let secs = clock.elapsed().as_secs_f64();
            let out = text.decode(&new)?;
            crate::say!(
                "\n{prompt}{out}\n\n({} tokens in {secs:.2} s: {:.1} tokens/s per row, {} rows, {})",
                new.len(),
                new.len() as f64 / secs,
                rows,
                if sampling.kv_cache { "KV cache" } else { "no KV cache" }
            );
            (new, out)
        }
        None => (Vec::new(), String::new()),
    };
    if let Some(dir) = &args.save_hf {
        save_folder(&mut pipe, &model, dir, args.save_dtype, "--save-hf")?;
        crate::say!("saved to {} ({:?})", dir.display(), args.save_dtype);
    }
    let peak_resident_bytes = peak_resident_bytes();
    if let Some(bytes) = peak_resident_bytes {
        // Every rank's own line (the memory figures are per process).
        eprintln!(
            "rank {}: peak resident memory {:.0} MB",
            pipe.rank(),
            bytes as f64 / 1e6
        );
    }
    Ok(FinetuneSummary {
        model: kind.to_string(),
        parameters,
        load_secs,
        eval_before,
        losses: r.losses,
        eval_after,
        generated,
        generated_text,
        peak_resident_bytes,
    })
}

/// The training text and how its tokens and text convert.
struct Text {
    data: TextDataset,
    tokenizer: Option<HfTokenizer>,
    what: String,
}

impl Text {
    /// `--data` through the tokenizer, or the synthetic corpus, for a model of `vocab` tokens.
    fn load(args: &FinetuneArgs, vocab: usize) -> AppResult<Text> {
        let path = args
            .tokenizer
            .clone()
            .unwrap_or_else(|| args.from.join("tokenizer.json"));
        let tokenizer = if args.tokenizer.is_some() || path.exists() {
            Some(HfTokenizer::from_file(&path).context("--tokenizer")?)
        } else {
            None
        };
        if args.data.is_empty() {
            let data = TextDataset::synthetic(args.pipe.seed, 200_000);
            if data.vocab_size() > vocab {
                return Err(AppError(format!(
                    "the model's vocabulary ({vocab} tokens) is smaller than the corpus's {}",
                    data.vocab_size()
                )));
            }
            let what = format!(
                "the built-in synthetic corpus, characters as token ids (vocab {})",
                data.vocab_size()
            );
            // Prompts still go through the folder's tokenizer where it has one (what the
            // model was trained with), else they are characters too.
            return Ok(Text {
                data,
                tokenizer,
                what,
            });
        }
        let Some(tok) = tokenizer else {
            return Err(AppError(format!(
                "--data needs a tokenizer: {} does not exist (give --tokenizer FILE)",
                path.display()
            )));
        };
        let docs = read_documents(&args.data).context("--data")?;
        let data = tok.dataset(&docs, vocab).context("--data")?;
        let what = format!(
            "{} document(s) from {} file(s), {} tokens by {}",
            docs.len(),
            args.data.len(),
            data.len(),
            path.display()
        );
        Ok(Text {
            data,
            tokenizer: Some(tok),
            what,
        })
    }

    fn encode(&self, text: &str) -> AppResult<Vec<u32>> {
        match &self.tokenizer {
            Some(t) => Ok(t.encode(text).context("--prompt")?),
            None => Ok(self.data.encode(text).context("--prompt")?),
        }
    }

    fn decode(&self, ids: &[u32]) -> AppResult<String> {
        match &self.tokenizer {
            Some(t) => Ok(t.decode(ids).context("decoding")?),
            None => Ok(self.data.decode(ids)),
        }
    }
}

/// The loss curve (`loss.svg`), `--metrics`, and the last step's per-device table, trace and
/// timeline, as the main job writes them.
fn write_outputs(
    pipe: &Pipeline,
    p: &PipelineArgs,
    r: &crate::train::LoopResult,
    eval: f32,
    vocab: usize,
) -> AppResult<()> {
    let trace = out_path(&p.trace, "trace.json");
    let timeline = out_path(&p.timeline, "timeline.svg");
    let uniform = vec![(format!("uniform ln({vocab})"), (vocab as f32).ln())];
    write_curves(
        &r.metrics,
        Some((
            "held_out_loss",
            r.losses.len().saturating_sub(1) as u64,
            eval,
        )),
        &uniform,
        "finetune_lm: loss per step (nats/token)",
        &timeline,
        "loss.svg",
        p.metrics.as_deref(),
    )?;
    if let Some(rep) = &r.last_report {
        report_outputs(pipe, rep, "finetune_lm", &trace, &timeline)?;
    }
    Ok(())
}

fn batch_tensors(
    data: &TextDataset,
    b: usize,
    t: usize,
    seed: u64,
    step: u64,
) -> AppResult<(Tensor, Tensor)> {
    let (x, y) = data.batch(b, t, seed, step)?;
    Ok((ids_tensor(&x, &[b, t])?, ids_tensor(&y, &[b, t])?))
}

/// This process's peak resident memory, from /proc/self/status (Linux).
pub fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
