"""Small real artefacts the tests build: a tiny pretrained-layout ViT and image folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
COLOURS = {"red": (210, 40, 40), "green": (40, 190, 60), "blue": (40, 60, 210), "yellow": (220, 210, 40),
           "purple": (150, 50, 180), "cyan": (40, 200, 210)}


def make_tiny_vit(folder: Path, image_size: int = 32, patch_size: int = 4, num_labels: int = 10, hidden: int = 32,
                  layers: int = 2, seed: int = 0) -> Path:
    """A randomly initialised ViTForImageClassification saved like a Hub checkpoint (4.x key names on disk)."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessorPil

    torch.manual_seed(seed)
    config = ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                       intermediate_size=hidden * 2, image_size=image_size, patch_size=patch_size,
                       num_labels=num_labels, id2label={i: f"imagenet_{i}" for i in range(num_labels)},
                       label2id={f"imagenet_{i}": i for i in range(num_labels)})
    model = ViTForImageClassification(config)
    with torch.no_grad():  # make the position embeddings a smooth, recognisable grid, as pretrained ones are
        grid = image_size // patch_size
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, grid), torch.linspace(-1, 1, grid), indexing="ij")
        basis = torch.stack([torch.sin((k + 1) * (xs + ys * (k % 3))) for k in range(hidden)], dim=-1)
        model.vit.embeddings.position_embeddings[0, 1:] = 0.1 * basis.reshape(grid * grid, hidden)
    model.save_pretrained(folder)
    ViTImageProcessorPil(size={"height": image_size, "width": image_size}).save_pretrained(folder)
    return Path(folder)


def colour_image(rgb: tuple[int, int, int], rng: np.random.Generator, size: tuple[int, int] = (40, 48)) -> Image.Image:
    pixels = np.clip(np.array(rgb) + rng.normal(0, 35, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def write_colour_folder(root: Path, classes: int = 3, train: int = 16, validation: int = 6, seed: int = 0,
                        splits: bool = True) -> Path:
    """root/[split/]class/i.png with noisy single-colour images: learnable in a few steps, not by chance."""
    rng = np.random.default_rng(seed)
    names = list(COLOURS)[:classes]
    layout = {"train": train, "validation": validation} if splits else {"": train}
    for split, count in layout.items():
        for name in names:
            folder = Path(root, split, name)
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                colour_image(COLOURS[name], rng).save(folder / f"{i}.png")
    return Path(root)


def run_cli(*args: str, env: dict | None = None, timeout: int = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real entry point in a fresh interpreter, as a user runs it."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run([sys.executable, "-m", "vit_finetune", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd or REPO)
