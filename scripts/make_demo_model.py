"""Pretrain the tiny ViT that vit_finetune ships as its embedded default model.

    python scripts/make_demo_model.py            # writes vit_finetune/model/assets/tiny-vit-32/

Generates the "pretrain" task of vit_finetune.data.synthetic (ten shapes at 32x32 px),
trains a small ViTForImageClassification on it from scratch with plain torch on CPU
(fixed seeds; a few minutes on 2 cores), prints the validation accuracy, and saves
model (safetensors) + image processor + a README.md. The demo later fine-tunes this
model at 64x64 px on a *different* set of shapes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import ViTConfig, ViTForImageClassification

try:  # transformers >= 5 without torchvision: the PIL backend, imported directly to avoid a warning
    from transformers import ViTImageProcessorPil as ViTImageProcessor
except ImportError:  # older transformers
    from transformers import ViTImageProcessor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from vit_finetune.data import synthetic  # noqa: E402

DEFAULT_OUT = REPO / "vit_finetune" / "assets" / "tiny-vit-32"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--train-per-class", type=int, default=800)
    p.add_argument("--val-per-class", type=int, default=100)
    p.add_argument("--epochs", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def to_pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 NHWC -> float NCHW normalised with mean = std = 0.5, like the saved image processor."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random flips and 90-degree rotations. Shapes are already randomly rotated, so these are
    label-preserving; they just stretch the fixed training set further."""
    flip = torch.rand(x.shape[0], generator=gen) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    k = int(torch.randint(4, (1,), generator=gen))
    return torch.rot90(x, k, dims=(-2, -1))


@torch.no_grad()
def accuracy(model: ViTForImageClassification, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> float:
    model.eval()
    correct = sum(
        (model(pixel_values=x[i : i + batch_size]).logits.argmax(-1) == y[i : i + batch_size]).sum().item()
        for i in range(0, len(x), batch_size)
    )
    return correct / len(x)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    size = synthetic.TASKS["pretrain"]["image_size"]

    t0 = time.time()
    train_imgs, train_y, classes = synthetic.generate_arrays(args.train_per_class, "train", "pretrain", seed=args.seed)
    val_imgs, val_y, _ = synthetic.generate_arrays(args.val_per_class, "validation", "pretrain", seed=args.seed)
    x_train, y_train = to_pixels(train_imgs), torch.from_numpy(train_y)
    x_val, y_val = to_pixels(val_imgs), torch.from_numpy(val_y)
    print(f"generated {len(x_train)} train / {len(x_val)} val images ({size}px) in {time.time() - t0:.1f}s")

    config = ViTConfig(
        image_size=size,
        patch_size=4,  # 8x8 patch grid + CLS at 32 px; 16x16 at the demo's 64 px
        num_channels=3,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=len(classes),
        id2label=dict(enumerate(classes)),
        label2id={c: i for i, c in enumerate(classes)},
    )
    model = ViTForImageClassification(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params, hidden={args.hidden} layers={args.layers} heads={args.heads}")

    steps_per_epoch = math.ceil(len(x_train) / args.batch_size)
    total = args.epochs * steps_per_epoch
    warmup = steps_per_epoch  # one epoch of linear warmup keeps early attention training stable
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
    )
    gen = torch.Generator().manual_seed(args.seed)

    t0 = time.time()
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(x_train), generator=gen)
        running = 0.0
        for i in range(0, len(perm), args.batch_size):
            idx = perm[i : i + args.batch_size]
            logits = model(pixel_values=augment(x_train[idx], gen)).logits
            loss = F.cross_entropy(logits, y_train[idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            running += loss.item() * len(idx)
        val_acc = accuracy(model, x_val, y_val)
        print(
            f"epoch {epoch + 1}/{args.epochs}  loss {running / len(x_train):.3f}  "
            f"val acc {val_acc:.4f}  ({time.time() - t0:.0f}s)",
            flush=True,
        )
    train_time = time.time() - t0
    print(f"pretraining validation accuracy: {val_acc:.4f} ({len(x_val)} images, {len(classes)} classes)")

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)  # safetensors, float32
    ViTImageProcessor(
        do_resize=True,
        size={"height": size, "width": size},
        do_rescale=True,
        do_normalize=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(args.out)
    write_readme(args, config, n_params, classes, val_acc, len(x_train), len(x_val), train_time)
    folder_mb = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file()) / 1e6
    print(f"saved to {args.out} ({folder_mb:.2f} MB)")


def write_readme(args, config, n_params, classes, val_acc, n_train, n_val, train_time) -> None:
    command = " ".join(["python scripts/make_demo_model.py", *sys.argv[1:]])  # the exact command that ran
    (args.out / "README.md").write_text(
        f"""# tiny-vit-32

The embedded default model of `vit_finetune`: a tiny ViT pretrained from scratch on
synthetic shapes, so the demo can fine-tune a *pretrained* model without the network.
Not useful for real images.

- Made by: `{command}` (deterministic: fixed seeds, data from `vit_finetune/data/synthetic.py`)
- Architecture: `ViTForImageClassification`, image {config.image_size}x{config.image_size}, patch {config.patch_size}
  ({config.image_size // config.patch_size}x{config.image_size // config.patch_size} grid + CLS), hidden {config.hidden_size},
  {config.num_hidden_layers} layers, {config.num_attention_heads} heads, MLP {config.intermediate_size}; {n_params / 1e6:.2f}M params, float32
- Pretraining data: task `pretrain` of `vit_finetune.data.synthetic`, {len(classes)} classes
  ({", ".join(classes)}), {n_train} train / {n_val} validation images at 32 px,
  random position/scale/rotation/colour on cluttered, noisy backgrounds
- Training: AdamW lr {args.lr}, weight decay {args.weight_decay}, batch {args.batch_size}, {args.epochs} epochs,
  1 epoch warmup + cosine, label smoothing 0.1, flip/rot90 augmentation; {train_time / 60:.1f} min on CPU
- **Pretraining validation accuracy: {val_acc:.2%}**
- Preprocessing (`preprocessor_config.json`): resize to 32x32, rescale to [0, 1], normalise with mean = std = 0.5
"""
    )


if __name__ == "__main__":
    main()
