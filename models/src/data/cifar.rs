//! The CIFAR-10 binary format (`data_batch_1.bin` ... `test_batch.bin`).
//!
//! A file is a sequence of 3073-byte records: one label byte (0–9), then 3072 pixel bytes,
//! 1024 red, 1024 green, 1024 blue, each a row-major 32×32 plane (CHW). Files may be
//! concatenated. Only the extracted `.bin` files are read (gzip input gets a clear error).

use super::{read_file, reject_gzip, write_file, DataError, ImageSet};
use std::path::Path;

/// Channels, height and width of a CIFAR-10 image.
pub const CIFAR_CHW: (usize, usize, usize) = (3, 32, 32);
/// Pixel bytes per image (3 × 32 × 32).
pub const CIFAR_IMAGE_BYTES: usize = 3 * 32 * 32;
/// Bytes per record: one label byte and the pixels.
pub const CIFAR_RECORD_BYTES: usize = 1 + CIFAR_IMAGE_BYTES;
/// Number of CIFAR-10 classes.
pub const CIFAR_CLASSES: usize = 10;

/// Reads a CIFAR-10 binary file into an [`ImageSet`] (3×32×32, pixels scaled to `[0, 1]`,
/// 10 classes). Errors name the file: missing or unreadable, gzip-compressed, empty, a
/// length that is not a whole number of records (truncated last record), or a label above 9.
pub fn read_cifar10_bin(path: impl AsRef<Path>) -> Result<ImageSet, DataError> {
    let path = path.as_ref();
    let bytes = read_file(path)?;
    reject_gzip(path, &bytes)?;
    if bytes.is_empty() {
        return Err(DataError::format(
            path,
            "file is empty, expected CIFAR-10 records",
        ));
    }
    let n = bytes.len() / CIFAR_RECORD_BYTES;
    let rest = bytes.len() % CIFAR_RECORD_BYTES;
    if rest != 0 {
        return Err(DataError::format(
            path,
            format!(
                "file has {} bytes, not a whole number of {CIFAR_RECORD_BYTES}-byte records: \
                 {n} complete record(s) and a truncated one of {rest} bytes",
                bytes.len()
            ),
        ));
    }
    let mut images = Vec::with_capacity(n * CIFAR_IMAGE_BYTES);
    let mut labels = Vec::with_capacity(n);
    for (i, rec) in bytes.chunks_exact(CIFAR_RECORD_BYTES).enumerate() {
        if rec[0] as usize >= CIFAR_CLASSES {
            return Err(DataError::format(
                path,
                format!(
                    "record {i} (byte offset {}) has label {}, expected 0 to 9",
                    i * CIFAR_RECORD_BYTES,
                    rec[0]
                ),
            ));
        }
        labels.push(rec[0] as u32);
        images.extend(rec[1..].iter().map(|&p| p as f32 / 255.0));
    }
    let (c, h, w) = CIFAR_CHW;
    Ok(ImageSet {
        images,
        labels,
        n,
        c,
        h,
        w,
        num_classes: CIFAR_CLASSES,
    })
}

/// Reads several CIFAR-10 binary files (e.g. the five training batches) into one set, in
/// order. Fails on the first bad file, naming it.
pub fn read_cifar10_bins<P: AsRef<Path>>(paths: &[P]) -> Result<ImageSet, DataError> {
    let mut iter = paths.iter();
    let first = iter
        .next()
        .ok_or_else(|| DataError::invalid("no CIFAR-10 files given"))?;
    let mut set = read_cifar10_bin(first)?;
    for p in iter {
        set.append(&read_cifar10_bin(p)?)?;
    }
    Ok(set)
}

/// Writes CIFAR-10 records: `labels[i]` (0–9) followed by the 3072 CHW bytes of image `i`
/// from `pixels` (`labels.len() * 3072` bytes).
pub fn write_cifar10_bin(
    path: impl AsRef<Path>,
    labels: &[u8],
    pixels: &[u8],
) -> Result<(), DataError> {
    if pixels.len() != labels.len() * CIFAR_IMAGE_BYTES {
        return Err(DataError::invalid(format!(
            "{} pixel bytes do not make {} CIFAR-10 images of {CIFAR_IMAGE_BYTES} bytes",
            pixels.len(),
            labels.len()
        )));
    }
    if let Some((i, &l)) = labels
        .iter()
        .enumerate()
        .find(|(_, &l)| l as usize >= CIFAR_CLASSES)
    {
        return Err(DataError::invalid(format!(
            "label {l} of image {i} is not a CIFAR-10 class (0 to 9)"
        )));
    }
    let mut out = Vec::with_capacity(labels.len() * CIFAR_RECORD_BYTES);
    for (&l, img) in labels.iter().zip(pixels.chunks_exact(CIFAR_IMAGE_BYTES)) {
        out.push(l);
        out.extend_from_slice(img);
    }
    write_file(path.as_ref(), &out)
}

#[cfg(test)]
mod tests {
    use super::super::temp_path;
    use super::*;
    use std::path::PathBuf;

    struct TempFile(PathBuf);
    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    fn temp(tag: &str) -> TempFile {
        TempFile(temp_path(tag))
    }

    fn pixels(n: usize, seed: usize) -> Vec<u8> {
        (0..n * CIFAR_IMAGE_BYTES)
            .map(|i| ((i * 7 + seed * 13) % 256) as u8)
            .collect()
    }

    fn err_text(r: Result<ImageSet, DataError>, path: &Path) -> String {
        let s = r.unwrap_err().to_string();
        assert!(
            s.contains(&*path.to_string_lossy()),
            "error does not name file: {s}"
        );
        s
    }

    #[test]
    fn round_trip() {
        let f = temp("rt.bin");
        let px = pixels(3, 1);
        write_cifar10_bin(&f.0, &[9, 0, 4], &px).unwrap();
        assert_eq!(std::fs::metadata(&f.0).unwrap().len(), 3 * 3073);
        let s = read_cifar10_bin(&f.0).unwrap();
        assert_eq!((s.n, s.c, s.h, s.w, s.num_classes), (3, 3, 32, 32, 10));
        assert_eq!(s.labels, vec![9, 0, 4]);
        let back: Vec<u8> = s.images.iter().map(|v| (v * 255.0).round() as u8).collect();
        assert_eq!(back, px);
        // CHW: the second image's green plane starts at its offset 1024.
        assert_eq!(s.image(1)[1024], px[3072 + 1024] as f32 / 255.0);
    }

    #[test]
    fn several_files_and_concatenated_file() {
        let (a, b, cat) = (temp("a.bin"), temp("b.bin"), temp("cat.bin"));
        write_cifar10_bin(&a.0, &[1, 2], &pixels(2, 1)).unwrap();
        write_cifar10_bin(&b.0, &[3], &pixels(1, 2)).unwrap();
        let both = read_cifar10_bins(&[&a.0, &b.0]).unwrap();
        assert_eq!(both.n, 3);
        assert_eq!(both.labels, vec![1, 2, 3]);
        let mut raw = std::fs::read(&a.0).unwrap();
        raw.extend(std::fs::read(&b.0).unwrap());
        std::fs::write(&cat.0, raw).unwrap();
        assert_eq!(read_cifar10_bin(&cat.0).unwrap(), both);
        let none: [&Path; 0] = [];
        assert!(read_cifar10_bins(&none).is_err());
        // The bad file is named.
        let missing = temp_path("missing-b.bin");
        let s = err_text(read_cifar10_bins(&[&a.0, &missing]), &missing);
        assert!(s.contains("not found"), "{s}");
    }

    #[test]
    fn truncated_record() {
        let f = temp("trunc.bin");
        write_cifar10_bin(&f.0, &[1, 2], &pixels(2, 0)).unwrap();
        let mut raw = std::fs::read(&f.0).unwrap();
        raw.truncate(raw.len() - 100);
        std::fs::write(&f.0, &raw).unwrap();
        let s = err_text(read_cifar10_bin(&f.0), &f.0);
        assert!(
            s.contains("1 complete record(s) and a truncated one of 2973 bytes"),
            "{s}"
        );
    }

    #[test]
    fn missing_empty_gzip_and_bad_label() {
        let p = temp_path("missing.bin");
        assert!(err_text(read_cifar10_bin(&p), &p).contains("not found"));
        let f = temp("bad.bin");
        std::fs::write(&f.0, []).unwrap();
        assert!(err_text(read_cifar10_bin(&f.0), &f.0).contains("empty"));
        let mut gz = vec![0x1f, 0x8b];
        gz.resize(CIFAR_RECORD_BYTES, 0);
        std::fs::write(&f.0, &gz).unwrap();
        assert!(err_text(read_cifar10_bin(&f.0), &f.0).contains("gzip"));
        let mut bad = vec![0u8; 2 * CIFAR_RECORD_BYTES];
        bad[CIFAR_RECORD_BYTES] = 10;
        std::fs::write(&f.0, &bad).unwrap();
        let s = err_text(read_cifar10_bin(&f.0), &f.0);
        assert!(s.contains("record 1") && s.contains("label 10"), "{s}");
    }

    #[test]
    fn writer_validates() {
        let f = temp("w.bin");
        assert!(write_cifar10_bin(&f.0, &[1], &[0; 10]).is_err());
        assert!(write_cifar10_bin(&f.0, &[10], &pixels(1, 0)).is_err());
        assert!(!f.0.exists());
    }
}
