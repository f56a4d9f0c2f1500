#!/usr/bin/env python3
"""An image folder and timm's eval transform of it, for models/tests/image_folder.rs.

    python3 -m venv .venv && .venv/bin/pip install torch timm safetensors pillow numpy
    .venv/bin/python scripts/image_folder_reference.py

Writes models/tests/fixtures/image_folder/: two class folders ("cat", "dog") of small images of
odd sizes and kinds (RGB, RGBA, grey and palette PNGs, JPEGs; portrait and landscape, some
smaller than the output, some larger), a file that is not an image (ignored, as torchvision's
ImageFolder ignores it), and reference.safetensors: for each image, in the order
torchvision's ImageFolder lists them, timm's eval transform at side 24 for the fine-tuned BiT
(resnetv2_50x1_bit.goog_in21k_ft_in1k: Resize(24) bilinear with antialias, CenterCrop(24),
ToTensor, Normalize(0.5, 0.5)) as `bit.image.{i}`, and for the distilled one
(goog_distilled_in1k: Resize(27) bicubic, CenterCrop(24), ...) as `distilled.image.{i}`; and
the labels.
"""
import json
import os

import numpy as np
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from timm.data import create_transform, resolve_data_config
from torchvision.datasets import ImageFolder

SIDE = 24
root = os.path.join(os.path.dirname(__file__), "..", "models", "tests", "fixtures", "image_folder")
rng = np.random.default_rng(0)


def picture(w, h):
    """Smooth gradients and a few blobs, so resampling has structure to get right."""
    y, x = np.mgrid[0:h, 0:w]
    r = 255 * (x / max(w - 1, 1))
    g = 255 * (y / max(h - 1, 1))
    b = 127 + 120 * np.sin(x / 3.0) * np.cos(y / 4.0)
    img = np.stack([r, g, b], -1) + rng.normal(0, 12, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


specs = {
    "cat": [("a.png", 40, 30, "RGB"), ("b.jpg", 25, 61, "RGB"), ("c.png", 33, 33, "RGBA"), ("d.jpeg", 96, 72, "RGB")],
    "dog": [("e.png", 30, 45, "L"), ("f.png", 24, 24, "P"), ("g.JPG", 50, 37, "RGB"), ("h.png", 17, 29, "RGB")],
}
for cls, files in specs.items():
    os.makedirs(os.path.join(root, cls), exist_ok=True)
    for name, w, h, mode in files:
        img = Image.fromarray(picture(w, h))
        if mode == "RGBA":
            img = img.convert("RGBA")
            a = np.array(img)
            a[..., 3] = rng.integers(0, 256, (h, w))
            img = Image.fromarray(a, "RGBA")
        elif mode != "RGB":
            img = img.convert(mode)
        img.save(os.path.join(root, cls, name), quality=90) if name.lower().endswith(("jpg", "jpeg")) else img.save(os.path.join(root, cls, name))
with open(os.path.join(root, "dog", "notes.txt"), "w") as f:
    f.write("not an image: ImageFolder lists only image files\n")

# The fine-tuned BiT's transform (bilinear, crop_pct 1) and the distilled one's (bicubic,
# crop_pct 0.875), the two kinds of pretrained_cfg the family has.
out = {}
for prefix, tag in [("bit", "goog_in21k_ft_in1k"), ("distilled", "goog_distilled_in1k")]:
    model = timm.create_model(f"resnetv2_50x1_bit.{tag}", pretrained=False)
    cfg = resolve_data_config({}, model=model)
    cfg["input_size"] = (3, SIDE, SIDE)
    transform = create_transform(**cfg)
    print(prefix, transform)
    folder = ImageFolder(root, transform=transform)
    out["labels"] = torch.tensor([float(l) for _, l in folder.samples], dtype=torch.float64)
    for i, (x, _) in enumerate(folder):
        out[f"{prefix}.image.{i}"] = x.double()
meta = {
    "files": json.dumps([os.path.relpath(p, root) for p, _ in folder.samples]),
    "classes": json.dumps(folder.classes),
    "side": str(SIDE),
    "versions": json.dumps({"timm": timm.__version__, "torch": torch.__version__}),
}
save_file(out, os.path.join(root, "reference.safetensors"), metadata=meta)
print(folder.classes, [os.path.relpath(p, root) for p, _ in folder.samples])
