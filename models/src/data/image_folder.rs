//! Image folders as torchvision's `ImageFolder` reads them: one sub-folder per class, sorted by
//! name (a class's label is its position), PNG or JPEG files directly in each (other files are
//! ignored, as torchvision ignores them). Every image is decoded to RGB (alpha dropped, grey
//! replicated: PIL's `convert("RGB")`) and prepared as timm's eval transform prepares it
//! ([`Resize`]): its shorter side resized to `floor(side / crop_pct)` with antialiased bilinear
//! or bicubic filtering, then the centre `side` x `side` cut out. Values are in `[0, 1]`; the
//! model's mean and standard deviation are applied after ([`ImageSet::normalize_with`]).

use std::path::{Path, PathBuf};

use image::imageops::FilterType;
use image::RgbImage;

use super::{DataError, ImageSet};

/// The resampling filter of [`Resize`]: PIL's `BILINEAR` and `BICUBIC` (a = -0.5, the
/// `image` crate's Catmull-Rom), both antialiased when shrinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interpolation {
    Bilinear,
    Bicubic,
}

/// timm's eval transform: `Resize(floor(side / crop_pct))` of the shorter side, then
/// `CenterCrop(side)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Resize {
    pub side: usize,
    /// The share of the resized image's shorter side that the crop keeps, in `(0, 1]`.
    pub crop_pct: f64,
    pub interpolation: Interpolation,
}

impl Resize {
    /// The whole image resized to `side` with bilinear filtering, no margin cropped (BiT's
    /// fine-tuned models' `crop_pct` of 1).
    pub fn whole(side: usize) -> Resize {
        Resize {
            side,
            crop_pct: 1.0,
            interpolation: Interpolation::Bilinear,
        }
    }

    /// The side the shorter side is resized to before the crop, as timm computes it.
    fn scale_side(&self) -> usize {
        ((self.side as f64 / self.crop_pct).floor() as usize).max(self.side)
    }

    fn check(&self) -> Result<(), DataError> {
        if self.side == 0 {
            return Err(DataError::Zero { what: "side" });
        }
        if !(self.crop_pct > 0.0 && self.crop_pct <= 1.0) {
            return Err(DataError::invalid(format!(
                "crop_pct {} must be in (0, 1]",
                self.crop_pct
            )));
        }
        Ok(())
    }
}

/// What [`read_image_folder`] read.
#[derive(Debug, Clone)]
pub struct ImageFolder {
    /// The images, `[n, 3, side, side]`, in class order, then by file name.
    pub set: ImageSet,
    /// The class names (the sub-folders), label `i` being `classes[i]`.
    pub classes: Vec<String>,
    /// The file each image came from.
    pub files: Vec<PathBuf>,
}

/// Files taken as images: torchvision's extensions that the decoders built in read.
const EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];

fn io_error(path: &Path, source: std::io::Error) -> DataError {
    DataError::Io {
        path: path.to_path_buf(),
        action: "read",
        source,
    }
}

/// The entries of `dir`, sorted by name, hidden ones (a leading dot) left out.
fn sorted_entries(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut entries = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| io_error(dir, e))? {
        let path = e.map_err(|e| io_error(dir, e))?.path();
        let hidden = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_none_or(|n| n.starts_with('.'));
        if !hidden {
            entries.push(path);
        }
    }
    entries.sort();
    Ok(entries)
}

fn is_image_file(path: &Path) -> bool {
    path.is_file()
        && path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
}

/// The classes (sub-folders with at least one image) of `dir` and their image files. Fails
/// for fewer than two classes, or a sub-folder without images, naming it.
fn class_files(dir: &Path) -> Result<Vec<(String, Vec<PathBuf>)>, DataError> {
    let mut classes = Vec::new();
    for sub in sorted_entries(dir)?.into_iter().filter(|p| p.is_dir()) {
        let files: Vec<PathBuf> = sorted_entries(&sub)?
            .into_iter()
            .filter(|p| is_image_file(p))
            .collect();
        if files.is_empty() {
            return Err(DataError::Format {
                path: sub,
                problem: format!(
                    "a class folder without images (files ending .{} are read)",
                    EXTENSIONS.join(", .")
                ),
            });
        }
        let name = sub.file_name().unwrap_or_default().to_string_lossy();
        classes.push((name.into_owned(), files));
    }
    if classes.len() < 2 {
        return Err(DataError::Format {
            path: dir.to_path_buf(),
            problem: format!(
                "an image folder has one sub-folder per class, at least two; found {}",
                classes.len()
            ),
        });
    }
    Ok(classes)
}

/// Every image under `dir` (one sub-folder per class), resized and cropped as `resize` says
/// (see the module's documentation).
pub fn read_image_folder(dir: &Path, resize: &Resize) -> Result<ImageFolder, DataError> {
    resize.check()?;
    let side = resize.side;
    let classes = class_files(dir)?;
    let n: usize = classes.iter().map(|(_, f)| f.len()).sum();
    let mut images = Vec::with_capacity(n * 3 * side * side);
    let (mut labels, mut files) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for (label, (_, paths)) in classes.iter().enumerate() {
        for path in paths {
            let img = image::open(path)
                .map_err(|e| DataError::Format {
                    path: path.clone(),
                    problem: format!("not a PNG or JPEG image that can be decoded: {e}"),
                })?
                .to_rgb8();
            images.extend(resize_center_crop(&img, resize));
            labels.push(label as u32);
            files.push(path.clone());
        }
    }
    let set = ImageSet::new(images, labels, n, 3, side, side, classes.len())?;
    Ok(ImageFolder {
        set,
        classes: classes.into_iter().map(|(c, _)| c).collect(),
        files,
    })
}

/// A training folder and its held-out folder: `dir/train` and `dir/val` (or `dir/test`) when
/// `dir` has them, each one sub-folder per class; otherwise `dir` itself, of which every tenth
/// image of each class (at least one of a class with two or more) is held out. Both have the
/// same classes.
pub fn read_image_folder_split(
    dir: &Path,
    resize: &Resize,
) -> Result<(ImageFolder, ImageFolder), DataError> {
    let held = ["val", "test"].map(|h| dir.join(h));
    if let (true, Some(held)) = (dir.join("train").is_dir(), held.iter().find(|h| h.is_dir())) {
        let train = read_image_folder(&dir.join("train"), resize)?;
        let test = read_image_folder(held, resize)?;
        if train.classes != test.classes {
            return Err(DataError::Format {
                path: held.clone(),
                problem: format!(
                    "its classes {:?} are not the training folder's {:?}",
                    test.classes, train.classes
                ),
            });
        }
        return Ok((train, test));
    }
    let all = read_image_folder(dir, resize)?;
    let mut seen = vec![0usize; all.classes.len()];
    let counts = all.set.class_counts();
    let (mut train, mut test) = (Vec::new(), Vec::new());
    for (i, &l) in all.set.labels.iter().enumerate() {
        let (k, count) = (seen[l as usize], counts[l as usize]);
        seen[l as usize] += 1;
        let held_out = k % 10 == 9 || ((2..10).contains(&count) && k == count - 1);
        if held_out {
            test.push(i);
        } else {
            train.push(i);
        }
    }
    let part = |idx: &[usize]| -> Result<ImageFolder, DataError> {
        Ok(ImageFolder {
            set: all.set.subset(idx)?,
            classes: all.classes.clone(),
            files: idx.iter().map(|&i| all.files[i].clone()).collect(),
        })
    };
    Ok((part(&train)?, part(&test)?))
}

/// torchvision's `CenterCrop` offset: `int(round(excess / 2))`, Python's round (halves to
/// even), so an odd excess of 2k + 1 starts at k when k is even and at k + 1 when it is odd.
fn centre_offset(excess: u32) -> u32 {
    let half = excess / 2;
    if excess % 2 == 1 && half % 2 == 1 {
        half + 1
    } else {
        half
    }
}

/// `img`'s shorter side resized to `resize`'s scale side `s` (the longer to
/// `int(s * long / short)`, as torchvision computes it) with its filter, the centre
/// `side` x `side` cut out, as `[3, side, side]` values in `[0, 1]`.
pub fn resize_center_crop(img: &RgbImage, resize: &Resize) -> Vec<f32> {
    let (w, h) = img.dimensions();
    let side = resize.side;
    let s = resize.scale_side() as u64;
    let filter = match resize.interpolation {
        Interpolation::Bilinear => FilterType::Triangle,
        Interpolation::Bicubic => FilterType::CatmullRom,
    };
    let (nw, nh) = if w <= h {
        (s, s * h as u64 / w as u64)
    } else {
        (s * w as u64 / h as u64, s)
    };
    let resized = if (nw, nh) == (w as u64, h as u64) {
        img.clone()
    } else {
        image::imageops::resize(img, nw as u32, nh as u32, filter)
    };
    let (left, top) = (
        centre_offset(nw as u32 - side as u32),
        centre_offset(nh as u32 - side as u32),
    );
    let mut out = vec![0f32; 3 * side * side];
    for y in 0..side {
        for x in 0..side {
            let px = resized.get_pixel(left + x as u32, top + y as u32);
            for c in 0..3 {
                out[c * side * side + y * side + x] = px[c] as f32 / 255.0;
            }
        }
    }
    out
}

/// `set`'s images (RGB or grey, values in `[0, 1]`, e.g. CIFAR's 32 x 32 or MNIST's 28 x 28)
/// resized and cropped as [`resize_center_crop`] does a decoded file (each value rounded to 8
/// bits first, as the file's pixels were; a grey image resized as its RGB copy, whose three
/// channels stay equal).
pub fn resize_set(set: &ImageSet, resize: &Resize) -> Result<ImageSet, DataError> {
    if set.c != 3 && set.c != 1 {
        return Err(DataError::invalid(format!(
            "resizing needs RGB (3 channels) or grey (1) images, these have {}",
            set.c
        )));
    }
    resize.check()?;
    let side = resize.side;
    let (c, h, w) = (set.c, set.h, set.w);
    let mut images = Vec::with_capacity(set.n * c * side * side);
    for i in 0..set.n {
        let px = set.image(i);
        let img = RgbImage::from_fn(w as u32, h as u32, |x, y| {
            let at = |ch: usize| {
                let v = px[ch.min(c - 1) * h * w + y as usize * w + x as usize];
                (v.clamp(0.0, 1.0) * 255.0).round() as u8
            };
            image::Rgb([at(0), at(1), at(2)])
        });
        let rgb = resize_center_crop(&img, resize);
        images.extend_from_slice(&rgb[..c * side * side]);
    }
    ImageSet::new(
        images,
        set.labels.clone(),
        set.n,
        c,
        side,
        side,
        set.num_classes,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn centre_offsets_round_halves_to_even_as_python_does() {
        // int(round(e / 2)) in Python for e = 0..8.
        let python = [0, 0, 1, 2, 2, 2, 3, 4, 4];
        for (e, want) in python.iter().enumerate() {
            assert_eq!(centre_offset(e as u32), *want, "excess {e}");
        }
    }

    #[test]
    fn an_image_of_the_asked_size_is_only_converted() {
        let img = RgbImage::from_fn(4, 4, |x, y| image::Rgb([x as u8 * 60, y as u8 * 60, 7]));
        let v = resize_center_crop(&img, &Resize::whole(4));
        assert_eq!(v.len(), 48);
        assert_eq!(v[3], 180.0 / 255.0);
        assert_eq!(v[16 + 3 * 4], 180.0 / 255.0);
        assert!(v[32..].iter().all(|&p| p == 7.0 / 255.0));
    }
}
