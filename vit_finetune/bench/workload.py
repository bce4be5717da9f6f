"""What every configuration trains on, written once and reused: ~512 px JPEGs sized like Food-101's and a base
model saved like a Hub checkpoint; and the settings of one bench run."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

from ..layout import CONFIG_FILE, PROCESSOR_FILE
from .flops import ModelSpec
from .timing import StepClock

# Per device type: the model, per-device batch, warm-up and measured steps used unless given.
DEVICE_DEFAULTS = {
    "cuda": {"model": "vit-b16-384", "batch_size": 128, "warmup": 10, "steps": 50, "precision": "bf16"},
    "cpu": {"model": "tiny", "batch_size": 8, "warmup": 2, "steps": 5, "precision": "no"},
}
# Food-101 images are at most 512 px on the long side, mostly 512x512 or 4:3 either way.
JPEG_SHAPES = ((512, 512), (512, 384), (384, 512), (512, 341), (512, 288), (400, 512), (512, 460), (512, 512))


@dataclasses.dataclass
class Setup:
    device: torch.device
    model_name: str
    spec: ModelSpec
    batch_size: int
    warmup: int
    steps: int
    workers: int
    precision: str
    compile: bool | str  # model.compile of our configurations (--compile auto: levers.long_run_compile)
    jpegs: Path
    base: Path
    work_dir: Path
    profile_dir: Path | None

    def clock(self, config: str) -> StepClock:
        profile_to = self.profile_dir / f"profile_{config}.txt" if self.profile_dir else None
        return StepClock(self.device, self.warmup, self.steps, profile_to)


def _write_jpeg(job: tuple[Path, int, int]) -> int:
    """One synthetic photo-like JPEG: smooth colour field, blobs, blur and grain; returns its size in bytes."""
    path, seed, quality = job
    rng = np.random.default_rng(seed)
    width, height = JPEG_SHAPES[rng.integers(len(JPEG_SHAPES))]
    low = rng.integers(0, 256, (rng.integers(3, 9), rng.integers(3, 9), 3), dtype=np.uint8)
    image = Image.fromarray(low).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.integers(8, 20)):
        x, y, r = rng.integers(0, width), rng.integers(0, height), rng.integers(10, 120)
        draw.ellipse([x - r, y - r, x + r, y + r], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(1.5)), dtype=np.int16)
    pixels = pixels + rng.normal(0, 6, (height, width, 1)).astype(np.int16)  # grain: real photos are not flat
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=quality)
    path.write_bytes(buffer.getvalue())
    return len(buffer.getvalue())


def ensure_jpeg_folder(root: Path, train_images: int, classes: int, processes: int) -> tuple[Path, dict]:
    """An image folder (train/class_NNN/*.jpg, validation/ one per class) written once and reused."""
    folder = root / f"jpegs-{train_images}x{classes}-v1"
    stats_file = folder / "stats.json"
    if stats_file.exists():
        return folder, json.loads(stats_file.read_text())
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=root))
    jobs = []
    for split, count in (("train", train_images), ("validation", classes)):
        for index in range(count):
            label = index % classes
            directory = staging / split / f"class_{label:03d}"
            directory.mkdir(parents=True, exist_ok=True)
            seed = 2 * index + (split == "validation")  # a fixed image per file, whatever the process count
            jobs.append((directory / f"{index:06d}.jpg", seed, 90))
    with ProcessPoolExecutor(max_workers=max(1, processes)) as pool:
        sizes = list(pool.map(_write_jpeg, jobs, chunksize=64))
    stats = {"train_images": train_images, "classes": classes, "mean_kib": sum(sizes) / len(sizes) / 1024,
             "max_side_px": max(max(shape) for shape in JPEG_SHAPES), "quality": 90}
    (staging / "stats.json").write_text(json.dumps(stats))
    publish(staging, folder)
    return folder, json.loads(stats_file.read_text())


def ensure_base_model(root: Path, name: str, spec: ModelSpec) -> Path:
    """A randomly initialised ViT saved like a Hub checkpoint at the target size, with its image processor."""
    folder = root / f"base-{name}-{spec.num_labels}-v1"
    if (folder / CONFIG_FILE).exists() and (folder / PROCESSOR_FILE).exists():
        return folder
    from transformers import ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=root))
    ViTForImageClassification(spec.vit_config()).save_pretrained(staging)
    ViTImageProcessor(size={"height": spec.image_size, "width": spec.image_size}).save_pretrained(staging)
    publish(staging, folder)
    return folder


def publish(staging: Path, folder: Path) -> None:
    """Move a fully written folder into place in one step, so a run cut short never leaves half a cache."""
    try:
        staging.rename(folder)
    except OSError:  # another run published it meanwhile
        shutil.rmtree(staging, ignore_errors=True)
