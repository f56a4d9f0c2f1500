//! Image classification through a K-stage pipeline: a ResNet-style CNN or an AmoebaNet-D-style
//! network on synthetic images (default), CIFAR-10 binaries, MNIST IDX files or an image folder,
//! with transfer learning: `--init` a previously trained model, or `--from` a timm BiT
//! ResNetV2 checkpoint; a fresh head, optionally a frozen body; held-out accuracy per epoch.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Parser, ValueEnum};

use crate::autograd::optim::{AdamConfig, LrSchedule};
use crate::autograd::serialize::load_tensors;
use crate::autograd::{AdamW, ModelFactory, Module, Var};
use crate::bail;
use std::sync::atomic::AtomicBool;

use crate::args::{describe_replicas, describe_stages, PipelineArgs};
use crate::bit::{open_bit, BitCheckpoint};
use crate::cnn_data::{accuracy, images_tensor, load_images, ImageArgs, SYNTHETIC_SIDE};
use crate::error::{AppResult, Context};
use crate::files::{check_readable, is_optimizer_key, load_pipeline, save_pipeline};
use crate::finetune::{freeze_first, layer_of, save_folder};
use crate::limits::{check_memory, check_range, check_real, memory_limit_bytes, MemoryPart};
use crate::metrics::write_curves;
use crate::models::data::ImageSet;
use crate::models::{cross_entropy, factory, parameter_count, AmoebaNet, ResNet};
use crate::output::{out_path, report_outputs};
use crate::pipeline::{Pipeline, StepReport};
use crate::plan::{build_or_plan, print_predicted_vs_measured, PlanRun};
use crate::tensor::{DType, Device, Tensor};
use crate::train::{ctrl_c_flag, train_loop_evaluated, LoopConfig};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum CnnModel {
    /// ResNet-style: a stem, `--depth` basic blocks per stage (3 stages), pooling, a linear head.
    Resnet,
    /// AmoebaNet-D-style: a stem, `--depth` normal cells per stage and 2 reduction cells.
    Amoebanet,
}

#[derive(Parser, Clone, Debug)]
#[command(
    args_override_self = true,
    name = "train_cnn",
    about = "Train a CNN (ResNet or AmoebaNet) on images through a GPipe pipeline; fine-tune with --init"
)]
pub struct CnnArgs {
    #[command(flatten)]
    pub pipe: PipelineArgs,
    #[arg(long, value_enum, default_value_t = CnnModel::Resnet)]
    pub model: CnnModel,
    /// Channels of the first stage (ResNet width, AmoebaNet filters).
    #[arg(long, default_value_t = 16)]
    pub width: usize,
    /// Blocks (ResNet) or normal cells (AmoebaNet) per stage; 3 stages.
    #[arg(long, default_value_t = 1)]
    pub depth: usize,
    #[command(flatten)]
    pub data: ImageArgs,
    /// Total training steps (a resumed run continues up to this step).
    #[arg(long, default_value_t = 150)]
    pub steps: u64,
    /// Images per mini-batch (split into --micro-batches).
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Peak learning rate of AdamW (warm-up, then cosine decay to a tenth).
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f32,
    /// Start from the weights of a previously trained model (safetensors, e.g. a --save file):
    /// every tensor whose name and shape match is loaded; the classifier head is always fresh.
    #[arg(long, conflicts_with = "from")]
    pub init: Option<PathBuf>,
    /// Fine-tune a BiT ResNetV2 (timm's `resnetv2_50x1_bit` and family): its model.safetensors,
    /// or the folder holding it and timm's config.json (whose mean and std prepare the
    /// images; BiT's 0.5 and 0.5 without one). The head is replaced by a fresh one for the
    /// data's classes; --model, --width and --depth do not apply.
    #[arg(long, conflicts_with_all = ["model", "width", "depth"])]
    pub from: Option<PathBuf>,
    /// With --init or --from: train only the new head (the body's parameters are frozen).
    #[arg(long, conflicts_with = "freeze")]
    pub freeze_body: bool,
    /// With --init or --from: freeze the stem and the first N blocks (layers 0..=N).
    #[arg(long)]
    pub freeze: Option<usize>,
    /// With --from: write the trained model as a timm folder (model.safetensors or shards,
    /// config.json) into this directory.
    #[arg(long, requires = "from")]
    pub save_hf: Option<PathBuf>,
    /// The dtype of --save-hf's tensors: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub save_dtype: DType,
}

impl CnnArgs {
    /// The flags as parsed from `args` (without the program name).
    pub fn parse_from_args<I, S>(args: I) -> AppResult<CnnArgs>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        crate::args::parse_args("train_cnn", args)
    }

    /// The flags of this process's command line, noting whether the pipeline's shape was
    /// given (for `--plan auto`); exits with clap's message on bad flags.
    pub fn from_command_line() -> CnnArgs {
        let (mut args, matches) = crate::args::from_command_line::<CnnArgs>();
        args.pipe.shape_given = crate::plan::shape_given(&matches);
        args
    }
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct CnnSummary {
    pub start_step: u64,
    /// Trainable scalars of the model (as printed).
    pub num_params: usize,
    pub losses: Vec<f32>,
    /// Accuracy on the held-out images after training.
    pub test_accuracy: f64,
    /// `(steps done, held-out accuracy)` after every epoch and after the last step.
    pub epoch_accuracy: Vec<(u64, f64)>,
    /// `1 / classes`.
    pub chance: f64,
    pub images_per_sec: f64,
    pub wall_secs: f64,
    /// Tensors loaded by `--init` (0 without it).
    pub loaded_tensors: usize,
    pub trace: PathBuf,
    pub timeline: PathBuf,
    pub interrupted: bool,
    pub last_report: Option<StepReport>,
    /// The planner's report when the pipeline was planned (`--plan`).
    pub plan: Option<crate::pipeline::PlanReport>,
}

fn build_model(
    args: &CnnArgs,
    train: &ImageSet,
    bit: Option<&BitCheckpoint>,
) -> AppResult<Vec<Box<dyn Module>>> {
    let factory = cnn_factory(args, train, bit)?;
    factory
        .build_range(0..factory.num_layers())
        .context("building the model")
}

/// The chosen CNN for `train`'s images as a factory of layer ranges (the whole model, or
/// under MPI only a rank's stages), after checking the flags and the images' size: `bit`'s
/// ResNetV2 with a head for the images' classes (`--from`), or a fresh `--model`.
fn cnn_factory(
    args: &CnnArgs,
    train: &ImageSet,
    bit: Option<&BitCheckpoint>,
) -> AppResult<Arc<dyn ModelFactory>> {
    if let Some(bit) = bit {
        let model = bit.for_classes(train.num_classes);
        return bit.factory(&model, args.pipe.seed, &Device::cpu());
    }
    if args.width == 0 || args.depth == 0 {
        bail!("--width and --depth must be positive");
    }
    if !train.h.is_multiple_of(4) || !train.w.is_multiple_of(4) {
        bail!(
            "images are {}x{}: the CNNs halve the resolution twice, so both sides must be multiples of 4",
            train.h,
            train.w
        );
    }
    let (depth, width, seed) = (args.depth, args.width, args.pipe.seed);
    let (num_classes, in_channels) = (train.num_classes, train.c);
    let cpu = Device::cpu();
    Ok(match args.model {
        CnnModel::Resnet => factory(
            &ResNet {
                blocks: vec![depth; 3],
                width,
                num_classes,
                in_channels,
            },
            seed,
            &cpu,
        ),
        CnnModel::Amoebanet => factory(
            &AmoebaNet {
                normal_cells: depth,
                filters: width,
                num_classes,
                in_channels,
            },
            seed,
            &cpu,
        ),
    })
}

/// Loads every tensor of `path` whose name and shape match a parameter or buffer of the body
/// (the head, the last layer, keeps its fresh initialisation). Returns (loaded, skipped names).
fn init_from(pipe: &Pipeline, path: &Path) -> AppResult<(usize, Vec<String>)> {
    check_readable("init", path)?;
    let file = load_tensors(path, &Device::cpu()).context(format!("--init {}", path.display()))?;
    let head = pipe.balance().iter().sum::<usize>() - 1;
    let ours: std::collections::HashMap<String, crate::autograd::Param> = pipe
        .named_parameters()
        .into_iter()
        .chain(pipe.named_buffers())
        .collect();
    let (mut loaded, mut skipped) = (0, Vec::new());
    for (name, t) in file {
        if is_optimizer_key(&name) || name.starts_with("wgpipe.") {
            continue;
        }
        match ours.get(&name) {
            Some(p) if layer_of(&name) != Some(head) && p.shape() == t.shape() => {
                p.set_value(t.to_device(&p.device())?);
                loaded += 1;
            }
            _ => skipped.push(name),
        }
    }
    if loaded == 0 {
        bail!(
            "--init {}: no tensor matches the model by name and shape (was it trained with another --model, --width or --depth?)",
            path.display()
        );
    }
    Ok((loaded, skipped))
}

/// The flags' ranges, and the memory the images and the model would take, checked before
/// anything is allocated.
fn check_flags(args: &CnnArgs) -> AppResult<()> {
    check_range("width", args.width, 1, 4096)?;
    check_range("depth", args.depth, 1, 256)?;
    if let Some(side) = args.data.image_size {
        check_range("image-size", side, 8, 4096)?;
    }
    if let Some(n) = args.freeze {
        check_range("freeze", n, 0, 1 << 20)?;
    }
    if (args.freeze_body || args.freeze.is_some()) && args.init.is_none() && args.from.is_none() {
        bail!("--freeze-body and --freeze keep a pretrained body: they need --init or --from");
    }
    check_range("train-size", args.data.train_size, 1, 10_000_000)?;
    check_range("batch", args.batch, 1, 1 << 20)?;
    check_range("steps", args.steps, 0, 1 << 40)?;
    if let Some(k) = args.data.per_class {
        check_range("per-class", k, 1, 10_000_000)?;
    }
    check_real("lr", args.lr as f64, 0.0, 10.0)?;
    if let Some(p) = &args.init {
        check_readable("init", p)?;
    }
    if args.from.is_some() || args.data.images.is_some() {
        // The estimate below is a fresh ResNet's on files of known size: a checkpoint's model
        // and a folder's images are what they are, and are not estimated here.
        return Ok(());
    }
    let synthetic = args.data.cifar.is_none() && args.data.mnist.is_none();
    let (side, n) = if synthetic {
        let n = args.data.train_size + (args.data.train_size / 4).max(args.data.classes * 10);
        (
            args.data.image_size.unwrap_or(SYNTHETIC_SIDE) as f64,
            n as f64,
        )
    } else {
        (args.data.image_size.unwrap_or(32) as f64, 60_000.0)
    };
    let (w, depth, b) = (args.width as f64, args.depth as f64, args.batch as f64);
    // Three resolutions (full, 1/2, 1/4) of width w, 2w, 4w channels; 3x3 convolutions.
    let params = 3.0 * depth * 2.0 * 9.0 * (w * w + 4.0 * w * w + 16.0 * w * w);
    let acts_per_image = depth * 2.0 * 4.0 * side * side * (w + 2.0 * w / 4.0 + 4.0 * w / 16.0);
    let parts = [
        MemoryPart {
            what: "the images (3 channels, f32)",
            bytes: n * 3.0 * side * side * 4.0 * if synthetic { 2.0 } else { 1.0 },
            flags: vec![
                ("image-size", side, 16.0),
                ("train-size", args.data.train_size as f64, 4000.0),
            ],
        },
        MemoryPart {
            what: "the model (parameters, gradients and optimizer state)",
            bytes: params * 4.0 * 5.0,
            flags: vec![("width", w, 16.0), ("depth", depth, 1.0)],
        },
        MemoryPart {
            what: "the activations of one mini-batch",
            bytes: b * acts_per_image * 4.0,
            flags: vec![
                ("batch", b, 64.0),
                ("image-size", side, 16.0),
                ("width", w, 16.0),
                ("depth", depth, 1.0),
            ],
        },
    ];
    check_memory(
        &parts,
        memory_limit_bytes(),
        "the memory available on this machine",
    )
}

/// The whole program.
pub fn run(args: CnnArgs) -> AppResult<CnnSummary> {
    run_with(args, ctrl_c_flag())
}

/// [`run`] with another stop flag than Ctrl-C's: training stops after the step during which it
/// became true (then saves with `--save`).
pub fn run_with(args: CnnArgs, stop: &AtomicBool) -> AppResult<CnnSummary> {
    let mut args = args;
    // Under MPI every rank checks these against the others' at build, with the pipeline's own.
    args.pipe.run_settings = vec![
        ("--steps".into(), args.steps.to_string()),
        ("--batch".into(), args.batch.to_string()),
        ("--lr".into(), args.lr.to_string()),
    ];
    let p = &args.pipe;
    check_flags(&args)?;
    let bit = args.from.as_deref().map(open_bit).transpose()?;
    let images = load_images(&args.data, p.seed, bit.as_ref().map(|b| &b.preprocessing))?;
    let (train, test) = (&images.train, &images.test);
    let batch = args.batch.min(train.n);
    if batch < p.micro_batches {
        bail!(
            "only {} training images: fewer than --micro-batches {}",
            train.n,
            p.micro_batches
        );
    }
    let cnn = cnn_factory(&args, train, bit.as_ref())?;
    let rank_local = p.builds_rank_local();
    let n_layers = cnn.num_layers();
    let model_name = match &bit {
        Some(b) => format!("BiT ResNetV2 from {}", b.dir.display()),
        None => format!("{:?} with --depth {}", args.model, args.depth),
    };
    p.validate(n_layers, &model_name, batch, "images")?;
    // Counted one layer at a time: no process holds the whole model to count it.
    let mut n_params = 0;
    for i in 0..n_layers {
        let layer = cnn.describe_range(i..i + 1).context("building the model")?;
        n_params += parameter_count(&layer);
    }
    let model = if rank_local {
        crate::args::Model::Factory(cnn.clone())
    } else {
        crate::args::Model::Layers(cnn.build_range(0..n_layers).context("building the model")?)
    };
    let placement = p.placement()?;
    let mb = batch / p.micro_batches;
    let sample = Tensor::zeros(&[mb, train.c, train.h, train.w], &Device::cpu())?;
    let adam = AdamConfig {
        lr: args.lr,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 1e-4,
    };
    let copies = (1..p.local_replicas())
        .map(|_| build_model(&args, train, bit.as_ref()))
        .collect::<AppResult<Vec<_>>>()?;
    let loss_fn = |y: &Var, t: &Tensor| cross_entropy(y, t);
    let first = &train.shuffled_batches(batch, p.seed, 0)?[0];
    let (x, y) = images_tensor(train, first)?;
    let run = PlanRun {
        inputs: &x,
        targets: &y,
        loss: &loss_fn,
        batch,
        // Batch norm's statistics need a few images per micro-batch.
        min_micro_batch: 8,
        seed: p.seed,
    };
    let make_copy = {
        let cnn = cnn.clone();
        // A failure leaves the copy empty, which the builder reports as a model mismatch.
        Box::new(move || cnn.build_range(0..n_layers).unwrap_or_default())
    };
    let (mut pipe, plan) = build_or_plan(
        model,
        copies,
        make_copy,
        p,
        &placement,
        &sample,
        &run,
        move || Box::new(AdamW::with_config(adam)),
    )?;

    match &bit {
        Some(b) => crate::say!(
            "BiT ResNetV2 from {}: blocks {:?}, channels {:?}, {} layers, {} parameters; \
             its head for {} classes replaced by a fresh one for {}",
            b.dir.display(),
            b.pretrained.depths,
            b.pretrained.channels,
            n_layers,
            n_params,
            b.pretrained.num_classes,
            train.num_classes
        ),
        None => crate::say!(
            "{:?}: width {}, depth {}, {} layers, {} parameters, {} classes",
            args.model,
            args.width,
            args.depth,
            n_layers,
            n_params,
            train.num_classes
        ),
    }
    crate::say!("data: {}", images.what);
    crate::say!("devices: {}", placement.description);
    crate::say_part!("{}", describe_stages(&pipe));
    crate::say_part!("{}", describe_replicas(p));

    let mut loaded_tensors = 0;
    if let Some(path) = &args.init {
        let (loaded, skipped) = init_from(&pipe, path)?;
        loaded_tensors = loaded;
        crate::say!(
            "--init {}: loaded {loaded} tensors; fresh head for {} classes; not loaded: {}",
            path.display(),
            train.num_classes,
            if skipped.is_empty() {
                "none".to_string()
            } else {
                skipped.join(", ")
            }
        );
    }
    if bit.is_some() {
        // Every parameter but the head's two was read from the checkpoint.
        let head = n_layers - 1;
        loaded_tensors = pipe
            .named_parameters()
            .iter()
            .filter(|(name, _)| layer_of(name) != Some(head))
            .count();
    }
    freeze(&args, &pipe, n_layers);
    let model_what = match &bit {
        Some(b) => format!(
            "BiT ResNetV2 blocks {:?} channels {:?}, {} classes, {}x{}x{} images",
            b.pretrained.depths,
            b.pretrained.channels,
            train.num_classes,
            train.c,
            train.h,
            train.w
        ),
        None => format!(
            "{:?} width {} depth {}, {} classes, {}x{}x{} images",
            args.model, args.width, args.depth, train.num_classes, train.c, train.h, train.w
        ),
    };
    let mut start_step = 0;
    if let Some(path) = &p.resume {
        start_step = load_pipeline(&mut pipe, path, &model_what, p.resume_other_settings)?.0;
        crate::say!("resumed from {} at step {start_step}", path.display());
    }

    let steps_per_epoch = (train.n / batch).max(1) as u64;
    let seed = p.seed;
    let lc = LoopConfig {
        start: start_step,
        steps: args.steps,
        base_lr: args.lr,
        schedule: LrSchedule::WarmupCosine {
            warmup_steps: (args.steps / 10).clamp(1, 20),
            total_steps: args.steps,
            min_lr: args.lr / 10.0,
        },
        clip: Some(5.0),
        quiet: p.quiet,
        items_per_step: batch,
        unit: "img",
        stop,
        stop_at: p.stop_at,
    };
    let mut epoch_accuracy = Vec::new();
    let r = train_loop_evaluated(
        &mut pipe,
        &lc,
        Some(steps_per_epoch),
        |step| {
            let epoch = step / steps_per_epoch;
            let i = (step % steps_per_epoch) as usize;
            let batches = train.shuffled_batches(batch, seed, epoch)?;
            images_tensor(train, &batches[i])
        },
        &loss_fn,
        |pipe, done| {
            let acc = accuracy(pipe, test, 256)?;
            crate::say!(
                "epoch {:.2} (step {done}): held-out accuracy {:.1}% on {} images",
                done as f64 / steps_per_epoch as f64,
                acc * 100.0,
                test.n
            );
            epoch_accuracy.push((done, acc));
            Ok(())
        },
    )?;
    // Over MPI each rank held and trained only its own stages. The accuracy is measured across the
    // ranks as they are; a one-file checkpoint holds the whole model, so such a `--save` (not a
    // sharded `--save DIR/`, where each rank writes its own stages) gathers every stage to every
    // rank first (nothing to do in one process). A model that cannot be built again comes out
    // empty, which gather_stages names.
    if p.save
        .as_deref()
        .is_some_and(|s| !crate::files::is_folder_path(s))
    {
        pipe.gather_stages(|| build_model(&args, train, bit.as_ref()).unwrap_or_default())
            .map_err(|e| crate::error::AppError(format!("gathering the stages: {e}")))?;
    }
    let end_step = r.end_step(start_step);
    if let Some(path) = &p.save {
        save_pipeline(
            &mut pipe,
            path,
            &[
                ("model".into(), model_what.clone()),
                ("data".into(), images.what.clone()),
            ],
        )?;
        crate::say!("saved checkpoint at step {end_step} to {}", path.display());
    }
    if let (Some(dir), Some(b)) = (&args.save_hf, &bit) {
        let model = b.for_classes(train.num_classes);
        save_folder(&mut pipe, &model, dir, args.save_dtype, "--save-hf")?;
        crate::say!(
            "saved to {} as timm writes it ({:?})",
            dir.display(),
            args.save_dtype
        );
    }
    pipe.set_train(false);
    // The last evaluation was after the last step, unless the loop was stopped early.
    let acc = match epoch_accuracy.last() {
        Some(&(done, acc)) if done == end_step => acc,
        _ => accuracy(&mut pipe, test, 256)?,
    };
    let chance = 1.0 / train.num_classes as f64;
    if let (Some(first), Some(last)) = (r.losses.first(), r.losses.last()) {
        crate::say!(
            "\ntrained steps {start_step}..{end_step} in {:.1} s ({:.0} images/s): loss {first:.3} -> {last:.3} (mean of last 10: {:.3})",
            r.wall_secs,
            r.items_per_sec,
            r.tail_loss(10)
        );
    }
    crate::say!(
        "test accuracy {:.1}% on {} images (chance {:.1}%)",
        acc * 100.0,
        test.n,
        chance * 100.0
    );
    let trace = out_path(&p.trace, "cnn_trace.json");
    let timeline = out_path(&p.timeline, "cnn_timeline.svg");
    let chance_loss = (train.num_classes as f32).ln();
    write_curves(
        &r.metrics,
        Some(("held_out_accuracy", end_step.saturating_sub(1), acc as f32)),
        &[(format!("chance ln({})", train.num_classes), chance_loss)],
        "train_cnn: loss per step",
        &timeline,
        "cnn_loss.svg",
        p.metrics.as_deref(),
    )?;
    if let Some(rep) = &r.last_report {
        report_outputs(&pipe, rep, "train_cnn", &trace, &timeline)?;
        if let Some(plan) = &plan {
            print_predicted_vs_measured(plan, rep);
        }
    }
    Ok(CnnSummary {
        start_step,
        num_params: n_params,
        test_accuracy: acc,
        epoch_accuracy,
        chance,
        images_per_sec: r.items_per_sec,
        wall_secs: r.wall_secs,
        loaded_tensors,
        trace,
        timeline,
        interrupted: r.interrupted,
        losses: r.losses,
        last_report: r.last_report,
        plan,
    })
}

/// `--freeze-body` (every layer but the head) or `--freeze N` (layers 0..=N).
fn freeze(args: &CnnArgs, pipe: &Pipeline, n_layers: usize) {
    let layers = match (args.freeze_body, args.freeze) {
        (true, _) => n_layers - 1,
        (false, Some(n)) => (n + 1).min(n_layers - 1),
        (false, None) => return,
    };
    let frozen = freeze_first(pipe, layers);
    crate::say!(
        "frozen: layers 0..{layers} ({frozen} parameters{}); the rest trains",
        if args.freeze_body {
            ", the whole body"
        } else {
            ""
        }
    );
}
