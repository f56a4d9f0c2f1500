//! Datasets for training without any download at run time.
//!
//! * [`text`]: byte-level and compact character-level tokenisation, text datasets read from
//!   files, and a deterministic synthetic corpus ([`TextDataset::synthetic`]) that a small
//!   character-level language model learns visibly in a couple of minutes on a CPU.
//! * [`images`]: the in-memory [`ImageSet`] (N×C×H×W `f32`), batching, shuffling,
//!   normalisation, and two deterministic synthetic classification tasks
//!   ([`SyntheticTask::Shapes`], [`SyntheticTask::Stripes`]) for training and transfer tests.
//! * [`idx`]: the MNIST IDX file format (reader and writer).
//! * [`cifar`]: the CIFAR-10 binary file format (reader and writer).
//! * [`image_folder`]: folders of PNG and JPEG files, one sub-folder per class (the `image`
//!   crate decodes and resizes them as timm's eval transform does).
//! * [`tokenizer`]: Hugging Face `tokenizer.json` files (the `tokenizers` crate), and text and
//!   JSON Lines documents encoded into one stream.
//!
//! Randomness comes from a small seeded splitmix64
//! generator, so every synthetic set and every batch is a pure function of its seeds.

pub mod cifar;
pub mod idx;
pub mod image_folder;
pub mod images;
pub mod text;
pub mod tokenizer;

pub use cifar::{read_cifar10_bin, read_cifar10_bins, write_cifar10_bin};
pub use idx::{
    read_idx_images, read_idx_labels, read_mnist, write_idx_images, write_idx_labels, IdxImages,
};
pub use image_folder::{
    read_image_folder, read_image_folder_split, resize_set, ImageFolder, Interpolation, Resize,
};
pub use images::{ImageSet, SyntheticTask};
pub use text::{empirical_bigram_entropy, empirical_unigram_entropy};
pub use text::{ByteTokenizer, CharVocab, TextDataset, TokenBatch};

use std::io;
use std::path::{Path, PathBuf};

/// Errors from reading, writing or building datasets. Every variant that concerns a file
/// names that file.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file could not be opened, read or written (missing, permissions, ...).
    #[error("cannot {action} '{}': {}", .path.display(), io_detail(.source))]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// What was being done: `"read"` or `"write"`.
        action: &'static str,
        /// The underlying error.
        source: io::Error,
    },
    /// The file was read but its contents are not valid for the expected format
    /// (bad magic number, wrong length, truncated record, too short, ...).
    #[error("invalid data in '{}': {problem}", .path.display())]
    Format {
        /// The file concerned.
        path: PathBuf,
        /// What is wrong, e.g. "expected 7840000 image bytes, file has 1234".
        problem: String,
    },
    /// Arguments or in-memory data are inconsistent (no file involved), e.g. a label
    /// count that does not match the image count, or a character outside a vocabulary.
    #[error("invalid dataset: {problem}")]
    Invalid {
        /// What is wrong.
        problem: String,
    },
    /// A size that must be positive is zero (nothing could be drawn with it).
    #[error("{what} must be positive, got 0")]
    Zero {
        /// Which size: `"batch"`, `"seq_len"`, `"batch_size"`.
        what: &'static str,
    },
    /// A token stream shorter than one input/target window (`seq_len + 1` tokens).
    #[error(
        "dataset has {tokens} tokens, too short for one sequence of seq_len {seq_len} \
         (need seq_len + 1)"
    )]
    TooShort {
        /// Tokens in the dataset.
        tokens: usize,
        /// The sequence length asked for.
        seq_len: usize,
    },
    /// An image index at or past the number of images.
    #[error("image index {index} out of range (n = {n})")]
    IndexOutOfRange {
        /// The index asked for.
        index: usize,
        /// Images in the set.
        n: usize,
    },
    /// A split fraction outside `[0, 1]` (or NaN).
    #[error("split fraction must be in [0, 1], got {fraction}")]
    Fraction {
        /// The fraction given.
        fraction: f64,
    },
    /// Per-channel statistics whose count is not the number of channels.
    #[error("need one {what} per channel: got {got} for {channels} channel(s)")]
    PerChannel {
        /// `"mean"` or `"std"`.
        what: &'static str,
        /// Entries given.
        got: usize,
        /// Channels of the images.
        channels: usize,
    },
    /// A class listed twice where each may appear once.
    #[error("class {class} repeated in filter_classes (positions {first} and {second})")]
    RepeatedClass {
        /// The class.
        class: u32,
        /// Its first position in the list.
        first: usize,
        /// Its second position.
        second: usize,
    },
    /// Synthetic images of a shape or class count the generators do not support.
    #[error(
        "synthetic images need at least 1 channel, at least 8x8 pixels and 2..={max_classes} \
         classes; got {c} channel(s), {h}x{w} pixels, {num_classes} classes"
    )]
    SyntheticShape {
        /// Channels asked for.
        c: usize,
        /// Height asked for.
        h: usize,
        /// Width asked for.
        w: usize,
        /// Classes asked for.
        num_classes: usize,
        /// The most classes supported ([`SyntheticTask::MAX_CLASSES`]).
        max_classes: usize,
    },
}

impl DataError {
    pub(crate) fn io(path: &Path, action: &'static str, source: io::Error) -> Self {
        DataError::Io {
            path: path.to_path_buf(),
            action,
            source,
        }
    }

    pub(crate) fn format(path: &Path, problem: impl Into<String>) -> Self {
        DataError::Format {
            path: path.to_path_buf(),
            problem: problem.into(),
        }
    }

    pub(crate) fn invalid(problem: impl Into<String>) -> Self {
        DataError::Invalid {
            problem: problem.into(),
        }
    }

    /// The file this error concerns, if any.
    pub fn path(&self) -> Option<&Path> {
        match self {
            DataError::Io { path, .. } | DataError::Format { path, .. } => Some(path),
            _ => None,
        }
    }
}

/// The detail of an I/O error: "file not found (...)" when that is what it is.
fn io_detail(source: &io::Error) -> String {
    if source.kind() == io::ErrorKind::NotFound {
        format!("file not found ({source})")
    } else {
        source.to_string()
    }
}

/// Reads a whole file, mapping failures to [`DataError::Io`] naming the path.
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>, DataError> {
    std::fs::read(path).map_err(|e| DataError::io(path, "read", e))
}

/// Writes a whole file, mapping failures to [`DataError::Io`] naming the path.
pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    std::fs::write(path, bytes).map_err(|e| DataError::io(path, "write", e))
}

/// A clear error for gzip-compressed input (MNIST and CIFAR are distributed compressed;
/// this crate reads only the decompressed files).
pub(crate) fn reject_gzip(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    if bytes.len() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b {
        return Err(DataError::format(
            path,
            "file is gzip-compressed; decompress it first (e.g. `gunzip`, then `tar xf` for CIFAR)",
        ));
    }
    Ok(())
}

/// The data generators' RNG: the workspace's one splitmix64 generator.
pub(crate) use wgpipe_tensor::rng::SplitMix64 as Rng;

/// A unique path under the system temp directory for test files.
#[cfg(test)]
pub(crate) fn temp_path(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!(
        "wgpipe-data-{}-{}-{}-{}",
        std::process::id(),
        nanos,
        n,
        tag
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    #[test]
    fn display_names_path_and_problem() {
        let e = DataError::format(Path::new("/x/y.idx"), "bad magic");
        let s = e.to_string();
        assert!(s.contains("/x/y.idx") && s.contains("bad magic"), "{s}");
        assert_eq!(e.path(), Some(Path::new("/x/y.idx")));
        assert!(e.source().is_none());
    }

    #[test]
    fn missing_file_error_says_not_found() {
        let p = temp_path("definitely-missing");
        let e = read_file(&p).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("not found"), "{s}");
        assert!(s.contains(&*p.to_string_lossy()), "{s}");
        assert!(e.source().is_some());
    }

    #[test]
    fn invalid_has_no_path() {
        let e = DataError::invalid("labels and images differ");
        assert!(e.path().is_none());
        assert!(e.to_string().contains("labels and images differ"));
    }

    #[test]
    fn gzip_is_rejected_with_hint() {
        let e = reject_gzip(Path::new("a.gz"), &[0x1f, 0x8b, 8, 0]).unwrap_err();
        assert!(e.to_string().contains("gzip"));
        assert!(reject_gzip(Path::new("a"), &[0, 0, 8, 3]).is_ok());
    }

    #[test]
    fn rng_is_deterministic_and_uniformish() {
        let mut a = Rng::from_parts(&[1, 2, 3]);
        let mut b = Rng::from_parts(&[1, 2, 3]);
        let mut c = Rng::from_parts(&[1, 2, 4]);
        let va: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let vb: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        let vc: Vec<u64> = (0..8).map(|_| c.next_u64()).collect();
        assert_eq!(va, vb);
        assert_ne!(va, vc);
        let mut r = Rng::new(7);
        let mut counts = [0usize; 4];
        for _ in 0..4000 {
            counts[r.below(4) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&k| (850..1150).contains(&k)),
            "{counts:?}"
        );
        let mean: f64 = (0..4000).map(|_| r.normal()).sum::<f64>() / 4000.0;
        assert!(mean.abs() < 0.1, "{mean}");
    }
}
