"""The limits a recipe's input must fit: its size and depth, the longest name a file system takes, and the bound of
each whole-number key.

The lowest layer of the recipe package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vit_finetune.core.errors import excerpt

# A recipe has ~60 keys. A YAML alias bomb ("billion laughs") loads in milliseconds as shared references, then
# expands to hundreds of millions of values wherever it is walked (validation, messages): refuse it first.
MAX_RECIPE_VALUES = 10_000
MAX_RECIPE_BYTES = 1_000_000
# The deepest key (model.lora.target_modules) is a list 3 levels down; YAML and pydantic recurse per level, and a
# value nested thousands deep ends in a RecursionError. (An alias bomb is shallow: MAX_RECIPE_VALUES stops it.)
MAX_RECIPE_DEPTH = 32
NAME_MAX = 255  # bytes in one file or folder name: ext4, XFS, APFS and NTFS allow no more
SEED_MAX = 2**32 - 1  # NumPy's generators take no larger seed (nor a negative one)
MAX_GRID_SIDE = 256  # patches per side: 4,096 px at patch 16 (DINOv2's grid is 37 a side)
# Whole-number keys are bounded where no run means more: past these a value is a typo or years of compute, and a huge
# one overflows a C integer inside torch, Accelerate or NumPy once data and model have loaded (train.grad_accum=1e20:
# an OverflowError at the first backward). Each bound, key -> (largest value, why).
WHOLE_NUMBER_LIMITS: dict[str, tuple[int, str]] = {
    "model.image_size": (MAX_GRID_SIDE * 64, f"{MAX_GRID_SIDE} patches a side at the largest patch, 64 px"),
    "model.window_size": (MAX_GRID_SIDE, f"a window spans at most the {MAX_GRID_SIDE}-patch grid"),
    "model.lora.r": (4096, "a rank above the model's width adds nothing, and ViT-G is 1,664 wide"),
    "data.num_workers": (256, "more decode processes than any machine has cores"),
    "data.shuffle_buffer": (10_000_000, "rows each process holds in memory"),
    "augment.randaugment_ops": (15, "kornia's RandAugment draws that many distinct operations from its 15"),
    "augment.randaugment_magnitude": (29, "kornia's RandAugment takes 1 to 29"),
    "augment.mix_off_epochs": (100_000, "as many as train.epochs may be"),
    "train.epochs": (100_000, "years of compute on any real dataset; for a long run on few images use train.max_steps"),
    "train.max_steps": (10_000_000, "weeks at 10 steps a second, more than any ViT fine-tune takes"),
    "train.batch_size": (65_536, "images per device per forward pass, more than any device holds"),
    "train.grad_accum": (65_536, "an effective batch beyond any published ViT recipe's"),
    "train.warmup_steps": (10_000_000, "as many steps as train.max_steps may be"),
    "train.log_every_steps": (10_000_000, "as many steps as train.max_steps may be"),
    "train.eval_every_steps": (10_000_000, "as many steps as train.max_steps may be"),
    "train.checkpoint_every_steps": (10_000_000, "as many steps as train.max_steps may be"),
    "train.early_stopping_patience": (10_000_000, "as many steps as train.max_steps may be"),
    "train.keep_checkpoints": (10_000, "each is a copy of the model and the optimiser on disk"),
    "train.cpu_threads": (4096, "more threads than any machine has cores"),
    "train.collective_timeout_s": (7 * 24 * 3600, "a week; a longer wait is a hang"),
}
# The whole-number keys left unbounded, and why no value of theirs can overflow or run for years.
UNBOUNDED_WHOLE_NUMBERS = {
    "train.seed": "checked against SEED_MAX",
    "model.keep_blocks": "checked against the base's depth when its config is read",
    "data.max_train_samples": "a subset larger than the split is the whole split",
    "data.max_eval_samples": "a subset larger than the split is the whole split",
    "data.min_image_side": "compared with each image's side in Python: too large, every image is named as too small",
    "data.max_image_pixels": "compared with each image's pixel count in Python",
}
def names_fit(value: str | None) -> str | None:
    """A path's every name within NAME_MAX bytes; a longer one fails in the file system (ENAMETOOLONG) at first use."""
    for name in (value or "").split("/"):
        if len(name.encode()) > NAME_MAX:
            raise ValueError(f"holds a name of {len(name.encode())} bytes ({excerpt(name)}); file systems allow "
                             f"{NAME_MAX}. Shorten it")
    return value


def _is_file(path: str | Path) -> bool:
    """Path.is_file, but False (not OSError) for a name the file system refuses, e.g. longer than 255 bytes."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def _is_dir(path: str | Path) -> bool:
    try:
        return Path(path).is_dir()
    except OSError:
        return False


def count_values(data: Any, limit: int = MAX_RECIPE_VALUES) -> int:
    """Values in `data` with YAML aliases expanded, counted without expanding them (each shared node's count is
    remembered); anything over `limit`, or a node that contains itself, counts as limit + 1."""
    counts: dict[int, int] = {}
    open_nodes: set[int] = set()

    def count(node: Any) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        key = id(node)
        if key in open_nodes:  # `a: &a [*a]` is a list that holds itself: infinitely large once expanded
            return limit + 1
        if key not in counts:
            open_nodes.add(key)
            children = node.values() if isinstance(node, dict) else node
            counts[key] = min(limit + 1, 1 + sum(count(child) for child in children))
            open_nodes.discard(key)
        return counts[key]

    try:
        return count(data)
    except RecursionError:  # nested deeper than Python's stack: no recipe is
        return limit + 1


def deepest(data: Any, limit: int = MAX_RECIPE_DEPTH) -> tuple[int, str]:
    """How deep `data` nests (counted up to limit + 1, without recursion) and the dotted key where it does. A node
    shared through YAML aliases is walked once, so an alias bomb costs no more than its text."""
    stack, found, seen = [(data, 1, "")], (0, ""), set()
    while stack:
        node, depth, key = stack.pop()
        if not isinstance(node, (dict, list)) or id(node) in seen:
            continue
        seen.add(id(node))
        found = max(found, (depth, key))
        if depth > limit:
            break
        children = node.items() if isinstance(node, dict) else ((None, child) for child in node)
        stack.extend((child, depth + 1, f"{key}.{name}".lstrip(".") if name is not None else key)
                     for name, child in children)
    return found
