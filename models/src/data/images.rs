//! In-memory image classification sets and deterministic synthetic tasks.

use super::{DataError, Rng};

/// A labelled image set: `images` is row-major `[n, c, h, w]` (`f32`, in `[0, 1]` as read
/// or generated, or standardised after [`ImageSet::normalize`]); `labels[i] < num_classes`.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageSet {
    /// Pixels, `n * c * h * w` values, image-major then channel-major (CHW per image).
    pub images: Vec<f32>,
    /// One label per image.
    pub labels: Vec<u32>,
    /// Number of images.
    pub n: usize,
    /// Channels.
    pub c: usize,
    /// Height.
    pub h: usize,
    /// Width.
    pub w: usize,
    /// Number of classes; every label is below it.
    pub num_classes: usize,
}

/// The synthetic classification tasks of [`ImageSet::synthetic`]. Both support 2 to
/// [`SyntheticTask::MAX_CLASSES`] classes and images of at least 8×8 pixels; they are
/// different enough that pre-training on one and fine-tuning on the other is a meaningful
/// transfer-learning test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SyntheticTask {
    /// One filled or outlined shape per image; the class is the shape: 0 disc, 1 square,
    /// 2 plus-cross, 3 diagonal cross, 4 ring, 5 hollow square, 6 triangle, 7 diamond,
    /// 8 horizontal bar, 9 vertical bar. Random size and position (fully inside the image),
    /// random foreground and background colours per channel, Gaussian pixel noise.
    Shapes,
    /// A sinusoidal grating seen through a round aperture; the class is the orientation
    /// (`class * 180° / num_classes`, jittered by up to ±35% of the class spacing, so
    /// neighbouring classes come close). Random period (3 pixels to a third of the image),
    /// phase, aperture size and position, and colours; Gaussian pixel noise.
    Stripes,
}

impl SyntheticTask {
    /// The most classes either task supports.
    pub const MAX_CLASSES: usize = 10;

    fn tag(self) -> u64 {
        match self {
            SyntheticTask::Shapes => 0x5348_4150,
            SyntheticTask::Stripes => 0x5354_5250,
        }
    }
}

impl ImageSet {
    /// An image set after checking that `images.len() == n * c * h * w`, that there is one
    /// label per image, and that every label is below `num_classes`.
    pub fn new(
        images: Vec<f32>,
        labels: Vec<u32>,
        n: usize,
        c: usize,
        h: usize,
        w: usize,
        num_classes: usize,
    ) -> Result<Self, DataError> {
        let expected = n
            .checked_mul(c)
            .and_then(|x| x.checked_mul(h))
            .and_then(|x| x.checked_mul(w))
            .ok_or_else(|| DataError::invalid("n * c * h * w overflows"))?;
        if images.len() != expected {
            return Err(DataError::invalid(format!(
                "expected {expected} pixel values for {n}x{c}x{h}x{w} images, got {}",
                images.len()
            )));
        }
        if labels.len() != n {
            return Err(DataError::invalid(format!(
                "expected {n} labels (one per image), got {}",
                labels.len()
            )));
        }
        if let Some((i, &l)) = labels
            .iter()
            .enumerate()
            .find(|(_, &l)| l as usize >= num_classes)
        {
            return Err(DataError::invalid(format!(
                "label {l} of image {i} is not below num_classes = {num_classes}"
            )));
        }
        Ok(ImageSet {
            images,
            labels,
            n,
            c,
            h,
            w,
            num_classes,
        })
    }

    /// Values per image (`c * h * w`).
    pub fn image_len(&self) -> usize {
        self.c * self.h * self.w
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.n
    }

    /// True if there are no images.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The pixels of image `i` (`[c, h, w]`). Panics if `i >= n`, as slice indexing does;
    /// indices that come from input go through [`ImageSet::batch`], which checks them.
    pub fn image(&self, i: usize) -> &[f32] {
        let l = self.image_len();
        &self.images[i * l..(i + 1) * l]
    }

    /// Images and labels at `indices`, in that order: `([len, c, h, w], [len])`. Fails
    /// ([`DataError::IndexOutOfRange`], naming the first such index) if an index is not below
    /// `n`.
    pub fn batch(&self, indices: &[usize]) -> Result<(Vec<f32>, Vec<u32>), DataError> {
        self.check_indices(indices)?;
        Ok(self.gather(indices))
    }

    fn check_indices(&self, indices: &[usize]) -> Result<(), DataError> {
        match indices.iter().find(|&&i| i >= self.n) {
            Some(&index) => Err(DataError::IndexOutOfRange { index, n: self.n }),
            None => Ok(()),
        }
    }

    /// [`ImageSet::batch`] of indices known to be below `n`.
    fn gather(&self, indices: &[usize]) -> (Vec<f32>, Vec<u32>) {
        let mut images = Vec::with_capacity(indices.len() * self.image_len());
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            images.extend_from_slice(self.image(i));
            labels.push(self.labels[i]);
        }
        (images, labels)
    }

    /// A permutation of `0..n`, deterministic in `(seed, epoch)`.
    pub fn shuffled_indices(&self, seed: u64, epoch: u64) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..self.n).collect();
        Rng::from_parts(&[seed, epoch, 0x5348_5546]).shuffle(&mut idx);
        idx
    }

    /// The epoch's batches of indices: [`ImageSet::shuffled_indices`] cut into full batches
    /// of `batch_size`; the remaining `n % batch_size` images (different ones each epoch)
    /// are dropped so every batch has the same shape. Pass each to [`ImageSet::batch`]. Fails
    /// ([`DataError::Zero`]) if `batch_size == 0`.
    pub fn shuffled_batches(
        &self,
        batch_size: usize,
        seed: u64,
        epoch: u64,
    ) -> Result<Vec<Vec<usize>>, DataError> {
        if batch_size == 0 {
            return Err(DataError::Zero { what: "batch_size" });
        }
        Ok(self
            .shuffled_indices(seed, epoch)
            .chunks_exact(batch_size)
            .map(<[usize]>::to_vec)
            .collect())
    }

    /// Per-channel mean and standard deviation over all images (std floored at 1e-6).
    pub fn channel_stats(&self) -> (Vec<f32>, Vec<f32>) {
        let hw = self.h * self.w;
        let mut sum = vec![0f64; self.c];
        let mut sq = vec![0f64; self.c];
        for img in self.images.chunks_exact(self.image_len().max(1)) {
            for (ch, plane) in img.chunks_exact(hw.max(1)).enumerate() {
                for &v in plane {
                    sum[ch] += v as f64;
                    sq[ch] += (v as f64) * (v as f64);
                }
            }
        }
        let count = (self.n * hw).max(1) as f64;
        let mean: Vec<f64> = sum.iter().map(|s| s / count).collect();
        let std = sq
            .iter()
            .zip(&mean)
            .map(|(s, m)| ((s / count - m * m).max(0.0).sqrt()).max(1e-6) as f32)
            .collect();
        (mean.into_iter().map(|m| m as f32).collect(), std)
    }

    /// Standardises each channel to mean 0 and standard deviation 1 using this set's own
    /// statistics, and returns them `(mean, std)` so a validation or test set can be
    /// transformed identically with [`ImageSet::normalize_with`].
    pub fn normalize(&mut self) -> (Vec<f32>, Vec<f32>) {
        let (mean, std) = self.channel_stats();
        self.standardise(&mean, &std);
        (mean, std)
    }

    /// `x = (x - mean[ch]) / std[ch]` for every pixel. Fails ([`DataError::PerChannel`]),
    /// changing nothing, if `mean` or `std` does not have `c` entries.
    pub fn normalize_with(&mut self, mean: &[f32], std: &[f32]) -> Result<(), DataError> {
        for (what, got) in [("mean", mean.len()), ("std", std.len())] {
            if got != self.c {
                return Err(DataError::PerChannel {
                    what,
                    got,
                    channels: self.c,
                });
            }
        }
        self.standardise(mean, std);
        Ok(())
    }

    /// [`ImageSet::normalize_with`] with `c` entries in each of `mean` and `std`.
    fn standardise(&mut self, mean: &[f32], std: &[f32]) {
        let hw = self.h * self.w;
        if hw == 0 {
            return;
        }
        let len = self.image_len();
        for img in self.images.chunks_exact_mut(len) {
            for (ch, plane) in img.chunks_exact_mut(hw).enumerate() {
                let (m, s) = (mean[ch], std[ch]);
                for v in plane {
                    *v = (*v - m) / s;
                }
            }
        }
    }

    /// The images at `indices`, in that order, as a new set (same `num_classes`). Fails as
    /// [`ImageSet::batch`] does.
    pub fn subset(&self, indices: &[usize]) -> Result<ImageSet, DataError> {
        self.check_indices(indices)?;
        Ok(self.gathered(indices))
    }

    /// [`ImageSet::subset`] of indices known to be below `n`.
    fn gathered(&self, indices: &[usize]) -> ImageSet {
        let (images, labels) = self.gather(indices);
        ImageSet {
            images,
            labels,
            n: indices.len(),
            c: self.c,
            h: self.h,
            w: self.w,
            num_classes: self.num_classes,
        }
    }

    /// Contiguous split: the first `round(n * fraction)` images and the rest. (Synthetic
    /// sets are already in random order; for sorted data, [`ImageSet::subset`] a shuffled
    /// index list instead.) Fails ([`DataError::Fraction`]) if `fraction` is not within
    /// `[0, 1]`.
    pub fn split(&self, fraction: f64) -> Result<(ImageSet, ImageSet), DataError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(DataError::Fraction { fraction });
        }
        let k = ((self.n as f64 * fraction).round() as usize).min(self.n);
        let first: Vec<usize> = (0..k).collect();
        let rest: Vec<usize> = (k..self.n).collect();
        Ok((self.gathered(&first), self.gathered(&rest)))
    }

    /// A few-shot subset: the first `k` images of each class (all of a class if it has
    /// fewer), keeping their original order.
    pub fn take_per_class(&self, k: usize) -> ImageSet {
        let mut taken = vec![0usize; self.num_classes];
        let idx: Vec<usize> = (0..self.n)
            .filter(|&i| {
                let t = &mut taken[self.labels[i] as usize];
                *t += 1;
                *t <= k
            })
            .collect();
        self.gathered(&idx)
    }

    /// The images whose label is in `classes`, relabelled by position in `classes`
    /// (`classes[j]` becomes `j`; `num_classes = classes.len()`), keeping their order. With
    /// disjoint class lists this gives two related tasks from one set, e.g. pre-train on
    /// shapes 0–4 and fine-tune on shapes 5–9. Fails ([`DataError::RepeatedClass`]) if
    /// `classes` repeats a class.
    pub fn filter_classes(&self, classes: &[u32]) -> Result<ImageSet, DataError> {
        if let Some((first, second, &class)) = classes.iter().enumerate().find_map(|(j, c)| {
            let first = classes[..j].iter().position(|p| p == c)?;
            Some((first, j, c))
        }) {
            return Err(DataError::RepeatedClass {
                class,
                first,
                second,
            });
        }
        let mut map = vec![None; self.num_classes];
        for (j, &cl) in classes.iter().enumerate() {
            if let Some(slot) = map.get_mut(cl as usize) {
                *slot = Some(j as u32);
            }
        }
        let idx: Vec<usize> = (0..self.n)
            .filter(|&i| map[self.labels[i] as usize].is_some())
            .collect();
        let mut out = self.gathered(&idx);
        for l in &mut out.labels {
            *l = map[*l as usize].expect("kept labels are mapped");
        }
        out.num_classes = classes.len();
        Ok(out)
    }

    /// How many images each class has (`num_classes` entries).
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0usize; self.num_classes];
        for &l in &self.labels {
            counts[l as usize] += 1;
        }
        counts
    }

    /// Appends `other`'s images (same `c`, `h`, `w`); `num_classes` becomes the larger.
    pub fn append(&mut self, other: &ImageSet) -> Result<(), DataError> {
        if (self.c, self.h, self.w) != (other.c, other.h, other.w) {
            return Err(DataError::invalid(format!(
                "cannot append {}x{}x{} images to a set of {}x{}x{} images",
                other.c, other.h, other.w, self.c, self.h, self.w
            )));
        }
        self.images.extend_from_slice(&other.images);
        self.labels.extend_from_slice(&other.labels);
        self.n += other.n;
        self.num_classes = self.num_classes.max(other.num_classes);
        Ok(())
    }

    /// A deterministic synthetic classification set (see [`SyntheticTask`]): `n` images of
    /// `c × h × w` pixels in `[0, 1]`, labels balanced (class counts differ by at most one)
    /// and in random order. Image `i` depends only on `(kind, seed, i, its label)`.
    ///
    /// Fails ([`DataError::SyntheticShape`]) if `c == 0`, `h < 8`, `w < 8`, or `num_classes`
    /// is not in `2..=SyntheticTask::MAX_CLASSES`.
    pub fn synthetic(
        kind: SyntheticTask,
        n: usize,
        c: usize,
        h: usize,
        w: usize,
        num_classes: usize,
        seed: u64,
    ) -> Result<ImageSet, DataError> {
        let max_classes = SyntheticTask::MAX_CLASSES;
        if c == 0 || h < 8 || w < 8 || !(2..=max_classes).contains(&num_classes) {
            return Err(DataError::SyntheticShape {
                c,
                h,
                w,
                num_classes,
                max_classes,
            });
        }
        let mut labels: Vec<u32> = (0..n).map(|i| (i % num_classes) as u32).collect();
        Rng::from_parts(&[seed, kind.tag(), u64::MAX]).shuffle(&mut labels);
        let len = c * h * w;
        let total = len.checked_mul(n).ok_or_else(|| {
            DataError::invalid(format!("{n} images of {c}x{h}x{w} pixels overflow usize"))
        })?;
        let mut images = vec![0f32; total];
        for (i, (img, &label)) in images.chunks_exact_mut(len).zip(&labels).enumerate() {
            let mut rng = Rng::from_parts(&[seed, kind.tag(), i as u64]);
            match kind {
                SyntheticTask::Shapes => draw_shape(img, c, h, w, label as usize, &mut rng),
                SyntheticTask::Stripes => {
                    draw_stripes(img, c, h, w, label as usize, num_classes, &mut rng)
                }
            }
        }
        Ok(ImageSet {
            images,
            labels,
            n,
            c,
            h,
            w,
            num_classes,
        })
    }
}

/// Noise standard deviation of synthetic pixels.
const NOISE: f64 = 0.08;

/// Random foreground and background colours with at least 0.15 contrast per channel.
fn colours(c: usize, rng: &mut Rng) -> (Vec<f64>, Vec<f64>) {
    let fg = (0..c).map(|_| rng.range(0.5, 1.0)).collect();
    let bg = (0..c).map(|_| rng.range(0.0, 0.35)).collect();
    (fg, bg)
}

/// Writes `bg + (fg - bg) * cover(x, y) + noise`, clamped to `[0, 1]`, with `cover` in
/// `[0, 1]`.
fn paint(
    img: &mut [f32],
    c: usize,
    h: usize,
    w: usize,
    rng: &mut Rng,
    cover: impl Fn(f64, f64) -> f64,
) {
    let (fg, bg) = colours(c, rng);
    for y in 0..h {
        for x in 0..w {
            let a = cover(x as f64 + 0.5, y as f64 + 0.5);
            for ch in 0..c {
                let v = bg[ch] + (fg[ch] - bg[ch]) * a + NOISE * rng.normal();
                img[(ch * h + y) * w + x] = v.clamp(0.0, 1.0) as f32;
            }
        }
    }
}

fn draw_shape(img: &mut [f32], c: usize, h: usize, w: usize, shape: usize, rng: &mut Rng) {
    let s = h.min(w) as f64;
    let r = rng.range(0.2 * s, 0.34 * s);
    let cx = rng.range(r, w as f64 - r);
    let cy = rng.range(r, h as f64 - r);
    let t = (0.22 * r).max(0.75); // stroke half-width
                                  // 2x2 supersampling gives soft edges, so small shapes are still distinguishable.
    let inside = move |px: f64, py: f64| -> bool {
        let (dx, dy) = (px - cx, py - cy);
        let (ax, ay) = (dx.abs(), dy.abs());
        let d = (dx * dx + dy * dy).sqrt();
        match shape {
            0 => d <= r,
            1 => ax <= 0.8 * r && ay <= 0.8 * r,
            2 => (ax <= t && ay <= r) || (ay <= t && ax <= r),
            3 => {
                ax <= 0.8 * r
                    && ay <= 0.8 * r
                    && ((dx - dy).abs() / 2f64.sqrt() <= t || (dx + dy).abs() / 2f64.sqrt() <= t)
            }
            4 => d <= r && d >= r - 2.0 * t,
            5 => {
                let m = ax.max(ay);
                m <= 0.85 * r && m >= 0.85 * r - 2.0 * t
            }
            6 => dy.abs() <= 0.8 * r && ax <= 0.55 * (dy + 0.8 * r),
            7 => ax + ay <= r,
            8 => ay <= t && ax <= r,
            _ => ax <= t && ay <= r,
        }
    };
    paint(img, c, h, w, rng, |x, y| {
        let hits = [(-0.25, -0.25), (0.25, -0.25), (-0.25, 0.25), (0.25, 0.25)]
            .iter()
            .filter(|(ox, oy)| inside(x + ox, y + oy))
            .count();
        hits as f64 / 4.0
    });
}

fn draw_stripes(
    img: &mut [f32],
    c: usize,
    h: usize,
    w: usize,
    class: usize,
    num_classes: usize,
    rng: &mut Rng,
) {
    let spacing = std::f64::consts::PI / num_classes as f64;
    let theta = class as f64 * spacing + rng.range(-0.35, 0.35) * spacing;
    let s = h.min(w) as f64;
    let period = rng.range(3.0, (s / 3.0).max(4.0));
    let phase = rng.range(0.0, std::f64::consts::TAU);
    // A round aperture (soft edge) at a random position; background outside it.
    let radius = rng.range(0.3 * s, 0.5 * s);
    let cx = rng.range(0.3 * w as f64, 0.7 * w as f64);
    let cy = rng.range(0.3 * h as f64, 0.7 * h as f64);
    let (cos, sin) = (theta.cos(), theta.sin());
    let k = std::f64::consts::TAU / period;
    paint(img, c, h, w, rng, |x, y| {
        let d = ((x - cx).powi(2) + (y - cy).powi(2)).sqrt();
        let window = ((radius - d) / 1.5).clamp(0.0, 1.0);
        window * (0.5 + 0.5 * (k * (x * cos + y * sin) + phase).sin())
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> ImageSet {
        // 4 images of 2x2x3, pixel value = image index * 100 + position.
        let images = (0..4)
            .flat_map(|i| (0..12).map(move |p| (i * 100 + p) as f32))
            .collect();
        ImageSet::new(images, vec![0, 1, 0, 2], 4, 2, 2, 3, 3).unwrap()
    }

    #[test]
    fn new_validates() {
        assert!(ImageSet::new(vec![0.0; 11], vec![0; 1], 1, 1, 3, 4, 2).is_err());
        assert!(ImageSet::new(vec![0.0; 12], vec![0; 2], 1, 1, 3, 4, 2).is_err());
        let e = ImageSet::new(vec![0.0; 12], vec![2], 1, 1, 3, 4, 2).unwrap_err();
        assert!(e.to_string().contains("label 2"), "{e}");
        assert!(ImageSet::new(vec![0.0; 12], vec![1], 1, 1, 3, 4, 2).is_ok());
    }

    #[test]
    fn batch_gathers_in_order() {
        let s = tiny();
        let (x, y) = s.batch(&[3, 1]).unwrap();
        assert_eq!(y, vec![2, 1]);
        assert_eq!(x.len(), 24);
        assert_eq!(x[0], 300.0);
        assert_eq!(x[12], 100.0);
        assert_eq!(x[23], 111.0);
    }

    #[test]
    fn shuffled_batches_are_deterministic_permutations() {
        let s = ImageSet::synthetic(SyntheticTask::Shapes, 23, 1, 8, 8, 4, 0).unwrap();
        let b = s.shuffled_batches(5, 9, 0).unwrap();
        assert_eq!(b.len(), 4);
        assert!(b.iter().all(|x| x.len() == 5));
        let mut all: Vec<usize> = b.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 20);
        assert_eq!(b, s.shuffled_batches(5, 9, 0).unwrap());
        assert_ne!(b, s.shuffled_batches(5, 9, 1).unwrap());
        assert_ne!(b, s.shuffled_batches(5, 10, 0).unwrap());
        let mut p = s.shuffled_indices(9, 0);
        p.sort_unstable();
        assert_eq!(p, (0..23).collect::<Vec<_>>());
    }

    #[test]
    fn normalize_gives_zero_mean_unit_std_per_channel() {
        let mut s = ImageSet::synthetic(SyntheticTask::Stripes, 40, 3, 8, 8, 4, 1).unwrap();
        let mut v = s.clone();
        let (mean, std) = s.normalize();
        assert_eq!(mean.len(), 3);
        let (m2, s2) = s.channel_stats();
        for ch in 0..3 {
            assert!(m2[ch].abs() < 1e-4, "{m2:?}");
            assert!((s2[ch] - 1.0).abs() < 1e-3, "{s2:?}");
            assert!(mean[ch] > 0.0 && mean[ch] < 1.0 && std[ch] > 0.05);
        }
        v.normalize_with(&mean, &std).unwrap();
        assert_eq!(v, s);
    }

    #[test]
    fn normalize_constant_channel_is_finite() {
        let mut s = ImageSet::new(vec![0.5; 8], vec![0, 0], 2, 1, 2, 2, 1).unwrap();
        s.normalize();
        assert!(s.images.iter().all(|v| v.is_finite() && v.abs() < 1e-3));
    }

    #[test]
    fn split_subset_append() {
        let s = tiny();
        let (a, b) = s.split(0.75).unwrap();
        assert_eq!((a.n, b.n), (3, 1));
        assert_eq!(b.labels, vec![2]);
        assert_eq!(b.images[0], 300.0);
        let mut j = a.clone();
        j.append(&b).unwrap();
        assert_eq!(j, s);
        let other = ImageSet::new(vec![0.0; 4], vec![0], 1, 1, 2, 2, 1).unwrap();
        assert!(j.append(&other).is_err());
        let (all, none) = s.split(1.0).unwrap();
        assert_eq!((all.n, none.n), (4, 0));
    }

    #[test]
    fn take_per_class_is_few_shot() {
        let s = ImageSet::synthetic(SyntheticTask::Shapes, 100, 1, 8, 8, 5, 2).unwrap();
        let f = s.take_per_class(3);
        assert_eq!(f.n, 15);
        assert_eq!(f.class_counts(), vec![3; 5]);
        assert_eq!(f.num_classes, 5);
        // The first image of the subset is the first image of the full set.
        assert_eq!(f.image(0), s.image(0));
        let t = tiny().take_per_class(1);
        assert_eq!(t.labels, vec![0, 1, 2]);
    }

    #[test]
    fn filter_classes_relabels() {
        let s = tiny(); // labels 0, 1, 0, 2
        let f = s.filter_classes(&[2, 0]).unwrap();
        assert_eq!(f.labels, vec![1, 1, 0]);
        assert_eq!(f.num_classes, 2);
        assert_eq!(f.image(2), s.image(3));
        let g = ImageSet::synthetic(SyntheticTask::Shapes, 100, 1, 8, 8, 10, 0).unwrap();
        let hi = g.filter_classes(&[5, 6, 7, 8, 9]).unwrap();
        assert_eq!(hi.class_counts(), vec![10; 5]);
        // Classes beyond num_classes simply match nothing.
        assert_eq!(s.filter_classes(&[7]).unwrap().n, 0);
    }

    #[test]
    fn synthetic_is_deterministic_balanced_and_in_range() {
        for kind in [SyntheticTask::Shapes, SyntheticTask::Stripes] {
            let a = ImageSet::synthetic(kind, 103, 3, 16, 12, 10, 5).unwrap();
            let b = ImageSet::synthetic(kind, 103, 3, 16, 12, 10, 5).unwrap();
            let c = ImageSet::synthetic(kind, 103, 3, 16, 12, 10, 6).unwrap();
            assert_eq!(a, b);
            assert_ne!(a.images, c.images);
            assert_eq!(a.images.len(), 103 * 3 * 16 * 12);
            let counts = a.class_counts();
            let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            assert!(hi - lo <= 1, "{counts:?}");
            assert!(a.images.iter().all(|v| (0.0..=1.0).contains(v)));
            // Labels are shuffled, not cyclic.
            assert_ne!(a.labels[..10], (0..10).collect::<Vec<u32>>()[..]);
        }
        let s = ImageSet::synthetic(SyntheticTask::Shapes, 10, 1, 8, 8, 2, 0).unwrap();
        let t = ImageSet::synthetic(SyntheticTask::Stripes, 10, 1, 8, 8, 2, 0).unwrap();
        assert_ne!(s.images, t.images);
    }

    /// Was `should_panic(expected = "classes")` while `synthetic` panicked; the same input now
    /// gives the error, with the same word.
    #[test]
    fn synthetic_rejects_too_many_classes() {
        let e = ImageSet::synthetic(SyntheticTask::Shapes, 10, 1, 8, 8, 11, 0).unwrap_err();
        assert!(e.to_string().contains("classes"), "{e}");
        assert!(
            matches!(
                e,
                DataError::SyntheticShape {
                    num_classes: 11,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn bad_shapes_and_arguments_are_errors_naming_the_values() {
        let bad = [(0, 8, 8, 2), (1, 7, 8, 2), (1, 8, 4, 2), (1, 8, 8, 1)];
        for (c, h, w, k) in bad {
            let e = ImageSet::synthetic(SyntheticTask::Stripes, 4, c, h, w, k, 0).unwrap_err();
            let shown = format!("{c} channel(s), {h}x{w} pixels, {k} classes");
            assert!(e.to_string().contains(&shown), "{e}");
        }
        let s = tiny(); // 4 images
        for r in [s.batch(&[0, 4, 9]).map(|_| ()), s.subset(&[4]).map(|_| ())] {
            let e = r.unwrap_err();
            assert!(
                matches!(e, DataError::IndexOutOfRange { index: 4, n: 4 }),
                "{e:?}"
            );
            assert!(e.to_string().contains("index 4"), "{e}");
        }
        let e = s.shuffled_batches(0, 1, 0).unwrap_err();
        assert!(matches!(e, DataError::Zero { what: "batch_size" }), "{e:?}");
        let e = s.split(1.5).unwrap_err();
        assert!(e.to_string().contains("1.5"), "{e}");
        let e = s.filter_classes(&[1, 2, 1]).unwrap_err();
        assert!(
            matches!(
                e,
                DataError::RepeatedClass {
                    class: 1,
                    first: 0,
                    second: 2
                }
            ),
            "{e:?}"
        );
        let mut m = s.clone();
        let e = m.normalize_with(&[0.0; 2], &[1.0; 3]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "need one std per channel: got 3 for 2 channel(s)"
        );
        assert_eq!(m, s, "a refused normalisation changes nothing");
        let e = m.normalize_with(&[0.0], &[1.0; 2]).unwrap_err();
        assert!(e.to_string().contains("one mean per channel"), "{e}");
    }

    /// Nearest-class-mean accuracy on raw pixels: the tasks should be learnable (above
    /// chance for even this trivial classifier) but not trivial (well short of perfect),
    /// since shapes move and stripes shift phase.
    #[test]
    fn synthetic_tasks_are_learnable_but_not_trivial() {
        for kind in [SyntheticTask::Shapes, SyntheticTask::Stripes] {
            let all = ImageSet::synthetic(kind, 1200, 1, 16, 16, 4, 3).unwrap();
            let (train, test) = all.split(0.75).unwrap();
            let len = train.image_len();
            let mut means = vec![vec![0f64; len]; 4];
            for i in 0..train.n {
                for (m, &v) in means[train.labels[i] as usize]
                    .iter_mut()
                    .zip(train.image(i))
                {
                    *m += v as f64;
                }
            }
            let counts = train.class_counts();
            for (m, &k) in means.iter_mut().zip(&counts) {
                m.iter_mut().for_each(|v| *v /= k as f64);
            }
            let correct = (0..test.n)
                .filter(|&i| {
                    let img = test.image(i);
                    let dist = |m: &Vec<f64>| -> f64 {
                        m.iter()
                            .zip(img)
                            .map(|(a, &b)| (a - b as f64).powi(2))
                            .sum()
                    };
                    let best = (0..4)
                        .min_by(|&a, &b| dist(&means[a]).total_cmp(&dist(&means[b])))
                        .unwrap();
                    best == test.labels[i] as usize
                })
                .count();
            let acc = correct as f64 / test.n as f64;
            eprintln!("{kind:?}: nearest-mean accuracy {acc:.3}");
            assert!(acc < 0.9, "{kind:?} too easy: {acc}");
        }
    }
}
