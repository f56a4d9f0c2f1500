//! The IDX file format of MNIST (and Fashion-MNIST, EMNIST, KMNIST).
//!
//! Layout: a 4-byte magic number `0x00 0x00 type ndims` (type `0x08` = unsigned byte),
//! then `ndims` big-endian `u32` dimensions, then the data. Image files have 3 dimensions
//! `[n, rows, cols]` (magic `0x00000803`), label files one `[n]` (magic `0x00000801`).
//! Only the decompressed files are read (gzip input gets a clear error).

use super::{read_file, reject_gzip, write_file, DataError, ImageSet};
use std::path::Path;

/// Magic number of an unsigned-byte, 3-dimensional IDX file (images).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an unsigned-byte, 1-dimensional IDX file (labels).
pub const LABELS_MAGIC: u32 = 0x0000_0801;

/// The raw contents of an IDX image file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdxImages {
    /// Number of images.
    pub n: usize,
    /// Rows (height).
    pub h: usize,
    /// Columns (width).
    pub w: usize,
    /// `n * h * w` bytes, row-major.
    pub pixels: Vec<u8>,
}

/// Parses the header; returns the dimensions and the header length.
fn parse_header(
    path: &Path,
    bytes: &[u8],
    magic: u32,
    what: &str,
) -> Result<(Vec<usize>, usize), DataError> {
    reject_gzip(path, bytes)?;
    if bytes.len() < 4 {
        return Err(DataError::format(
            path,
            format!(
                "file has {} bytes, too short for the 4-byte IDX magic number",
                bytes.len()
            ),
        ));
    }
    let found = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    if found != magic {
        let hint = match found {
            IMAGES_MAGIC => " (this is an image file)",
            LABELS_MAGIC => " (this is a label file)",
            _ if bytes[0] != 0 || bytes[1] != 0 => " (not an IDX file)",
            _ if bytes[2] != 0x08 => " (element type is not unsigned byte)",
            _ => "",
        };
        return Err(DataError::format(
            path,
            format!("bad magic number 0x{found:08x} for an IDX {what} file, expected 0x{magic:08x}{hint}"),
        ));
    }
    let ndims = (magic & 0xff) as usize;
    let header = 4 + 4 * ndims;
    if bytes.len() < header {
        return Err(DataError::format(
            path,
            format!(
                "file has {} bytes, too short for the {header}-byte header of {ndims} dimension(s)",
                bytes.len()
            ),
        ));
    }
    let dims = (0..ndims)
        .map(|d| {
            let o = 4 + 4 * d;
            u32::from_be_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]) as usize
        })
        .collect();
    Ok((dims, header))
}

/// Checks that exactly `expected` data bytes follow the header.
fn check_len(
    path: &Path,
    bytes: &[u8],
    header: usize,
    expected: usize,
    what: &str,
) -> Result<(), DataError> {
    let has = bytes.len() - header;
    if has != expected {
        let how = if has < expected {
            "truncated"
        } else {
            "trailing bytes"
        };
        return Err(DataError::format(
            path,
            format!("expected {expected} {what} bytes, file has {has} ({how})"),
        ));
    }
    Ok(())
}

/// Reads an IDX image file (`[n, rows, cols]` unsigned bytes).
///
/// Errors name the file and the problem: missing or unreadable file, gzip-compressed, bad
/// magic number, zero rows or columns, or a data length other than `n * rows * cols`
/// (e.g. "expected 7840000 image bytes, file has 1234 (truncated)").
pub fn read_idx_images(path: impl AsRef<Path>) -> Result<IdxImages, DataError> {
    let path = path.as_ref();
    let bytes = read_file(path)?;
    let (dims, header) = parse_header(path, &bytes, IMAGES_MAGIC, "image")?;
    let (n, h, w) = (dims[0], dims[1], dims[2]);
    if h == 0 || w == 0 {
        return Err(DataError::format(
            path,
            format!("image dimensions {h}x{w} contain a zero"),
        ));
    }
    let expected = n
        .checked_mul(h)
        .and_then(|x| x.checked_mul(w))
        .ok_or_else(|| DataError::format(path, format!("dimensions {n}x{h}x{w} overflow")))?;
    check_len(path, &bytes, header, expected, "image")?;
    Ok(IdxImages {
        n,
        h,
        w,
        pixels: bytes[header..].to_vec(),
    })
}

/// Reads an IDX label file (`[n]` unsigned bytes). Errors as for [`read_idx_images`].
pub fn read_idx_labels(path: impl AsRef<Path>) -> Result<Vec<u8>, DataError> {
    let path = path.as_ref();
    let bytes = read_file(path)?;
    let (dims, header) = parse_header(path, &bytes, LABELS_MAGIC, "label")?;
    check_len(path, &bytes, header, dims[0], "label")?;
    Ok(bytes[header..].to_vec())
}

/// Reads an MNIST-style pair of image and label files into an [`ImageSet`] with one
/// channel, pixels scaled to `[0, 1]`, and `num_classes = max(10, largest label + 1)`.
/// Fails, naming the label file, if the counts differ.
pub fn read_mnist(
    images_path: impl AsRef<Path>,
    labels_path: impl AsRef<Path>,
) -> Result<ImageSet, DataError> {
    let images = read_idx_images(images_path.as_ref())?;
    let labels = read_idx_labels(labels_path.as_ref())?;
    if labels.len() != images.n {
        return Err(DataError::format(
            labels_path.as_ref(),
            format!(
                "has {} labels but '{}' has {} images",
                labels.len(),
                images_path.as_ref().display(),
                images.n
            ),
        ));
    }
    let num_classes = labels.iter().map(|&l| l as usize + 1).max().unwrap_or(0);
    Ok(ImageSet {
        images: images.pixels.iter().map(|&p| p as f32 / 255.0).collect(),
        labels: labels.into_iter().map(u32::from).collect(),
        n: images.n,
        c: 1,
        h: images.h,
        w: images.w,
        num_classes: num_classes.max(10),
    })
}

/// Writes an IDX image file of `n` images of `h × w` bytes (`pixels.len()` must be
/// `n * h * w`, and each dimension must fit in a `u32`).
pub fn write_idx_images(
    path: impl AsRef<Path>,
    n: usize,
    h: usize,
    w: usize,
    pixels: &[u8],
) -> Result<(), DataError> {
    if Some(pixels.len()) != n.checked_mul(h).and_then(|x| x.checked_mul(w)) {
        return Err(DataError::invalid(format!(
            "{} pixel bytes do not make {n} images of {h}x{w}",
            pixels.len()
        )));
    }
    let mut out = IMAGES_MAGIC.to_be_bytes().to_vec();
    for d in [n, h, w] {
        out.extend_from_slice(&dim_u32(d)?.to_be_bytes());
    }
    out.extend_from_slice(pixels);
    write_file(path.as_ref(), &out)
}

/// Writes an IDX label file.
pub fn write_idx_labels(path: impl AsRef<Path>, labels: &[u8]) -> Result<(), DataError> {
    let mut out = LABELS_MAGIC.to_be_bytes().to_vec();
    out.extend_from_slice(&dim_u32(labels.len())?.to_be_bytes());
    out.extend_from_slice(labels);
    write_file(path.as_ref(), &out)
}

fn dim_u32(d: usize) -> Result<u32, DataError> {
    u32::try_from(d).map_err(|_| DataError::invalid(format!("dimension {d} does not fit in u32")))
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

    fn err_text(r: Result<impl std::fmt::Debug, DataError>, path: &Path) -> String {
        let e = r.unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains(&*path.to_string_lossy()),
            "error does not name file: {s}"
        );
        s
    }

    #[test]
    fn images_and_labels_round_trip() {
        let (fi, fl) = (temp("rt-images.idx"), temp("rt-labels.idx"));
        let pixels: Vec<u8> = (0..3 * 4 * 5).map(|i| (i * 4) as u8).collect();
        write_idx_images(&fi.0, 3, 4, 5, &pixels).unwrap();
        write_idx_labels(&fl.0, &[7, 0, 3]).unwrap();
        let img = read_idx_images(&fi.0).unwrap();
        assert_eq!((img.n, img.h, img.w), (3, 4, 5));
        assert_eq!(img.pixels, pixels);
        assert_eq!(read_idx_labels(&fl.0).unwrap(), vec![7, 0, 3]);
        // Header bytes as in the MNIST files.
        let raw = std::fs::read(&fi.0).unwrap();
        assert_eq!(&raw[..8], &[0, 0, 8, 3, 0, 0, 0, 3]);

        let set = read_mnist(&fi.0, &fl.0).unwrap();
        assert_eq!(
            (set.n, set.c, set.h, set.w, set.num_classes),
            (3, 1, 4, 5, 10)
        );
        assert_eq!(set.labels, vec![7, 0, 3]);
        assert_eq!(set.images[0], 0.0);
        assert!((set.images[1] - 4.0 / 255.0).abs() < 1e-7);
        assert!(set.images.iter().all(|v| (0.0..=1.0).contains(v)));
    }

    #[test]
    fn empty_files_round_trip() {
        let (fi, fl) = (temp("empty-images.idx"), temp("empty-labels.idx"));
        write_idx_images(&fi.0, 0, 28, 28, &[]).unwrap();
        write_idx_labels(&fl.0, &[]).unwrap();
        let set = read_mnist(&fi.0, &fl.0).unwrap();
        assert_eq!((set.n, set.h, set.w), (0, 28, 28));
    }

    #[test]
    fn missing_file() {
        let p = temp_path("missing.idx");
        let s = err_text(read_idx_images(&p), &p);
        assert!(s.contains("not found"), "{s}");
        let s = err_text(read_idx_labels(&p), &p);
        assert!(s.contains("not found"), "{s}");
    }

    #[test]
    fn bad_magic() {
        let f = temp("bad-magic.idx");
        // A label file where an image file is expected.
        write_idx_labels(&f.0, &[1, 2]).unwrap();
        let s = err_text(read_idx_images(&f.0), &f.0);
        assert!(s.contains("bad magic") && s.contains("label file"), "{s}");
        // An image file where a label file is expected.
        write_idx_images(&f.0, 1, 1, 1, &[0]).unwrap();
        let s = err_text(read_idx_labels(&f.0), &f.0);
        assert!(s.contains("bad magic") && s.contains("image file"), "{s}");
        // Not IDX at all.
        std::fs::write(&f.0, b"hello world").unwrap();
        let s = err_text(read_idx_images(&f.0), &f.0);
        assert!(s.contains("not an IDX file"), "{s}");
        // Wrong element type (0x0D = float).
        std::fs::write(&f.0, [0, 0, 0x0d, 3, 0, 0, 0, 0]).unwrap();
        let s = err_text(read_idx_images(&f.0), &f.0);
        assert!(s.contains("unsigned byte"), "{s}");
        // gzip.
        std::fs::write(&f.0, [0x1f, 0x8b, 8, 0, 0, 0]).unwrap();
        let s = err_text(read_idx_images(&f.0), &f.0);
        assert!(s.contains("gzip"), "{s}");
    }

    #[test]
    fn short_header() {
        let f = temp("short-header.idx");
        std::fs::write(&f.0, [0, 0]).unwrap();
        let s = err_text(read_idx_images(&f.0), &f.0);
        assert!(s.contains("magic"), "{s}");
        std::fs::write(&f.0, [0, 0, 8, 3, 0, 0, 0, 1, 0, 0]).unwrap();
        let s = err_text(read_idx_images(&f.0), &f.0);
        assert!(s.contains("16-byte header"), "{s}");
        std::fs::write(&f.0, [0, 0, 8, 1, 0]).unwrap();
        let s = err_text(read_idx_labels(&f.0), &f.0);
        assert!(s.contains("8-byte header"), "{s}");
    }

    #[test]
    fn truncated_and_trailing_data() {
        let f = temp("truncated.idx");
        let mut bytes = IMAGES_MAGIC.to_be_bytes().to_vec();
        for d in [10_000u32, 28, 28] {
            bytes.extend_from_slice(&d.to_be_bytes());
        }
        bytes.extend_from_slice(&[0u8; 1234]);
        std::fs::write(&f.0, &bytes).unwrap();
        let s = err_text(read_idx_images(&f.0), &f.0);
        assert!(
            s.contains("expected 7840000 image bytes, file has 1234"),
            "{s}"
        );

        write_idx_labels(&f.0, &[1, 2, 3]).unwrap();
        let mut raw = std::fs::read(&f.0).unwrap();
        raw.push(4);
        std::fs::write(&f.0, &raw).unwrap();
        let s = err_text(read_idx_labels(&f.0), &f.0);
        assert!(
            s.contains("expected 3 label bytes, file has 4 (trailing"),
            "{s}"
        );
        raw.truncate(raw.len() - 2);
        std::fs::write(&f.0, &raw).unwrap();
        let s = err_text(read_idx_labels(&f.0), &f.0);
        assert!(
            s.contains("expected 3 label bytes, file has 2 (truncated"),
            "{s}"
        );
    }

    #[test]
    fn zero_dimension() {
        let f = temp("zero-dim.idx");
        std::fs::write(&f.0, [0, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 5]).unwrap();
        let s = err_text(read_idx_images(&f.0), &f.0);
        assert!(s.contains("zero"), "{s}");
    }

    #[test]
    fn count_mismatch_names_both_files() {
        let (fi, fl) = (temp("mm-images.idx"), temp("mm-labels.idx"));
        write_idx_images(&fi.0, 2, 2, 2, &[0; 8]).unwrap();
        write_idx_labels(&fl.0, &[1, 2, 3]).unwrap();
        let s = err_text(read_mnist(&fi.0, &fl.0), &fl.0);
        assert!(s.contains(&*fi.0.to_string_lossy()), "{s}");
        assert!(s.contains("3 labels") && s.contains("2 images"), "{s}");
    }

    #[test]
    fn writer_validates_and_reports_write_errors() {
        let f = temp("w.idx");
        assert!(matches!(
            write_idx_images(&f.0, 2, 2, 2, &[0; 7]),
            Err(DataError::Invalid { .. })
        ));
        let dir = temp_path("no-such-dir").join("x.idx");
        let e = write_idx_labels(&dir, &[1]).unwrap_err();
        assert!(e.to_string().contains("cannot write"), "{e}");
        assert_eq!(e.path(), Some(dir.as_path()));
    }
}
