"""Pretrain a tiny checkpoint of every ViT-family model_type, to fine-tune at a new resolution with the toolkit.

    python scripts/make_family_bases.py --out /tmp/family-bases [--seconds 60] [--only deit clip]
    python -m vit_finetune --recipe demo model.base=/tmp/family-bases/deit output_dir=/tmp/fam-deit

Each family's tiny configuration (tests/tiny.py, 32 px) is trained from scratch for a fixed wall-clock budget on the
"pretrain" shapes of vit_finetune.data.synthetic, with the normalisation of the image processor saved beside it, then
saved with save_pretrained. The demo recipe then fine-tunes it at 64 px, twice its pretraining size, on other shapes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
from make_demo_model import accuracy, augment  # noqa: E402  (scripts/ is on sys.path when run as a script)
from tiny import TINY_FAMILIES, make_tiny_family, tiny_family_config  # noqa: E402
from vit_finetune.data import synthetic  # noqa: E402
from vit_finetune.model.families import FAMILIES  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", nargs="*", default=list(TINY_FAMILIES), choices=list(TINY_FAMILIES))
    p.add_argument("--seconds", type=float, default=60.0, help="training wall-clock budget per family")
    p.add_argument("--train-per-class", type=int, default=300)
    p.add_argument("--val-per-class", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def to_pixels(images: np.ndarray, processor) -> torch.Tensor:
    """uint8 NHWC -> float NCHW normalised as the processor saved with the model normalises."""
    mean = torch.tensor(processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std).view(1, 3, 1, 1)
    return (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255 - mean) / std


def pretrain(model_type: str, args: argparse.Namespace, arrays: dict, out: Path) -> float:
    """Train the family's tiny classifier for the time budget; save it with its processor; return val accuracy."""
    torch.manual_seed(args.seed)
    (train_images, train_labels, classes), (val_images, val_labels, _) = arrays["train"], arrays["validation"]
    config = tiny_family_config(model_type, image_size=32, num_labels=len(classes))
    config.id2label, config.label2id = dict(enumerate(classes)), {c: i for i, c in enumerate(classes)}
    model = FAMILIES[model_type].model_class()(config)
    processor = TINY_FAMILIES[model_type][2](32)
    x_train, y_train = to_pixels(train_images, processor), torch.from_numpy(train_labels)
    x_val, y_val = to_pixels(val_images, processor), torch.from_numpy(val_labels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    generator = torch.Generator().manual_seed(args.seed)
    start, steps = time.time(), 0
    while time.time() - start < args.seconds:
        model.train()
        order = torch.randperm(len(x_train), generator=generator)
        for i in range(0, len(order), args.batch_size):
            index = order[i: i + args.batch_size]
            loss = F.cross_entropy(model(pixel_values=augment(x_train[index], generator)).logits, y_train[index],
                                   label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            steps += 1
            if time.time() - start >= args.seconds:
                break
    val_accuracy = accuracy(model, x_val, y_val)
    make_tiny_family(model_type, out, image_size=32, model=model)
    print(f"{model_type}: {steps} steps in {time.time() - start:.0f}s, pretraining val accuracy {val_accuracy:.4f} "
          f"({len(x_val)} images, {len(classes)} classes) -> {out}", flush=True)
    return val_accuracy


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # on a CPU shared with other jobs, two threads per matmul ran 25x slower here
    arrays = {split: synthetic.generate_arrays(count, split, "pretrain", seed=args.seed)
              for split, count in (("train", args.train_per_class), ("validation", args.val_per_class))}
    for model_type in args.only:
        pretrain(model_type, args, arrays, args.out / model_type)


if __name__ == "__main__":
    main()
