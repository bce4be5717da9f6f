"""Deterministic synthetic image-classification data (PIL + numpy only).

Two tasks share one renderer, so features learned on one carry over to the other:

* ``"pretrain"`` -- ten basic shapes (circle, square, triangle, ...) at 32 px.
  Used by ``scripts/make_demo_model.py`` to pretrain the embedded tiny ViT.
* ``"demo"`` -- eight *different* shapes (outlines, letters, dot groups, ...) at
  64 px. Used by ``make demo`` to fine-tune that ViT at twice its pretraining
  resolution with a new head.

Every image is one filled shape with a random colour, position, scale and
rotation on a cluttered background (colour gradient, random distractor strokes,
pixel noise), so a classifier has to learn the shape itself, not a shortcut.

Each image gets its own RNG seeded from ``(seed, task, split, class, index)``,
so the same seed gives byte-identical files regardless of how many images are
requested or in which order they are written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

# A shape is a list of (polygon, fill) drawing ops in unit coordinates (centred
# at 0, roughly inside the unit disc). fill=0 cuts holes, which gives rings,
# outlines and crescents without any special casing in the renderer.
Polygon = np.ndarray  # (N, 2) float array
ShapeOps = list[tuple[Polygon, int]]


def _ngon(n: int, r: float = 1.0, phase: float = 0.0, cx: float = 0.0, cy: float = 0.0) -> Polygon:
    t = phase + 2 * np.pi * np.arange(n) / n
    return np.stack([cx + r * np.cos(t), cy + r * np.sin(t)], axis=1)


def _rect(x0: float, y0: float, x1: float, y1: float) -> Polygon:
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], dtype=float)


def _star(points: int, r_out: float, r_in: float) -> Polygon:
    t = np.pi / 2 + np.pi * np.arange(2 * points) / points
    r = np.where(np.arange(2 * points) % 2 == 0, r_out, r_in)
    return np.stack([r * np.cos(t), r * np.sin(t)], axis=1)


_SHAPES: dict[str, Callable[[], ShapeOps]] = {
    # --- pretraining shapes ---
    "circle": lambda: [(_ngon(40, 0.9), 1)],
    "square": lambda: [(_rect(-0.75, -0.75, 0.75, 0.75), 1)],
    "triangle": lambda: [(_ngon(3, 1.0, np.pi / 2), 1)],
    "cross": lambda: [(_rect(-0.95, -0.3, 0.95, 0.3), 1), (_rect(-0.3, -0.95, 0.3, 0.95), 1)],
    "ring": lambda: [(_ngon(40, 0.95), 1), (_ngon(40, 0.55), 0)],
    "star": lambda: [(_star(5, 1.0, 0.42), 1)],
    "ellipse": lambda: [(_ngon(40, 1.0) * [1.0, 0.45], 1)],
    "crescent": lambda: [(_ngon(40, 0.95), 1), (_ngon(40, 0.8, cx=0.45), 0)],
    "pacman": lambda: [(np.concatenate([[[0.0, 0.0]], _ngon(40, 0.95, np.pi / 3.6)[:31]]), 1)],
    "arrow": lambda: [
        (np.array([[-0.95, -0.22], [0.1, -0.22], [0.1, -0.6], [0.95, 0.0], [0.1, 0.6], [0.1, 0.22], [-0.95, 0.22]]), 1)
    ],
    # --- demo (downstream) shapes: none of these appear in pretraining ---
    "frame": lambda: [(_rect(-0.8, -0.8, 0.8, 0.8), 1), (_rect(-0.45, -0.45, 0.45, 0.45), 0)],
    "triangle_outline": lambda: [(_ngon(3, 1.0, np.pi / 2), 1), (_ngon(3, 0.45, np.pi / 2), 0)],
    "semicircle": lambda: [(np.concatenate([_ngon(40, 0.95)[:21], [[0.95, 0.0]]]), 1)],
    "tee": lambda: [(_rect(-0.9, -0.85, 0.9, -0.4), 1), (_rect(-0.22, -0.85, 0.22, 0.9), 1)],
    "hourglass": lambda: [(np.array([[-0.75, -0.95], [0.75, -0.95], [0.12, 0.0], [0.75, 0.95], [-0.75, 0.95], [-0.12, 0.0]]), 1)],
    "bars": lambda: [(_rect(-0.9, -0.7, 0.9, -0.3), 1), (_rect(-0.9, 0.3, 0.9, 0.7), 1)],
    "dots": lambda: [(_ngon(20, 0.32, cx=cx, cy=cy), 1) for cx, cy in [(-0.5, -0.5), (0.5, -0.5), (-0.5, 0.5), (0.5, 0.5)]],
    "octagram": lambda: [(_star(8, 1.0, 0.65), 1)],
}

TASKS: dict[str, dict] = {
    "pretrain": {
        "classes": ["circle", "square", "triangle", "cross", "ring", "star", "ellipse", "crescent", "pacman", "arrow"],
        "image_size": 32,
    },
    "demo": {
        "classes": ["frame", "triangle_outline", "semicircle", "tee", "hourglass", "bars", "dots", "octagram"],
        "image_size": 64,
    },
}

# Demo dataset size: small enough to write in ~1 s and fine-tune in ~1-2 min on 2 CPU cores.
DEMO_IMAGES_PER_CLASS: dict[str, int] = {"train": 48, "validation": 24}
DEMO_SEED = 0

_SUPERSAMPLE = 4  # shapes are drawn at 4x and box-downsampled, i.e. anti-aliased
# "Ink on paper": shapes are always darker than the background (hues stay random). A ViT's
# linear patch embedding can then tell shape from background directly; with random contrast
# polarity a tiny ViT sat at chance for many epochs, far beyond the pretraining budget.
_PAPER_MIN = 140.0  # min brightness of the two background colours
_INK_CONTRAST = 70.0  # shape is at least this much darker than the background's mean


def _stable_id(text: str) -> int:
    # Python's hash() is salted per process; crc32 is stable across runs.
    return zlib.crc32(text.encode())


def _random_colour(rng: np.random.Generator, lo: float = 0.0, hi: float = 255.0) -> np.ndarray:
    """Random RGB colour whose brightness (channel mean) lies in [lo, hi]."""
    while True:
        c = rng.uniform(0, 255, size=3)
        if lo <= c.mean() <= hi:
            return c


def _background(size: int, rng: np.random.Generator) -> np.ndarray:
    """Light linear gradient between two random colours plus random distractor strokes and dots."""
    c0, c1 = _random_colour(rng, lo=_PAPER_MIN), _random_colour(rng, lo=_PAPER_MIN)
    angle = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:size, 0:size] / max(size - 1, 1)
    t = np.clip(0.5 + (xx - 0.5) * np.cos(angle) + (yy - 0.5) * np.sin(angle), 0, 1)[..., None]
    bg = (1 - t) * c0 + t * c1

    # Distractors: thin lines and small dots -- too thin/small to be mistaken for a shape,
    # but they break up the background so "any edge" is not a class cue.
    img = Image.fromarray(bg.astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.integers(1, 5)):
        x0, y0, x1, y1 = rng.uniform(0, size, 4)
        draw.line([(x0, y0), (x1, y1)], fill=tuple(int(v) for v in _random_colour(rng)), width=1)
    for _ in range(rng.integers(0, 4)):
        x, y = rng.uniform(0, size, 2)
        r = rng.uniform(0.5, max(1.0, size / 32))
        draw.ellipse([x - r, y - r, x + r, y + r], fill=tuple(int(v) for v in _random_colour(rng)))
    return np.asarray(img, dtype=np.float32)


def _shape_mask(shape: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """Anti-aliased alpha mask (float32 in [0, 1]) of one randomly placed/scaled/rotated shape."""
    scale = rng.uniform(0.25, 0.45) * size  # radius in pixels
    angle = rng.uniform(0, 2 * np.pi)
    stretch = rng.uniform(0.85, 1.15)  # mild aspect jitter so templates aren't exact
    margin = scale * 0.8  # allow slight cropping at the border, as in real photos
    cx, cy = rng.uniform(margin, size - margin, 2)

    rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    big = size * _SUPERSAMPLE
    mask = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(mask)
    for poly, fill in _SHAPES[shape]():
        pts = (poly * [stretch, 1.0 / stretch]) @ rot.T * scale + [cx, cy]
        draw.polygon([tuple(p) for p in (pts * _SUPERSAMPLE)], fill=255 * fill)
    mask = mask.resize((size, size), Image.Resampling.BOX)
    return np.asarray(mask, dtype=np.float32) / 255.0


def render(shape: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """Render one ``size`` x ``size`` RGB uint8 image of ``shape`` on a cluttered background."""
    bg = _background(size, rng)
    colour = _random_colour(rng, hi=bg.mean() - _INK_CONTRAST)
    alpha = _shape_mask(shape, size, rng)[..., None]
    img = bg * (1 - alpha) + colour * alpha
    img += rng.normal(0, rng.uniform(3, 12), img.shape)  # sensor-like noise over everything
    return np.clip(img, 0, 255).round().astype(np.uint8)


def _image_rng(seed: int, task: str, split: str, label: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, _stable_id(task), _stable_id(split), label, index])


def _resolve(task: str, classes: Sequence[str] | None, image_size: int | None) -> tuple[list[str], int]:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    classes = list(classes) if classes is not None else list(TASKS[task]["classes"])
    unknown = [c for c in classes if c not in _SHAPES]
    if unknown:
        raise ValueError(f"unknown shape classes {unknown}; available: {sorted(_SHAPES)}")
    return classes, int(image_size or TASKS[task]["image_size"])


def generate_arrays(
    n_per_class: int,
    split: str = "train",
    task: str = "pretrain",
    classes: Sequence[str] | None = None,
    image_size: int | None = None,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """In-memory variant of :func:`write_image_folder` for one split.

    Returns ``(images, labels, classes)`` with images of shape (N, H, W, 3) uint8,
    ordered class by class. Pixel-identical to what ``write_image_folder`` saves as PNG.
    """
    classes, size = _resolve(task, classes, image_size)
    images = np.empty((len(classes) * n_per_class, size, size, 3), dtype=np.uint8)
    labels = np.repeat(np.arange(len(classes)), n_per_class)
    for k, (label, i) in enumerate((c, i) for c in range(len(classes)) for i in range(n_per_class)):
        images[k] = render(classes[label], size, _image_rng(seed, task, split, label, i))
    return images, labels, classes


def write_image_folder(
    root: str | os.PathLike,
    classes: Sequence[str] | None = None,
    images_per_class: dict[str, int] | None = None,
    image_size: int | None = None,
    seed: int = 0,
    task: str = "demo",
) -> Path:
    """Write ``root/<split>/<class>/<i>.png`` for each split in ``images_per_class``.

    The layout is what ``datasets.load_dataset("imagefolder", data_dir=root)`` reads
    (splits "train" and "validation"). ``classes`` defaults to the task's classes and
    ``image_size`` to the task's native size (pretrain: 32, demo: 64). Same arguments
    give byte-identical files. Returns ``root``.
    """
    classes, size = _resolve(task, classes, image_size)
    images_per_class = images_per_class or dict(DEMO_IMAGES_PER_CLASS)
    root = Path(root)
    for split, n in images_per_class.items():
        for label, name in enumerate(classes):
            out = root / split / name
            out.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                img = render(name, size, _image_rng(seed, task, split, label, i))
                # Fixed PNG settings (no metadata) keep the bytes reproducible.
                Image.fromarray(img).save(out / f"{i:04d}.png", compress_level=6)
    return root


def _is_complete(path: Path, classes: Sequence[str], images_per_class: dict[str, int]) -> bool:
    return all(
        (path / split / name).is_dir() and len(list((path / split / name).glob("*.png"))) == n
        for split, n in images_per_class.items()
        for name in classes
    )


def ensure_demo_dataset(cache_dir: str | os.PathLike, seed: int = DEMO_SEED) -> Path:
    """Write the demo dataset under ``cache_dir`` once and return its imagefolder root.

    Idempotent and safe against interruption or concurrent callers: the data is written
    to a temporary sibling directory and atomically renamed into place; an existing
    complete copy is reused as is.
    """
    classes = TASKS["demo"]["classes"]
    cache_dir = Path(cache_dir)
    target = cache_dir / f"synthetic-shapes-demo-seed{seed}"
    if _is_complete(target, classes, DEMO_IMAGES_PER_CLASS):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=cache_dir))
    try:
        write_image_folder(tmp, classes, dict(DEMO_IMAGES_PER_CLASS), seed=seed, task="demo")
        if target.exists():  # stale/partial copy from an older layout: replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; use its copy if it's complete.
            if not _is_complete(target, classes, DEMO_IMAGES_PER_CLASS):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
