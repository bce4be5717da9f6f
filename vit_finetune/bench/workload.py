"""What every configuration trains on, written once and reused: ~512 px JPEGs sized like Food-101's and a base
model saved like a Hub checkpoint; and the settings of one bench run."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

from vit_finetune.bench.flops import ModelSpec
from vit_finetune.bench.timing import StepClock
from vit_finetune.core.layout import CARD_FILE, CONFIG_FILE, PROCESSOR_FILE

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


def jpeg_bytes(seed: int, quality: int = 90) -> bytes:
    """One synthetic photo-like JPEG, the same for the same seed: smooth colour field, blobs, blur and grain."""
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
    return buffer.getvalue()


def _write_jpeg(job: tuple[Path, int, int]) -> int:
    """jpeg_bytes written to a file; returns its size in bytes."""
    path, seed, quality = job
    encoded = jpeg_bytes(seed, quality)
    path.write_bytes(encoded)
    return len(encoded)


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


# A shard of a Hub dataset holds about this many Food-101-sized images (~250 MB), as the Hub's 500 MB shards of
# ethz/food101 hold ~8,000-10,000.
IMAGES_PER_SHARD = 5_000


def hub_card(classes: int, splits: dict[str, dict]) -> str:
    """README.md of a Hub dataset repo as the Hub writes it for a dataset pushed with push_to_hub (ethz/food101's
    shape): the features (an image, a class label with its names), the splits, and the default config's files."""
    names = "".join(f"          '{index}': class_{index:03d}\n" for index in range(classes))
    split_info = "".join(f"  - name: {name}\n    num_bytes: {info['bytes']}\n    num_examples: {info['images']}\n"
                         for name, info in splits.items())
    files = "".join(f"  - split: {name}\n    path: data/{name}-*\n" for name in splits)
    return ("---\ndataset_info:\n  features:\n  - name: image\n    dtype: image\n  - name: label\n    dtype:\n"
            f"      class_label:\n        names:\n{names}  splits:\n{split_info}"
            f"configs:\n- config_name: default\n  data_files:\n{files}---\n\n"
            "Synthetic photo-like JPEGs sized like Food-101's, written by vit_finetune's bench.\n")


def ensure_hub_shards(root: Path, train_images: int, eval_images: int, classes: int, processes: int) -> tuple[Path, dict]:
    """A dataset laid out as a Hub dataset repo is, written once and reused: data/{split}-0000i-of-0000n.parquet
    shards with an `image` column of encoded JPEG bytes and a `label` ClassLabel column, and the README.md card that
    declares them; splits train and validation. `load_dataset(folder)` reads it as it reads ethz/food101."""
    import datasets

    folder = root / f"hub-shards-{train_images}x{classes}-{eval_images}-v1"
    stats_file = folder / "stats.json"
    if stats_file.exists():
        return folder, json.loads(stats_file.read_text())
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=root))
    (staging / "data").mkdir()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(
        names=[f"class_{index:03d}" for index in range(classes)])})
    splits = {}
    with ProcessPoolExecutor(max_workers=max(1, processes)) as pool:
        for name, count, first_seed in (("train", train_images, 0), ("validation", eval_images, 10**9)):
            encoded = list(pool.map(jpeg_bytes, range(first_seed, first_seed + count), chunksize=64))
            shards = max(2, math.ceil(count / IMAGES_PER_SHARD)) if name == "train" else math.ceil(count / IMAGES_PER_SHARD)
            bounds = np.linspace(0, count, shards + 1).astype(int)
            for shard, (start, end) in enumerate(zip(bounds, bounds[1:])):
                table = datasets.Dataset.from_dict(
                    {"image": [{"bytes": data, "path": None} for data in encoded[start:end]],
                     "label": [index % classes for index in range(start, end)]}, features=features)
                table.to_parquet(staging / "data" / f"{name}-{shard:05d}-of-{shards:05d}.parquet")
            splits[name] = {"images": count, "bytes": sum(map(len, encoded)), "shards": shards}
    (staging / CARD_FILE).write_text(hub_card(classes, splits))
    stats = {"classes": classes, "splits": splits, "quality": 90,
             "mean_kib": sum(info["bytes"] for info in splits.values()) / (train_images + eval_images) / 1024}
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
