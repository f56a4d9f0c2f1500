//! Image classification through a K-stage pipeline: a ResNet-style CNN or an AmoebaNet-D-style
//! network on synthetic images (default), CIFAR-10 binaries or MNIST IDX files, with transfer
//! learning (`--init` a previously trained model, a fresh head, optionally a frozen body).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Parser, ValueEnum};

use crate::autograd::optim::{AdamConfig, LrSchedule};
use crate::autograd::serialize::load_tensors;
use crate::autograd::{AdamW, ModelFactory, Module, Var};
use crate::bail;
use std::sync::atomic::AtomicBool;

use crate::args::{describe_replicas, describe_stages, PipelineArgs};
use crate::error::{AppResult, Context};
use crate::files::{check_readable, is_optimizer_key, load_pipeline, save_pipeline};
use crate::limits::{check_memory, check_range, check_real, memory_limit_bytes, MemoryPart};
use crate::metrics::write_curves;
use crate::models::data::{read_cifar10_bins, read_mnist, ImageSet, SyntheticTask};
use crate::models::{cross_entropy, factory, parameter_count, AmoebaNet, ResNet};
use crate::output::{out_path, report_outputs};
use crate::pipeline::{Pipeline, StepReport};
use crate::plan::{build_or_plan, print_predicted_vs_measured, PlanRun};
use crate::tensor::{Device, Tensor};
use crate::train::{ctrl_c_flag, train_loop, LoopConfig};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum CnnModel {
    /// ResNet-style: a stem, `--depth` basic blocks per stage (3 stages), pooling, a linear head.
    Resnet,
    /// AmoebaNet-D-style: a stem, `--depth` normal cells per stage and 2 reduction cells.
    Amoebanet,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum TaskArg {
    /// Which shape is drawn (disc, square, cross, ring, ...).
    Shapes,
    /// The orientation of a grating.
    Stripes,
}

impl From<TaskArg> for SyntheticTask {
    fn from(t: TaskArg) -> SyntheticTask {
        match t {
            TaskArg::Shapes => SyntheticTask::Shapes,
            TaskArg::Stripes => SyntheticTask::Stripes,
        }
    }
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
    /// Synthetic task (when neither --cifar nor --mnist is given).
    #[arg(long, value_enum, default_value_t = TaskArg::Shapes)]
    pub task: TaskArg,
    /// Classes of the synthetic task (2..=10).
    #[arg(long, default_value_t = 10)]
    pub classes: usize,
    /// Side of the synthetic images in pixels (a multiple of 4 in 8..=4096).
    #[arg(long, default_value_t = 16)]
    pub image_size: usize,
    /// Synthetic training images (another quarter as many are held out for testing).
    #[arg(long, default_value_t = 4000)]
    pub train_size: usize,
    /// Keep only this many training images per class (few-shot fine-tuning).
    #[arg(long)]
    pub per_class: Option<usize>,
    /// CIFAR-10 binary data: a file (data_batch_1.bin) or the folder cifar-10-batches-bin.
    #[arg(long, conflicts_with = "mnist")]
    pub cifar: Option<PathBuf>,
    /// MNIST IDX files: images,labels (decompressed), e.g. train-images-idx3-ubyte,train-labels-idx1-ubyte.
    #[arg(long)]
    pub mnist: Option<String>,
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
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// With --init: train only the new head (the body's parameters are frozen).
    #[arg(long, requires = "init")]
    pub freeze_body: bool,
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

/// Train and test sets from the flags, normalised with the training set's statistics.
fn load_images(args: &CnnArgs) -> AppResult<(ImageSet, ImageSet, String)> {
    let (mut train, mut test, what) = if let Some(p) = &args.cifar {
        let (train, test) = read_cifar(p)?;
        (train, test, format!("CIFAR-10 from {}", p.display()))
    } else if let Some(spec) = &args.mnist {
        let v: Vec<&str> = spec.split(',').collect();
        if v.len() != 2 {
            bail!("--mnist {spec}: expected two files, images,labels");
        }
        let set = read_mnist(v[0], v[1]).context("--mnist")?;
        let (train, test) = set.split(0.9)?;
        (
            train,
            test,
            format!("MNIST from {} (90% train, 10% test)", v[0]),
        )
    } else {
        if !(2..=SyntheticTask::MAX_CLASSES).contains(&args.classes) {
            bail!(
                "--classes {} is outside the 2..={} classes of the synthetic tasks",
                args.classes,
                SyntheticTask::MAX_CLASSES
            );
        }
        if args.image_size < 8 || !args.image_size.is_multiple_of(4) {
            bail!(
                "--image-size {} must be at least 8 and a multiple of 4",
                args.image_size
            );
        }
        let s = args.image_size;
        let n_test = (args.train_size / 4).max(args.classes * 10);
        let all = ImageSet::synthetic(
            args.task.into(),
            args.train_size + n_test,
            3,
            s,
            s,
            args.classes,
            args.pipe.seed,
        )?;
        let (train, test) = all.split(args.train_size as f64 / all.n as f64)?;
        (
            train,
            test,
            format!(
                "synthetic {:?} task, {} classes, {s}x{s} RGB",
                args.task, args.classes
            ),
        )
    };
    if let Some(k) = args.per_class {
        train = train.take_per_class(k);
    }
    if train.is_empty() || test.is_empty() {
        bail!(
            "no images to train on or to test with ({} train, {} test)",
            train.n,
            test.n
        );
    }
    let (mean, std) = train.normalize();
    test.normalize_with(&mean, &std)?;
    let what = format!(
        "{what}: {} training images, {} test images",
        train.n, test.n
    );
    Ok((train, test, what))
}

/// A CIFAR-10 binary file (train on 90%, test on 10%) or the extracted folder (the five
/// `data_batch_*.bin` to train, `test_batch.bin` to test).
fn read_cifar(p: &Path) -> AppResult<(ImageSet, ImageSet)> {
    if p.is_dir() {
        let train: Vec<PathBuf> = (1..=5)
            .map(|i| p.join(format!("data_batch_{i}.bin")))
            .filter(|f| f.exists())
            .collect();
        let test = p.join("test_batch.bin");
        if train.is_empty() || !test.exists() {
            bail!(
                "--cifar {}: the folder has no data_batch_*.bin and test_batch.bin",
                p.display()
            );
        }
        let tr = read_cifar10_bins(&train).context("--cifar")?;
        let te = read_cifar10_bins(&[test]).context("--cifar")?;
        Ok((tr, te))
    } else {
        let set = read_cifar10_bins(&[p]).context("--cifar")?;
        Ok(set.split(0.9)?)
    }
}

fn images_tensor(set: &ImageSet, idx: &[usize]) -> AppResult<(Tensor, Tensor)> {
    let (px, labels) = set.batch(idx)?;
    let cpu = Device::cpu();
    let x = Tensor::from_vec(px, &[idx.len(), set.c, set.h, set.w], &cpu)?;
    let y = Tensor::from_vec(
        labels.iter().map(|&l| l as f32).collect(),
        &[idx.len()],
        &cpu,
    )?;
    Ok((x, y))
}

/// Accuracy on `set` through `Pipeline::predict` (a forward-only round across the stages and
/// ranks, in eval mode; the last stage keeps each image's predicted class), in chunks of
/// `chunk` images (at least M each; a last chunk smaller than M is merged into the one before).
pub fn accuracy(pipe: &mut Pipeline, set: &ImageSet, chunk: usize) -> AppResult<f64> {
    let m = pipe.num_micro_batches();
    let chunk = chunk.max(m);
    let mut correct = 0usize;
    let mut start = 0;
    while start < set.n {
        let mut end = (start + chunk).min(set.n);
        if set.n - end < m {
            end = set.n;
        }
        if end - start < m {
            break;
        }
        let idx: Vec<usize> = (start..end).collect();
        let (x, _) = images_tensor(set, &idx)?;
        let pred = pipe
            .predict(&x, &|logits| logits.argmax(-1, false))?
            .to_vec()?;
        correct += pred
            .iter()
            .zip(&set.labels[start..end])
            .filter(|(p, l)| **p as u32 == **l)
            .count();
        start = end;
    }
    Ok(correct as f64 / set.n.max(1) as f64)
}

fn build_model(args: &CnnArgs, train: &ImageSet) -> AppResult<Vec<Box<dyn Module>>> {
    let factory = cnn_factory(args, train)?;
    factory
        .build_range(0..factory.num_layers())
        .context("building the model")
}

/// The chosen CNN for `train`'s images as a factory of layer ranges (the whole model, or
/// under MPI only a rank's stages), after checking the flags and the images' size.
fn cnn_factory(args: &CnnArgs, train: &ImageSet) -> AppResult<Arc<dyn ModelFactory>> {
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
    let is_head = |n: &str| n.split('.').next() == Some(head.to_string().as_str());
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
            Some(p) if !is_head(&name) && p.shape() == t.shape() => {
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
    check_range("image-size", args.image_size, 8, 4096)?;
    check_range("train-size", args.train_size, 1, 10_000_000)?;
    check_range("batch", args.batch, 1, 1 << 20)?;
    check_range("steps", args.steps, 0, 1 << 40)?;
    if let Some(k) = args.per_class {
        check_range("per-class", k, 1, 10_000_000)?;
    }
    check_real("lr", args.lr as f64, 0.0, 10.0)?;
    if let Some(p) = &args.init {
        check_readable("init", p)?;
    }
    let synthetic = args.cifar.is_none() && args.mnist.is_none();
    let (side, n) = if synthetic {
        let n = args.train_size + (args.train_size / 4).max(args.classes * 10);
        (args.image_size as f64, n as f64)
    } else {
        (32.0, 60_000.0)
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
                ("train-size", args.train_size as f64, 4000.0),
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
    let (train, test, data_what) = load_images(&args)?;
    let batch = args.batch.min(train.n);
    if batch < p.micro_batches {
        bail!(
            "only {} training images: fewer than --micro-batches {}",
            train.n,
            p.micro_batches
        );
    }
    let cnn = cnn_factory(&args, &train)?;
    let rank_local = p.builds_rank_local();
    let n_layers = cnn.num_layers();
    p.validate(
        n_layers,
        &format!("{:?} with --depth {}", args.model, args.depth),
        batch,
        "images",
    )?;
    // Counted one layer at a time: no process holds the whole model to count it.
    let mut n_params = 0;
    for i in 0..n_layers {
        let layer = cnn.build_range(i..i + 1).context("building the model")?;
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
        .map(|_| build_model(&args, &train))
        .collect::<AppResult<Vec<_>>>()?;
    let loss_fn = |y: &Var, t: &Tensor| cross_entropy(y, t);
    let first = &train.shuffled_batches(batch, p.seed, 0)?[0];
    let (x, y) = images_tensor(&train, first)?;
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

    crate::say!(
        "{:?}: width {}, depth {}, {} layers, {} parameters, {} classes",
        args.model,
        args.width,
        args.depth,
        n_layers,
        n_params,
        train.num_classes
    );
    crate::say!("data: {data_what}");
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
        if args.freeze_body {
            let head = n_layers - 1;
            let mut frozen = 0;
            for (name, prm) in pipe.named_parameters() {
                if name.split('.').next() != Some(head.to_string().as_str()) {
                    prm.set_trainable(false);
                    frozen += 1;
                }
            }
            crate::say!("--freeze-body: {frozen} parameters frozen, only the head trains");
        }
    }
    let model_what = format!(
        "{:?} width {} depth {}, {} classes, {}x{}x{} images",
        args.model, args.width, args.depth, train.num_classes, train.c, train.h, train.w
    );
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
    let r = train_loop(
        &mut pipe,
        &lc,
        |step| {
            let epoch = step / steps_per_epoch;
            let i = (step % steps_per_epoch) as usize;
            let batches = train.shuffled_batches(batch, seed, epoch)?;
            images_tensor(&train, &batches[i])
        },
        &loss_fn,
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
        pipe.gather_stages(|| build_model(&args, &train).unwrap_or_default())
            .map_err(|e| crate::error::AppError(format!("gathering the stages: {e}")))?;
    }
    let end_step = r.end_step(start_step);
    if let Some(path) = &p.save {
        save_pipeline(
            &mut pipe,
            path,
            &[
                ("model".into(), model_what.clone()),
                ("data".into(), data_what.clone()),
            ],
        )?;
        crate::say!("saved checkpoint at step {end_step} to {}", path.display());
    }
    pipe.set_train(false);
    let acc = accuracy(&mut pipe, &test, 256)?;
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
