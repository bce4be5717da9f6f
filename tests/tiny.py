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
                        splits: bool = True, test: int = 0) -> Path:
    """root/[split/]class/i.png with noisy single-colour images: learnable in a few steps, not by chance; a test/
    split too where `test` images per class are asked for."""
    rng = np.random.default_rng(seed)
    names = list(COLOURS)[:classes]
    layout = {"train": train, "validation": validation, **({"test": test} if test else {})} if splits else {"": train}
    for split, count in layout.items():
        for name in names:
            folder = Path(root, split, name)
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                colour_image(COLOURS[name], rng).save(folder / f"{i}.png")
    return Path(root)


def python_path(*first: Path) -> str:
    """A subprocess's PYTHONPATH: `first` (this checkout, by default) ahead of the one this process has, which may be
    how the libraries themselves are found (wheels unpacked into a folder, on a machine with no installer)."""
    kept = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([str(path) for path in (first or (REPO,))] + ([kept] if kept else []))


def run_cli(*args: str, env: dict | None = None, timeout: int = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real entry point in a fresh interpreter, as a user runs it."""
    full_env = {**os.environ, "PYTHONPATH": python_path(), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run([sys.executable, "-m", "vit_finetune", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd or REPO)


# Tiny random configurations of every supported family, saved the way their Hub checkpoints are: the class the
# checkpoint ships as (a bare backbone for DINOv2/ViT-MSN/Data2Vec, a distilled DeiT with its teacher head, a full
# CLIP/SigLIP model with a text tower) and the family's own image processor with its own size convention.
def _vit_like(config_class: str, **extra):
    def config(image_size: int, num_labels: int):
        return _config(config_class, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       image_size=image_size, patch_size=4, num_labels=num_labels, **extra)
    return config


def _swin(config_class: str):
    def config(image_size: int, num_labels: int):
        return _config(config_class, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4, image_size=image_size,
                       patch_size=2, num_labels=num_labels)
    return config


def _two_towers(config_class: str):
    def config(image_size: int, num_labels: int):
        vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                      image_size=image_size, patch_size=4)
        text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=64,
                    max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)
        return _config(config_class, vision_config=vision, text_config=text, num_labels=num_labels)
    return config


def _config(class_name: str, num_labels: int, **kwargs):
    import transformers

    labels = {i: f"imagenet_{i}" for i in range(num_labels)}
    return getattr(transformers, class_name)(id2label=labels, label2id={v: k for k, v in labels.items()}, **kwargs)


def _processor(class_name: str, size: dict, crop: dict | None = None):
    def processor(image_size: int):
        import transformers

        side = {k: (image_size * 9 // 8 if k == "shortest_edge" or crop else image_size) for k in size}
        crop_size = {"height": image_size, "width": image_size} if crop is not None else None
        extra = {"crop_size": crop_size, "do_center_crop": True} if crop_size else {}
        return getattr(transformers, class_name)(size=side, **extra)
    return processor


HW, SHORT = {"height": 0, "width": 0}, {"shortest_edge": 0}
# model_type -> (config builder, class saved as the "Hub" checkpoint, image processor builder)
TINY_FAMILIES = {
    "vit": (_vit_like("ViTConfig"), "ViTForImageClassification", _processor("ViTImageProcessorPil", HW)),
    "vit_msn": (_vit_like("ViTMSNConfig"), "ViTMSNModel", _processor("ViTImageProcessorPil", HW)),
    "deit": (_vit_like("DeiTConfig"), "DeiTForImageClassificationWithTeacher",
             _processor("DeiTImageProcessorPil", HW, crop=HW)),
    "beit": (_vit_like("BeitConfig", use_relative_position_bias=True), "BeitForImageClassification",
             _processor("BeitImageProcessorPil", HW)),
    # Data2Vec covers the other BEiT layout: one shared bias table and an absolute table.
    "data2vec-vision": (_vit_like("Data2VecVisionConfig", use_shared_relative_position_bias=True,
                                  use_absolute_position_embeddings=True), "Data2VecVisionModel",
                        _processor("BeitImageProcessorPil", HW)),
    "dinov2": (_vit_like("Dinov2Config"), "Dinov2Model", _processor("BitImageProcessorPil", SHORT, crop=HW)),
    "dinov2_with_registers": (_vit_like("Dinov2WithRegistersConfig", num_register_tokens=2),
                              "Dinov2WithRegistersModel", _processor("BitImageProcessorPil", SHORT, crop=HW)),
    "swin": (_swin("SwinConfig"), "SwinForImageClassification", _processor("ViTImageProcessorPil", HW)),
    "swinv2": (_swin("Swinv2Config"), "Swinv2ForImageClassification", _processor("ViTImageProcessorPil", HW)),
    "clip": (_two_towers("CLIPConfig"), "CLIPModel", _processor("CLIPImageProcessorPil", SHORT, crop=HW)),
    "siglip": (_two_towers("SiglipConfig"), "SiglipModel", _processor("SiglipImageProcessorPil", HW)),
}
POSITION_TENSORS = ("position_embeddings", "position_embedding.weight", "relative_position_bias_table")


def tiny_family_config(model_type: str, image_size: int = 32, num_labels: int = 10):
    return TINY_FAMILIES[model_type][0](image_size, num_labels)


def make_tiny_family(model_type: str, folder: Path, image_size: int = 32, seed: int = 0, model=None) -> Path:
    """A tiny random checkpoint of `model_type` saved like its Hub checkpoints; position tensors made non-trivial
    (several families initialise them to zeros, which would make any resize look exact). `model`: save this one."""
    import torch
    import transformers

    config_builder, saved_class, processor_builder = TINY_FAMILIES[model_type]
    torch.manual_seed(seed)
    if model is None:
        model = getattr(transformers, saved_class)(config_builder(image_size, 10))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(POSITION_TENSORS):
                    parameter.normal_(std=0.5)
    model.save_pretrained(folder)
    processor_builder(image_size).save_pretrained(folder)
    return Path(folder)


def stripes_image(colours: list[str], rng: np.random.Generator, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """Vertical stripes, one per colour (in a seeded order), with noise: its label set is its colours."""
    width, height = size
    pixels = np.zeros((height, width, 3))
    order = rng.permutation(len(colours))
    edges = np.linspace(0, width, len(colours) + 1).round().astype(int)
    for stripe, index in enumerate(order):
        pixels[:, edges[stripe]:edges[stripe + 1]] = COLOURS[colours[index]]
    return Image.fromarray(np.clip(pixels + rng.normal(0, 25, pixels.shape), 0, 255).astype(np.uint8))


def write_label_sets(root: Path, images: int = 24, classes: int = 4, seed: int = 0, kind: str = "csv",
                     split_column: bool = False) -> Path:
    """root/images/i.png striped with 1-3 colours, and a label file root/labels.{csv,jsonl} naming each image's
    colours (CSV: 'red;blue'; JSONL: a list). With `split_column`, every third image is in split 'validation'."""
    import csv
    import json

    rng = np.random.default_rng(seed)
    names = list(COLOURS)[:classes]
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(images):
        chosen = sorted(rng.choice(names, size=int(rng.integers(1, 4)), replace=False).tolist())
        stripes_image(chosen, rng).save(root / "images" / f"{i}.png")
        row = {"file_name": f"images/{i}.png", "labels": chosen}
        if split_column:
            row["split"] = "validation" if i % 3 == 0 else "train"
        rows.append(row)
    path = root / f"labels.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        with open(path, "w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({**row, "labels": ";".join(row["labels"])} for row in rows)
    return path
