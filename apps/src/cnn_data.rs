//! train_cnn's images: a synthetic task, CIFAR-10 binaries, MNIST IDX files or an image folder
//! (one sub-folder per class), resized where asked and normalised (with the training set's
//! statistics, or a pretrained model's mean and std); and the accuracy of a pipeline on them.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

use crate::bail;
use crate::error::{AppResult, Context};
use crate::models::data::{
    read_cifar10_bins, read_image_folder_split, read_mnist, resize_set, ImageSet, Resize,
    SyntheticTask,
};
use crate::models::hf::Preprocessing;
use crate::pipeline::Pipeline;
use crate::tensor::{Device, Tensor};

/// The side image folders are resized to without `--image-size`: BiT's fine-tuning resolution
/// for small images (the BiT-HyperRule's 128).
pub const FOLDER_SIDE: usize = 128;
/// The side of synthetic images without `--image-size`.
pub const SYNTHETIC_SIDE: usize = 16;

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

/// The flags that choose the images.
#[derive(Args, Clone, Debug)]
pub struct ImageArgs {
    /// Synthetic task (when none of --cifar, --mnist, --images is given).
    #[arg(long, value_enum, default_value_t = TaskArg::Shapes)]
    pub task: TaskArg,
    /// Classes of the synthetic task (2..=10).
    #[arg(long, default_value_t = 10)]
    pub classes: usize,
    /// Side of the images in pixels: synthetic ones are drawn so (a multiple of 4 in 8..=4096,
    /// default 16); an image folder's are resized so (shorter side, then the centre square;
    /// default 128); CIFAR's and MNIST's keep their own unless it is given.
    #[arg(long)]
    pub image_size: Option<usize>,
    /// Synthetic training images (another quarter as many are held out for testing).
    #[arg(long, default_value_t = 4000)]
    pub train_size: usize,
    /// Keep only this many training images per class (few-shot fine-tuning).
    #[arg(long)]
    pub per_class: Option<usize>,
    /// CIFAR-10 binary data: a file (data_batch_1.bin) or the folder cifar-10-batches-bin.
    #[arg(long, conflicts_with_all = ["mnist", "images"])]
    pub cifar: Option<PathBuf>,
    /// MNIST IDX files: images,labels (decompressed), e.g. train-images-idx3-ubyte,train-labels-idx1-ubyte.
    #[arg(long, conflicts_with = "images")]
    pub mnist: Option<String>,
    /// An image folder: one sub-folder per class of PNG or JPEG files (torchvision's
    /// ImageFolder), or `train/` and `val/` (or `test/`) folders of that form. Without them,
    /// every tenth image of each class is held out.
    #[arg(long)]
    pub images: Option<PathBuf>,
}

/// The images a run trains and tests on.
pub struct Images {
    pub train: ImageSet,
    pub test: ImageSet,
    /// Where they came from and how many, as printed.
    pub what: String,
    /// An image folder's class names (label `i` is `classes[i]`).
    pub classes: Option<Vec<String>>,
}

/// Train and test sets from the flags, resized and normalised as `pre` (a pretrained model's
/// preprocessing) says or, without one, resized whole and normalised with the training set's
/// per-channel statistics.
pub fn load_images(args: &ImageArgs, seed: u64, pre: Option<&Preprocessing>) -> AppResult<Images> {
    let resize = |side: usize| pre.map_or(Resize::whole(side), |p| p.resize(side));
    let mut classes = None;
    let (mut train, mut test, what) = if let Some(dir) = &args.images {
        let side = args.image_size.unwrap_or(FOLDER_SIDE);
        let (train, test) = read_image_folder_split(dir, &resize(side))
            .context(format!("--images {}", dir.display()))?;
        classes = Some(train.classes.clone());
        let what = format!(
            "image folder {} ({} classes: {}), resized to {side}x{side}",
            dir.display(),
            train.classes.len(),
            train.classes.join(", ")
        );
        (train.set, test.set, what)
    } else if let Some(p) = &args.cifar {
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
        let (train, test, what) = synthetic(args, seed)?;
        (train, test, what)
    };
    // Files of fixed resolution, resized when asked (BiT fine-tunes CIFAR at 128 or more).
    if let (Some(side), true) = (
        args.image_size,
        args.cifar.is_some() || args.mnist.is_some(),
    ) {
        train = resize_set(&train, &resize(side)).context("--image-size")?;
        test = resize_set(&test, &resize(side)).context("--image-size")?;
    }
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
    if let Some(norm) = pre {
        if train.c != norm.mean.len() {
            bail!(
                "the images have {} channels, the pretrained model takes {}",
                train.c,
                norm.mean.len()
            );
        }
        train.normalize_with(&norm.mean, &norm.std)?;
        test.normalize_with(&norm.mean, &norm.std)?;
    } else {
        let (mean, std) = train.normalize();
        test.normalize_with(&mean, &std)?;
    }
    let what = format!(
        "{what}: {} training images, {} test images",
        train.n, test.n
    );
    Ok(Images {
        train,
        test,
        what,
        classes,
    })
}

/// The synthetic task of the flags: `--train-size` images to train on and a quarter as many
/// (at least ten a class) held out.
fn synthetic(args: &ImageArgs, seed: u64) -> AppResult<(ImageSet, ImageSet, String)> {
    if !(2..=SyntheticTask::MAX_CLASSES).contains(&args.classes) {
        bail!(
            "--classes {} is outside the 2..={} classes of the synthetic tasks",
            args.classes,
            SyntheticTask::MAX_CLASSES
        );
    }
    let s = args.image_size.unwrap_or(SYNTHETIC_SIDE);
    if s < 8 || !s.is_multiple_of(4) {
        bail!("--image-size {s} must be at least 8 and a multiple of 4");
    }
    let n_test = (args.train_size / 4).max(args.classes * 10);
    let all = ImageSet::synthetic(
        args.task.into(),
        args.train_size + n_test,
        3,
        s,
        s,
        args.classes,
        seed,
    )?;
    let (train, test) = all.split(args.train_size as f64 / all.n as f64)?;
    let what = format!(
        "synthetic {:?} task, {} classes, {s}x{s} RGB",
        args.task, args.classes
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

/// Images `idx` of `set` and their labels (as f32 class indices), on the host.
pub fn images_tensor(set: &ImageSet, idx: &[usize]) -> AppResult<(Tensor, Tensor)> {
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
