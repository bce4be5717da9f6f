"""Benchmark: images/s, MFU, peak memory and data-wait share of our training, beside the transformers Trainer.

    python -m vit_finetune.bench                                   # all four configurations, defaults for the device
    python -m vit_finetune.bench --configs end_to_end,peer --batch-size 64 --steps 30 --out bench_out/b64.json

Each configuration trains `--steps` steps after `--warmup` steps (compilation and autotuning happen there):
  model_step  our step (train.train_loop over train.build_parts/prepare) on batches already on the device;
  end_to_end  the same run from JPEGs on disk through our decode, crop-before-resize augmentation and loaders;
  lora        end_to_end with model.lora (peft, r=16 on query/value);
  peer        transformers.Trainer as its image-classification example uses it: per-sample transforms set with
              `set_transform`, float32 collation, bf16=True, SDPA attention, the same workers, batch and model.
On CUDA the model is ViT-B/16 at 384 px (random weights: speed does not depend on them, and the machine may be
offline) over ~512 px JPEGs sized like Food-101's; on CPU a tiny ViT, so the command is testable anywhere.
The bench synchronises the device only where the measured window opens and closes; the loops keep their own syncs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import json
import math
import os
import re
import resource
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

if TYPE_CHECKING:
    from transformers import ViTConfig

    from .recipe import LoraSettings

CONFIGS = ("model_step", "end_to_end", "lora", "peer")
TITLES = {
    "model_step": "model step (batches on device)",
    "end_to_end": "end to end (JPEG -> train)",
    "lora": "LoRA end to end",
    "peer": "peer: transformers Trainer",
}
SCHEMA = "vit_finetune.bench/1"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The ViT shape benchmarked; `vit-b16-384` is ViT-B/16 with a Food-101-sized head."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    image_size: int
    num_labels: int

    def vit_config(self) -> ViTConfig:
        from transformers import ViTConfig

        fields = dataclasses.asdict(self)
        labels = {i: f"class_{i:03d}" for i in range(self.num_labels)}
        return ViTConfig(**fields, id2label=labels, label2id={v: k for k, v in labels.items()})


MODELS = {
    "vit-b16-384": ModelSpec(768, 12, 12, 3072, 16, 384, 101),
    "tiny": ModelSpec(64, 2, 2, 128, 8, 64, 4),
}
# Per device type: the model, per-device batch, warm-up and measured steps used unless given.
DEVICE_DEFAULTS = {
    "cuda": {"model": "vit-b16-384", "batch_size": 128, "warmup": 10, "steps": 50, "precision": "bf16"},
    "cpu": {"model": "tiny", "batch_size": 8, "warmup": 2, "steps": 5, "precision": "no"},
}
# Dense (no 2:4 sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s; first match on the device name wins.
DATASHEET_BF16_TFLOPS = (
    ("H100 PCIe", 756.0, "NVIDIA H100 PCIe datasheet"),
    ("H100 NVL", 835.0, "NVIDIA H100 NVL datasheet"),
    ("H200 NVL", 835.0, "NVIDIA H200 NVL datasheet"),
    ("GH200", 989.4, "NVIDIA GH200 datasheet"),
    ("H100", 989.4, "NVIDIA H100 SXM datasheet"),  # "NVIDIA H100 80GB HBM3" is the SXM part
    ("H200", 989.4, "NVIDIA H200 SXM datasheet"),
    ("A100", 312.0, "NVIDIA A100 datasheet"),
    ("L40S", 362.0, "NVIDIA L40S datasheet"),
    ("L40", 181.0, "NVIDIA L40 datasheet"),
    ("L4", 121.0, "NVIDIA L4 datasheet"),
)
# Food-101 images are at most 512 px on the long side, mostly 512x512 or 4:3 either way.
JPEG_SHAPES = ((512, 512), (512, 384), (384, 512), (512, 341), (512, 288), (400, 512), (512, 460), (512, 512))


# ---------------------------------------------------------------- model FLOPs


def vit_macs(config: ViTConfig) -> dict[str, int]:
    """Multiply-accumulates of one image's forward pass by kind: patch embedding, linear layers, attention, head."""
    patches = (config.image_size // config.patch_size) ** 2
    tokens = patches + 1  # the CLS token
    d, m = config.hidden_size, config.intermediate_size
    per_layer_linear = tokens * (3 * d * d + d * d + 2 * d * m)  # q, k, v, output projection, MLP in and out
    per_layer_attention = 2 * tokens * tokens * d  # Q K^T and A V over all heads
    return {
        "patch_embedding": patches * config.num_channels * config.patch_size**2 * d,
        "linear": config.num_hidden_layers * per_layer_linear,
        "attention": config.num_hidden_layers * per_layer_attention,
        "head": d * config.num_labels,  # only the CLS token is classified
    }


def lora_macs(config: ViTConfig, lora: LoraSettings) -> int:
    """Forward MACs the LoRA adapters add (x A then B, rank r) on the roles they wrap."""
    d, m = config.hidden_size, config.intermediate_size
    shapes = {"query": (d, d), "key": (d, d), "value": (d, d), "attention_output": (d, d),
              "mlp_in": (d, m), "mlp_out": (m, d)}
    tokens = (config.image_size // config.patch_size) ** 2 + 1
    per_layer = sum(lora.r * (shapes[role][0] + shapes[role][1]) for role in lora.target_modules)
    return config.num_hidden_layers * tokens * per_layer


def training_flops_per_image(config: ViTConfig, lora: LoraSettings | None = None) -> float:
    """Model FLOPs of one training image (2 FLOPs per MAC), forward plus backward.

    Full fine-tuning: backward is twice the forward (gradients for inputs and weights), 3x forward in all.
    LoRA: frozen linear layers need input gradients only and the patch embedding needs none; attention's
    activation products, the head and the adapters still cost 3x.
    """
    macs = vit_macs(config)
    if lora is None:
        return 2.0 * 3 * sum(macs.values())
    adapters = lora_macs(config, lora)
    total = macs["patch_embedding"] + 2 * macs["linear"] + 3 * (macs["attention"] + macs["head"] + adapters)
    return 2.0 * total


# ---------------------------------------------------------------- the device: peak, memory, clock


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    """Best rate of `repeats` size^3 matrix products after warm-up, in TFLOP/s."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def device_peak(device: torch.device) -> dict[str, Any]:
    """The FLOP/s that MFU divides by, with where it comes from; a measured matmul rate beside it."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        measured = matmul_tflops(device, torch.bfloat16, 8192, 10)
        info = {"measured_matmul_tflops": measured, "measured_matmul": "8192^3 bf16 torch.matmul, best of 10"}
        for key, tflops, source in DATASHEET_BF16_TFLOPS:
            if key.lower() in name.lower():
                return {"tflops": tflops, "dtype": "bf16", "source": f"{source}, dense bf16 (no sparsity)", **info}
        return {"tflops": measured, "dtype": "bf16",
                "source": f"measured bf16 matmul (no datasheet figure known for {name!r})", **info}
    measured = matmul_tflops(device, torch.float32, 1024, 10)
    return {"tflops": measured, "dtype": "float32", "source": "measured float32 matmul, 1024^3, best of 10 "
            "(a CPU has no datasheet bf16 figure here)", "measured_matmul_tflops": measured,
            "measured_matmul": "1024^3 float32 torch.matmul, best of 10"}


class PeakMemory:
    """Peak GPU memory allocated by torch on CUDA; on CPU the main process's peak resident set (VmHWM)."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.label = "torch.cuda.max_memory_allocated"
        elif self._reset_rss():
            self.label = "peak RSS of the main process (VmHWM, reset per configuration)"
        else:  # kernels without clear_refs: the peak since the process started
            self.label = "peak RSS of the main process since it started (ru_maxrss; could not reset per configuration)"

    @staticmethod
    def _reset_rss() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS
            return "VmHWM" in Path("/proc/self/status").read_text()
        except OSError:
            return False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._reset_rss()

    def read_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        status = Path("/proc/self/status")
        match = re.search(r"VmHWM:\s+(\d+) kB", status.read_text()) if status.exists() else None
        kib = int(match.group(1)) if match else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kib / 2**20


class StepClock:
    """The measured window: opened after the warm-up, closed after the last step, the device synchronised only then.

    Data wait is the time the training loop spends in `next()` on its batches inside the window (for our loader
    and the Trainer's, accelerate copies the batch to the device in there). On CUDA the host may run ahead of the
    GPU, so a wait can overlap GPU work: the share then bounds from above the time the GPU starves for data.
    """

    def __init__(self, device: torch.device, warmup: int, steps: int, profile_to: Path | None = None):
        self.device, self.warmup, self.steps = device, warmup, steps
        self.started = self.finished = None
        self.wait = 0.0
        self.images = 0
        self.profile_to = profile_to
        self.profiler = None

    @property
    def running(self) -> bool:
        return self.started is not None and self.finished is None

    def open(self) -> None:
        synchronize(self.device)
        if self.profile_to is not None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        self.started = time.perf_counter()

    def close(self) -> None:
        if not self.running:
            raise RuntimeError("the measured window never opened: fewer batches than warm-up + steps")
        synchronize(self.device)
        self.finished = time.perf_counter()
        if self.profiler is not None:
            self.profiler.stop()
            sort = "device_time_total" if self.device.type == "cuda" else "cpu_time_total"
            self.profile_to.parent.mkdir(parents=True, exist_ok=True)
            self.profile_to.write_text(self.profiler.key_averages().table(sort_by=sort, row_limit=40))

    def fetch(self, iterator: Iterator, index: int) -> dict:
        """next(iterator) for batch `index` (0-based), timed and counted once the window is open."""
        if index == self.warmup:
            self.open()
        start = time.perf_counter()
        batch = next(iterator)
        if self.running:
            self.wait += time.perf_counter() - start
            self.images += batch["labels"].shape[0]  # a shape: no device sync
        return batch

    @property
    def seconds(self) -> float:
        return self.finished - self.started


class TimedBatches:
    """Stands in for the prepared loader so our unchanged training loop is timed: the clock sees every `next()`.

    Batches come from `source` (the loader itself, or batches already on the device); anything else the loop
    asks of its loader (set_epoch, ...) goes to the real `loader`.
    """

    def __init__(self, source: Iterable, clock: StepClock, loader):
        self.source, self.clock, self.loader = source, clock, loader

    def __getattr__(self, name: str):
        return getattr(self.loader, name)

    def __iter__(self):
        iterator = iter(self.source)
        for index in range(self.clock.warmup + self.clock.steps):  # = recipe.train.max_steps: the loop stops there
            yield self.clock.fetch(iterator, index)


def device_batches(spec: ModelSpec, batch_size: int, device: torch.device) -> Iterator[dict]:
    """Endless uint8 batches already on the device, laid out as our prepared loader delivers them."""
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (batch_size, 3, spec.image_size, spec.image_size)
    batches = [{
        "pixel_values": torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator),
        "labels": torch.randint(0, spec.num_labels, (batch_size,), device=device, generator=generator),
        "skipped": torch.zeros((), dtype=torch.long, device=device),
    } for _ in range(2)]
    while True:
        yield from batches


# ---------------------------------------------------------------- inputs written once: JPEGs and a base model


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
    if (folder / "config.json").exists() and (folder / "preprocessor_config.json").exists():
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


# ---------------------------------------------------------------- one run's settings


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
    compile: bool | None
    jpegs: Path
    base: Path
    work_dir: Path
    profile_dir: Path | None

    def clock(self, config: str) -> StepClock:
        profile_to = self.profile_dir / f"profile_{config}.txt" if self.profile_dir else None
        return StepClock(self.device, self.warmup, self.steps, profile_to)


def reset_accelerate_state() -> None:
    """Accelerate keeps process-wide singletons; each configuration starts from a clean one."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measured(clock: StepClock, flops: float, peak: dict, memory: PeakMemory, settings: dict) -> dict:
    images_per_s = clock.images / clock.seconds
    return {
        "images_per_s": images_per_s,
        "mfu": flops * images_per_s / (peak["tflops"] * 1e12),
        "flops_per_image": flops,
        "peak_memory_gib": memory.read_gib(),
        "data_wait_share": clock.wait / clock.seconds,
        "step_time_ms": 1000 * clock.seconds / clock.steps,
        "measured_steps": clock.steps,
        "measured_images": clock.images,
        "seconds": clock.seconds,
        "settings": settings,
    }


# ---------------------------------------------------------------- our configurations


def bench_recipe(setup: Setup, lora: bool):
    """The recipe our configurations train with, validated by the same schema as any run."""
    from .recipe import validate

    return validate({
        "model": {"base": str(setup.base), "image_size": setup.spec.image_size, "compile": setup.compile,
                  "lora": {} if lora else None},
        "data": {"dataset": str(setup.jpegs), "num_workers": setup.workers},
        "train": {"batch_size": setup.batch_size, "max_steps": setup.warmup + setup.steps,
                  "mixed_precision": setup.precision, "scheduler": "constant"},
        "output_dir": str(setup.work_dir / "outputs"),
    }, "bench recipe")


def run_ours(config: str, setup: Setup, peak: dict, memory: PeakMemory) -> dict:
    """Our recipe through train.make_accelerator, build_parts, prepare and train_loop, the loop left unchanged."""
    from accelerate.utils import set_seed

    from . import checkpoint, train

    recipe = bench_recipe(setup, lora=config == "lora")
    memory.reset()
    accelerator = train.make_accelerator(recipe)
    forced = []
    if setup.device.type == "cuda" and not accelerator.dataloader_config.non_blocking:
        # Pinned uint8 batches copied without blocking the host; train.make_accelerator does not ask for it yet.
        accelerator.dataloader_config.non_blocking = True
        forced.append("non_blocking")
    set_seed(recipe.train.seed)
    parts = train.build_parts(recipe, accelerator)
    train.prepare(accelerator, parts, recipe)  # torch.compile (model.compile) and accelerator.prepare
    clock = setup.clock(config)
    if config == "model_step":
        source = device_batches(setup.spec, setup.batch_size, accelerator.device)
    else:
        if len(parts.train_loader) < setup.warmup + setup.steps:
            raise RuntimeError(f"{setup.jpegs} gives {len(parts.train_loader)} batches per epoch, fewer than "
                               f"warm-up + steps = {setup.warmup + setup.steps}; pass a larger --images")
        source = parts.train_loader
    settings = our_settings(accelerator, parts, recipe, forced)
    timed = dataclasses.replace(parts, train_loader=TimedBatches(source, clock, parts.train_loader))
    train.train_loop(accelerator, timed, recipe, checkpoint.TrainState())
    clock.close()
    flops = training_flops_per_image(setup.spec.vit_config(), recipe.model.lora)
    result = measured(clock, flops, peak, memory, settings)
    accelerator.free_memory()
    del parts, timed, source, accelerator
    reset_accelerate_state()
    release_memory(setup.device)
    return result


def our_settings(accelerator, parts, recipe, forced: list[str]) -> dict:
    """The levers in effect, read off the built objects rather than assumed."""
    loader = getattr(parts.train_loader, "base_dataloader", parts.train_loader)
    optimizer = getattr(parts.optimizer, "optimizer", parts.optimizer)
    model = accelerator.unwrap_model(parts.model, keep_torch_compile=False)
    return {
        "precision": recipe.train.mixed_precision,
        "torch_compile": hasattr(parts.model, "_orig_mod") or type(parts.model).__name__ == "OptimizedModule",
        "attention": getattr(model.config, "_attn_implementation", None),
        "optimizer": f"{type(optimizer).__name__}(fused={optimizer.defaults.get('fused')})",
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "persistent_workers": loader.persistent_workers,
        "prefetch_factor": loader.prefetch_factor,
        "non_blocking_copies": accelerator.dataloader_config.non_blocking,
        "forced_by_bench": forced,
        "batch_dtype": "uint8, normalised on the device (data.PixelNormalizer)",
        "lora": recipe.model.lora.model_dump() if recipe.model.lora else None,
    }


# ---------------------------------------------------------------- the peer: transformers' image-classification example


class ExampleTrainTransform:
    """Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToTensor(), Normalize(mean, std)]) of the example.

    torchvision's own classes when it is installed; otherwise the same steps with PIL and torch, following
    torchvision's code: same defaults (scale 0.08-1, ratio 3/4-4/3, bilinear), same torch RNG, float32 output.
    """

    def __init__(self, size: int | tuple[int, int], mean: list[float], std: list[float]):
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)
        try:
            from torchvision.transforms import Compose, Normalize, RandomHorizontalFlip, RandomResizedCrop, ToTensor

            normalize = Normalize(mean=mean, std=std)
            self.compose = Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToTensor(), normalize])
            self.source = "torchvision.transforms"
        except ImportError:
            self.compose = None
            self.source = "PIL + torch, torchvision's steps rewritten (torchvision is not installed)"

    def __call__(self, image: Image.Image) -> torch.Tensor:
        if self.compose is not None:
            return self.compose(image)
        top, left, height, width = self._crop_box(*image.size)
        image = image.crop((left, top, left + width, top + height)).resize(self.size[::-1], Image.BILINEAR)
        if torch.rand(1) < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        tensor = torch.from_numpy(np.array(image, np.uint8, copy=True)).permute(2, 0, 1).contiguous()
        tensor = tensor.to(torch.float32).div(255)
        return tensor.sub_(self.mean).div_(self.std)

    @staticmethod
    def _crop_box(width: int, height: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
        area = height * width
        log_ratio = torch.log(torch.tensor(ratio))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
            aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
            w, h = int(round(math.sqrt(target_area * aspect))), int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = torch.randint(0, height - h + 1, size=(1,)).item()
                left = torch.randint(0, width - w + 1, size=(1,)).item()
                return top, left, h, w
        in_ratio = width / height
        if in_ratio < min(ratio):
            w, h = width, int(round(width / min(ratio)))
        elif in_ratio > max(ratio):
            w, h = int(round(height * max(ratio))), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


class ExampleBatchTransform:
    """The example's `train_transforms(example_batch)`, a class so that spawned workers could pickle it."""

    def __init__(self, transform: ExampleTrainTransform, image_column: str = "image"):
        self.transform, self.image_column = transform, image_column

    def __call__(self, example_batch: dict) -> dict:
        images = example_batch[self.image_column]
        example_batch["pixel_values"] = [self.transform(image.convert("RGB")) for image in images]
        return example_batch


def example_collate_fn(examples: list[dict]) -> dict[str, torch.Tensor]:
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    labels = torch.tensor([example["label"] for example in examples])
    return {"pixel_values": pixel_values, "labels": labels}


def run_peer(setup: Setup, peak: dict, memory: PeakMemory) -> dict:
    """transformers.Trainer trained as run_image_classification.py sets it up, timed by a subclass and a callback."""
    import datasets
    from transformers import (AutoImageProcessor, AutoModelForImageClassification, Trainer, TrainerCallback,
                              TrainingArguments)

    clock = setup.clock("peer")
    cuda = setup.device.type == "cuda"

    class TimedIterator:
        def __init__(self, iterator: Iterator, trainer: Trainer):
            self.iterator, self.trainer = iterator, trainer

        def __iter__(self):
            return self

        def __next__(self):
            return clock.fetch(self.iterator, self.trainer.state.global_step)

    class TimedTrainer(Trainer):
        def get_batch_samples(self, epoch_iterator, *args, **kwargs):  # the one place the Trainer calls next()
            return super().get_batch_samples(TimedIterator(epoch_iterator, self), *args, **kwargs)

    class CloseWindow(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == setup.warmup + setup.steps:
                clock.close()

    memory.reset()
    train_set = datasets.load_dataset("imagefolder", data_dir=str(setup.jpegs))["train"]
    if len(train_set) < (setup.warmup + setup.steps) * setup.batch_size:
        raise RuntimeError(f"{setup.jpegs} holds {len(train_set)} training images, fewer than one epoch of "
                           f"{setup.warmup + setup.steps} steps needs; pass a larger --images")
    image_processor = AutoImageProcessor.from_pretrained(setup.base)
    if "shortest_edge" in image_processor.size:
        size = image_processor.size["shortest_edge"]
    else:
        size = (image_processor.size["height"], image_processor.size["width"])
    transform = ExampleTrainTransform(size, image_processor.image_mean, image_processor.image_std)
    train_set.set_transform(ExampleBatchTransform(transform))
    model = AutoModelForImageClassification.from_pretrained(setup.base, attn_implementation="sdpa")
    args = TrainingArguments(
        output_dir=str(setup.work_dir / "peer"),
        per_device_train_batch_size=setup.batch_size,
        max_steps=setup.warmup + setup.steps,
        learning_rate=2e-5,  # the example's README value; speed does not depend on it
        bf16=setup.precision == "bf16",
        dataloader_num_workers=setup.workers,
        dataloader_pin_memory=cuda,  # the Trainer's default on CUDA; it only warns on CPU
        remove_unused_columns=False,  # the example's README requires it: the transform reads the image column
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        use_cpu=not cuda,
        seed=0,
    )
    trainer = TimedTrainer(model=model, args=args, train_dataset=train_set, processing_class=image_processor,
                           data_collator=example_collate_fn, callbacks=[CloseWindow()])
    trainer.train()
    settings = {
        "precision": "bf16" if args.bf16 else "no",
        "torch_compile": args.torch_compile,
        "attention": model.config._attn_implementation,
        "optimizer": str(args.optim.value if hasattr(args.optim, "value") else args.optim),
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
        "persistent_workers": args.dataloader_persistent_workers,
        "prefetch_factor": args.dataloader_prefetch_factor,
        "transforms": transform.source,
        "batch_dtype": "float32, normalised per sample in the workers",
    }
    result = measured(clock, training_flops_per_image(model.config), peak, memory, settings)
    trainer.accelerator.free_memory()
    del trainer, model, train_set
    reset_accelerate_state()
    release_memory(setup.device)
    return result


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m vit_finetune.bench",
        description="Train for a fixed number of steps after warm-up and report images/s, MFU, peak memory and "
                    "the share of step time spent waiting for data, for our step, our pipeline, LoRA and the "
                    "transformers Trainer peer.",
        epilog="Defaults on CUDA: vit-b16-384, batch 128, bf16, 10 warm-up + 50 steps. "
               "On CPU: the tiny model, batch 8, float32, 2 + 5 steps.",
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--model", choices=sorted(MODELS), help="default: vit-b16-384 on CUDA, tiny on CPU")
    parser.add_argument("--batch-size", type=int, help="per device; the same for every configuration")
    parser.add_argument("--warmup", type=int, help="steps run before the measured window (compilation happens here)")
    parser.add_argument("--steps", type=int, help="measured steps")
    parser.add_argument("--workers", type=int,
                        help="data loader workers for ours and the peer; default: data.default_num_workers")
    parser.add_argument("--precision", choices=("bf16", "no"), help="default: bf16 on CUDA, no (float32) on CPU")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="model.compile for our configurations; auto = the recipe default (on for CUDA)")
    parser.add_argument("--images", type=int, help="training JPEGs to write; default: one epoch covers warm-up + steps")
    parser.add_argument("--cache", type=Path, help="where the JPEGs and the base model are written once "
                        "(default: $VIT_FINETUNE_CACHE/bench or ~/.cache/vit_finetune/bench)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/bench.json"), help="the JSON report")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="also write a torch.profiler table of each measured window to DIR (perturbs timings)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.configs.split(",") if name not in CONFIGS]
    if unknown or not args.configs:
        parser.error(f"--configs={args.configs!r}: unknown {unknown}; choose from {','.join(CONFIGS)}")
    for name in ("batch_size", "warmup", "steps", "images"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')}={value} must be {'>= 0' if name == 'warmup' else '> 0'}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                     "use --device cpu")
    return args


def make_setup(args: argparse.Namespace, work_dir: Path) -> tuple[Setup, dict]:
    from . import data

    device_type = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    defaults = DEVICE_DEFAULTS[device_type]
    model_name = args.model or defaults["model"]
    spec = MODELS[model_name]
    batch_size = args.batch_size or defaults["batch_size"]
    warmup = defaults["warmup"] if args.warmup is None else args.warmup
    steps = args.steps or defaults["steps"]
    workers = data.default_num_workers(device_type, 1) if args.workers is None else args.workers
    cache = args.cache or data.cache_dir() / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    needed = (warmup + steps) * batch_size
    images = args.images or needed
    if images < needed:  # crossing an epoch would time its restart and, in our loop, an evaluation
        raise SystemExit(f"--images={images} is less than one epoch of warm-up + steps needs "
                         f"({warmup + steps} steps x batch {batch_size} = {needed}); raise it or leave it out")
    jpegs, jpeg_stats = ensure_jpeg_folder(cache, images, spec.num_labels, cpu_cores())
    base = ensure_base_model(cache, model_name, spec)
    setup = Setup(
        device=torch.device(device_type), model_name=model_name, spec=spec, batch_size=batch_size, warmup=warmup,
        steps=steps, workers=workers, precision=args.precision or defaults["precision"],
        compile={"auto": None, "on": True, "off": False}[args.compile], jpegs=jpegs, base=base, work_dir=work_dir,
        profile_dir=args.profile,
    )
    return setup, jpeg_stats


def versions() -> dict[str, str]:
    import importlib.metadata as metadata

    found = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "accelerate", "datasets", "peft", "torchvision", "pillow"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def device_info(device: torch.device) -> dict[str, Any]:
    cores = cpu_cores()
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "cpu_cores": cores,
                "memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30}
    return {"type": "cpu", "name": f"CPU ({cores} cores, {torch.get_num_threads()} torch threads)", "cpu_cores": cores}


def format_table(report: dict) -> str:
    setup, peak = report["setup"], report["peak"]
    lines = [
        f"vit_finetune bench: {setup['model_description']}, batch {setup['batch_size']}, "
        f"precision {setup['precision']}, {setup['num_workers']} workers, {setup['steps']} steps after "
        f"{setup['warmup_steps']} warm-up",
        f"device: {report['device']['name']}; {report['date']}",
        "",
        f"{'configuration':32s} {'images/s':>10s} {'MFU':>8s} {'peak memory':>12s} {'data wait':>10s}",
    ]
    for name, result in report["configs"].items():
        if "error" in result:
            lines.append(f"{TITLES[name]:32s} failed: {result['error'][:200]}")
            continue
        lines.append(f"{TITLES[name]:32s} {result['images_per_s']:10,.1f} {100 * result['mfu']:7.2f}% "
                     f"{result['peak_memory_gib']:8.2f} GiB {100 * result['data_wait_share']:9.1f}%")
    flops = ", ".join(f"{name} {result['flops_per_image'] / 1e9:,.4g} GFLOP"
                      for name, result in report["configs"].items() if "error" not in result)
    lines += [
        "",
        f"MFU = model FLOPs per training image x images/s / {peak['tflops']:,.2f} TFLOP/s ({peak['source']}); "
        f"FLOPs per image: {flops}",
        f"peak memory: {report['memory_measure']}",
        "data wait: time in next() on the batches (incl. the host-to-device copy) / measured time",
    ]
    if report["ratios"]:
        lines.append("ratios: " + ", ".join(f"{key} {value:.3f}" for key, value in report["ratios"].items()))
    return "\n".join(lines)


def ratios(results: dict) -> dict[str, float]:
    results = {name: result for name, result in results.items() if "error" not in result}
    rate = {name: result["images_per_s"] for name, result in results.items()}
    found = {}
    if {"end_to_end", "model_step"} <= rate.keys():
        found["end_to_end / model_step images/s"] = rate["end_to_end"] / rate["model_step"]
    if {"end_to_end", "peer"} <= rate.keys():
        found["end_to_end / peer images/s"] = rate["end_to_end"] / rate["peer"]
    if {"lora", "end_to_end"} <= results.keys():
        memory = {name: results[name]["peak_memory_gib"] for name in ("lora", "end_to_end")}
        found["lora / end_to_end peak memory"] = memory["lora"] / memory["end_to_end"]
    return found


def build_report(argv: list[str], setup: Setup, jpeg_stats: dict, peak: dict, memory: PeakMemory,
                 results: dict) -> dict:
    from .model import describe

    config = setup.spec.vit_config()
    return {
        "schema": SCHEMA,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "vit_finetune.bench", *argv]),
        "device": device_info(setup.device),
        "software": versions(),
        "peak": peak,
        "memory_measure": memory.label,
        "setup": {
            "model": setup.model_name,
            "model_description": describe(config),
            **dataclasses.asdict(setup.spec),
            "batch_size": setup.batch_size,
            "warmup_steps": setup.warmup,
            "steps": setup.steps,
            "num_workers": setup.workers,
            "precision": setup.precision,
            "jpegs": {"folder": str(setup.jpegs), **jpeg_stats},
            "forward_gmacs": sum(vit_macs(config).values()) / 1e9,
        },
        "configs": results,
        "ratios": ratios(results),
    }


def quiet_libraries() -> None:
    """Per-file progress bars of datasets and transformers would bury the table; our loop's own bar stays."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Run the chosen configurations, print the table and write the JSON report (after every configuration,
    so a run cut short keeps what it measured). Exit status 1 when a configuration failed."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    quiet_libraries()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="vit-bench-") as work:
        setup, jpeg_stats = make_setup(args, Path(work))
        if setup.device.type == "cpu":
            os.environ["ACCELERATE_USE_CPU"] = "true"  # --device cpu on a GPU machine: our Accelerator must obey too
        print(f"vit_finetune bench on {setup.device.type}: measuring the device peak ...", flush=True)
        peak = device_peak(setup.device)
        memory = PeakMemory(setup.device)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        for config in args.configs.split(","):
            print(f"vit_finetune bench: {TITLES[config]} ...", flush=True)
            try:
                if config == "peer":
                    results[config] = run_peer(setup, peak, memory)
                else:
                    results[config] = run_ours(config, setup, peak, memory)
            except Exception as error:  # one broken configuration must not lose the others' figures
                traceback.print_exc()
                results[config] = {"error": f"{type(error).__name__}: {error}"}
            if "error" in results[config]:  # outside the except block, so the traceback's frames are gone
                reset_accelerate_state()
                release_memory(setup.device)
            report = build_report(argv, setup, jpeg_stats, peak, memory, results)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"wrote {args.out}")
    return 1 if any("error" in result for result in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
