//! Image folders against torchvision's `ImageFolder` with timm's eval transform for BiT: the
//! fixture (scripts/image_folder_reference.py) holds PNGs of four kinds and JPEGs of odd sizes,
//! larger and smaller than the output, and a file that is not an image; the reference is what
//! timm hands BiT for each: the fine-tuned model's transform (Resize(24) bilinear with
//! antialias, CenterCrop(24), ToTensor, Normalize(0.5, 0.5)) and the distilled one's (Resize(27)
//! bicubic, CenterCrop(24), ...).

mod common;

use common::*;
use wgpipe_models::data::{
    read_image_folder, read_image_folder_split, resize_set, ImageSet, Interpolation, Resize,
};
use wgpipe_models::hf::Preprocessing;

/// Both resize with an antialiased filter of the same kernel, but PIL rounds to 8 bits between
/// its horizontal and vertical passes and the `image` crate does not, and the JPEG decoders
/// (libjpeg-turbo, zune-jpeg) differ in their inverse DCT and chroma upsampling. Measured, in
/// levels of 255: bilinear at most 1 on PNGs and 3 on JPEGs (mean under 0.47); bicubic the
/// same but 5 on the palette PNG upsampled 24 -> 27, mean under 0.49. The bounds: 4 (bilinear) and 6 (bicubic) levels for any value,
/// 0.5 on average.
const MEAN_LEVELS: f32 = 0.5;

fn max_levels(pre: &Preprocessing) -> f32 {
    match pre.interpolation {
        Interpolation::Bilinear => 4.0,
        Interpolation::Bicubic => 6.0,
    }
}

/// The fixture read with `pre`'s resize at 24 pixels and normalisation, against the
/// reference's `{prefix}.image.{i}`.
fn equals_timm(prefix: &str, pre: &Preprocessing) {
    let dir = fixture_path("image_folder");
    let r = read_reference(&dir.join("reference.safetensors"));
    let mut folder = read_image_folder(&dir, &pre.resize(24)).unwrap();
    assert_eq!(folder.classes, ["cat", "dog"]);
    let names: Vec<String> = folder
        .files
        .iter()
        .map(|f| f.strip_prefix(&dir).unwrap().display().to_string())
        .collect();
    assert_eq!(
        names,
        [
            "cat/a.png",
            "cat/b.jpg",
            "cat/c.png",
            "cat/d.jpeg",
            "dog/e.png",
            "dog/f.png",
            "dog/g.JPG",
            "dog/h.png"
        ]
    );
    let labels: Vec<f32> = folder.set.labels.iter().map(|&l| l as f32).collect();
    assert_eq!(labels, r["labels"].1);
    folder.set.normalize_with(&pre.mean, &pre.std).unwrap();
    let level = 2.0 / 255.0;
    for (i, name) in names.iter().enumerate() {
        let (shape, want) = &r[&format!("{prefix}.image.{i}")];
        assert_eq!(shape, &[3, 24, 24]);
        let got = folder.set.image(i);
        let diffs: Vec<f32> = got.iter().zip(want).map(|(g, w)| (g - w).abs()).collect();
        let max = diffs.iter().cloned().fold(0.0, f32::max) / level;
        let mean = diffs.iter().sum::<f32>() / diffs.len() as f32 / level;
        eprintln!("{prefix} {name}: largest difference {max:.2} levels, mean {mean:.3}");
        assert!(
            max <= max_levels(pre),
            "{prefix} {name}: {max:.2} levels off"
        );
        assert!(
            mean <= MEAN_LEVELS,
            "{prefix} {name}: {mean:.3} levels off on average"
        );
    }
}

#[test]
fn an_image_folder_reads_as_timm_prepares_it_for_bit() {
    equals_timm("bit", &Preprocessing::bit());
}

#[test]
fn an_image_folder_reads_as_timm_prepares_it_for_the_distilled_bit() {
    let distilled = Preprocessing {
        crop_pct: 0.875,
        interpolation: Interpolation::Bicubic,
        ..Preprocessing::bit()
    };
    equals_timm("distilled", &distilled);
}

#[test]
fn a_folder_without_its_own_split_holds_out_one_image_of_each_class() {
    let dir = fixture_path("image_folder");
    let (train, test) = read_image_folder_split(&dir, &Resize::whole(8)).unwrap();
    // Four images a class, fewer than ten: the last of each class is held out.
    assert_eq!(train.set.labels, [0, 0, 0, 1, 1, 1]);
    assert_eq!(test.set.labels, [0, 1]);
    let names: Vec<_> = test.files.iter().map(|f| f.file_name().unwrap()).collect();
    assert_eq!(names, ["d.jpeg", "h.png"]);
    assert_eq!(train.classes, test.classes);
}

#[test]
fn train_and_val_folders_are_used_as_they_are_and_must_agree() {
    let root = std::env::temp_dir().join(format!("wgpipe-imgsplit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let src = fixture_path("image_folder");
    for (part, classes) in [("train", ["cat", "dog"]), ("val", ["cat", "dog"])] {
        for class in classes {
            std::fs::create_dir_all(root.join(part).join(class)).unwrap();
            let from = src
                .join(class)
                .join(if class == "cat" { "a.png" } else { "e.png" });
            std::fs::copy(&from, root.join(part).join(class).join("x.png")).unwrap();
        }
    }
    let (train, test) = read_image_folder_split(&root, &Resize::whole(8)).unwrap();
    assert_eq!((train.set.n, test.set.n), (2, 2));
    std::fs::create_dir_all(root.join("val").join("bird")).unwrap();
    std::fs::copy(src.join("cat/a.png"), root.join("val/bird/y.png")).unwrap();
    let e = read_image_folder_split(&root, &Resize::whole(8))
        .unwrap_err()
        .to_string();
    assert!(e.contains("val") && e.contains("bird"), "{e}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn bad_folders_and_files_are_named() {
    let root = std::env::temp_dir().join(format!("wgpipe-imgbad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("only")).unwrap();
    std::fs::copy(
        fixture_path("image_folder/cat/a.png"),
        root.join("only/a.png"),
    )
    .unwrap();
    let e = read_image_folder(&root, &Resize::whole(8))
        .unwrap_err()
        .to_string();
    assert!(e.contains("at least two") && e.contains("found 1"), "{e}");
    std::fs::create_dir_all(root.join("empty")).unwrap();
    let e = read_image_folder(&root, &Resize::whole(8))
        .unwrap_err()
        .to_string();
    assert!(e.contains("empty") && e.contains("without images"), "{e}");
    std::fs::write(root.join("empty/broken.jpg"), b"not a jpeg").unwrap();
    let e = read_image_folder(&root, &Resize::whole(8))
        .unwrap_err()
        .to_string();
    assert!(e.contains("broken.jpg") && e.contains("decoded"), "{e}");
    let missing = root.join("nowhere");
    let e = read_image_folder(&missing, &Resize::whole(8))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nowhere"), "{e}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// CIFAR-sized images resized for BiT: each one as the same pixels written to a PNG and read
/// back would be (the path both take), and upsampling a constant image keeps it constant.
#[test]
fn a_set_resizes_as_its_files_would() {
    let px: Vec<f32> = (0..2 * 3 * 6 * 10)
        .map(|i| (i % 256) as f32 / 255.0)
        .collect();
    let set = ImageSet::new(px, vec![0, 1], 2, 3, 6, 10, 2).unwrap();
    let big = resize_set(&set, &Resize::whole(12)).unwrap();
    assert_eq!((big.n, big.c, big.h, big.w), (2, 3, 12, 12));
    let dir = std::env::temp_dir().join(format!("wgpipe-imgset-{}", std::process::id()));
    for (i, class) in ["a", "b"].iter().enumerate() {
        std::fs::create_dir_all(dir.join(class)).unwrap();
        let img = set.image(i);
        let rgb = image::RgbImage::from_fn(10, 6, |x, y| {
            let at = |c: usize| (img[c * 60 + y as usize * 10 + x as usize] * 255.0).round() as u8;
            image::Rgb([at(0), at(1), at(2)])
        });
        rgb.save(dir.join(class).join("x.png")).unwrap();
    }
    let files = read_image_folder(&dir, &Resize::whole(12)).unwrap();
    assert_eq!(files.set.images, big.images);
    std::fs::remove_dir_all(&dir).unwrap();
    let flat = ImageSet::new(vec![0.25; 3 * 4 * 4], vec![0], 1, 3, 4, 4, 1).unwrap();
    let up = resize_set(&flat, &Resize::whole(9)).unwrap();
    let want = (0.25f32 * 255.0).round() / 255.0;
    assert!(up.images.iter().all(|&v| v == want));
    // A grey image resizes as the first channel of its RGB copy.
    let grey_px: Vec<f32> = (0..2 * 6 * 10)
        .map(|i| (i * 7 % 256) as f32 / 255.0)
        .collect();
    let grey = ImageSet::new(grey_px.clone(), vec![0, 1], 2, 1, 6, 10, 2).unwrap();
    let rgb_px: Vec<f32> = grey_px.chunks(60).flat_map(|g| g.repeat(3)).collect();
    let rgb = ImageSet::new(rgb_px, vec![0, 1], 2, 3, 6, 10, 2).unwrap();
    let (g, c) = (
        resize_set(&grey, &Resize::whole(12)).unwrap(),
        resize_set(&rgb, &Resize::whole(12)).unwrap(),
    );
    assert_eq!(g.c, 1);
    for i in 0..2 {
        assert_eq!(g.image(i), &c.image(i)[..144]);
    }
    let two = ImageSet::new(vec![0.0; 32], vec![0], 1, 2, 4, 4, 1).unwrap();
    let e = resize_set(&two, &Resize::whole(8)).unwrap_err().to_string();
    assert!(e.contains("3 channels") && e.contains("have 2"), "{e}");
}
