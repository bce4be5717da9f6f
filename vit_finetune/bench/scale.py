"""Arithmetic for runs this machine cannot make: epoch time, decode cores, shards and checkpoints at N GPUs.

`python -m vit_finetune.bench.scale --gpus 8 64 --rate 1050` prints the table of docs/distributed.md.
Every input is a flag, so a measured per-GPU rate (`make bench` on the GPU) replaces the goal figure. The
parameter count comes from the model's config; the rest is multiplication, not measurement.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

# Defaults, each labelled by where it comes from.
IMAGENET_21K_IMAGES = 14_197_122  # reference: ImageNet-21k (fall11) image count
IMAGENET_21K_BYTES = 1.31e12  # reference: the fall11 tar, ~92 KB per JPEG on average
IMAGENET_21K_CLASSES = 21_841  # reference
GOAL_RATE = 1_050  # images/s per H100: the model-step goal (~35 % MFU), not a measured rate
DECODE_RATE_PER_CORE = 404  # measured: 808.0 img/s with 2 workers on 2 cores (docs/performance.md)
ADAMW_BYTES_PER_PARAMETER = 4 + 8  # fp32 weights, then AdamW's two fp32 moments (Accelerate's save_state)


@dataclass(frozen=True)
class Workload:
    images: int
    dataset_bytes: float
    parameters: int
    rate_per_gpu: float
    batch_per_gpu: int
    decode_rate_per_core: float
    shard_bytes: float  # the largest shard wanted
    checkpoint_minutes: float  # at most this much training lost to a crash


def vit_parameters(image_size: int, num_labels: int) -> int:
    """ViT-B/16's parameter count with this head and position table, from the config (no weights are made)."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    with torch.device("meta"):
        model = ViTForImageClassification(ViTConfig(image_size=image_size, num_labels=num_labels))
    return sum(parameter.numel() for parameter in model.parameters())


def checkpoint_bytes(parameters: int) -> int:
    """What one resumable checkpoint of full fine-tuning with AdamW holds: weights and both moments in fp32."""
    return parameters * ADAMW_BYTES_PER_PARAMETER


def all_reduce_bus_bytes(parameters: int, gpus: int) -> float:
    """Bytes each GPU sends per step in DDP's ring all-reduce of the fp32 gradients (NCCL's "bus bandwidth")."""
    return 2 * (gpus - 1) / gpus * parameters * 4


def shard_count(dataset_bytes: float, gpu_counts: list[int], shard_bytes: float) -> int:
    """The fewest shards of at most `shard_bytes` that every GPU count divides evenly.

    Even division matters: datasets' split_dataset_by_node then gives each rank whole shards; otherwise every
    rank reads every shard and keeps one row in world_size, so the job downloads the dataset world_size times.
    """
    unit = math.lcm(*gpu_counts)
    return unit * max(1, math.ceil(dataset_bytes / shard_bytes / unit))


def plan(workload: Workload, gpus: int, shards: int) -> dict:
    """One row of the table: what `gpus` GPUs at the per-GPU rate mean for the epoch, data, shards, checkpoints."""
    rate = workload.rate_per_gpu * gpus
    step_rate = workload.rate_per_gpu / workload.batch_per_gpu  # optimiser steps per second
    steps_per_epoch = math.ceil(workload.images / (workload.batch_per_gpu * gpus))
    checkpoint_every = max(1, int(workload.checkpoint_minutes * 60 * rate / (workload.batch_per_gpu * gpus)))
    return {
        "gpus": gpus,
        "images_per_s": rate,
        "epoch_minutes": workload.images / rate / 60,
        "steps_per_epoch": steps_per_epoch,
        "decode_cores_per_gpu": math.ceil(workload.rate_per_gpu / workload.decode_rate_per_core),
        "read_gb_per_s": rate * workload.dataset_bytes / workload.images / 1e9,
        "all_reduce_gb_per_s": all_reduce_bus_bytes(workload.parameters, gpus) * step_rate / 1e9,
        "shards_per_rank": shards // gpus,
        "checkpoint_every_steps": checkpoint_every,
    }


def format_table(workload: Workload, rows: list[dict], shards: int) -> str:
    lines = [
        "| GPUs | images/s | epoch | steps/epoch (batch {b}/GPU) | decode cores/GPU | read from storage | "
        "gradient all-reduce | shards/rank | checkpoint every |".format(b=workload.batch_per_gpu),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['gpus']} | {row['images_per_s']:,.0f} | {row['epoch_minutes']:.1f} min | {row['steps_per_epoch']:,} "
            f"| {row['decode_cores_per_gpu']} (+1 for the training process) | {row['read_gb_per_s']:.2f} GB/s "
            f"| {row['all_reduce_gb_per_s']:.1f} GB/s per GPU | {row['shards_per_rank']} | {row['checkpoint_every_steps']:,} steps (~{workload.checkpoint_minutes:.0f} min) |"
        )
    size = checkpoint_bytes(workload.parameters)
    lines += [
        "",
        f"{workload.images:,} images, {workload.dataset_bytes / 1e12:.2f} TB in {shards:,} shards of "
        f"{workload.dataset_bytes / shards / 1e6:,.0f} MB; {workload.parameters:,} parameters -> a checkpoint of "
        f"{size / 1e9:.2f} GB (fp32 weights {workload.parameters * 4 / 1e9:.2f} GB + AdamW moments "
        f"{workload.parameters * 8 / 1e9:.2f} GB; EMA or keep-best add {workload.parameters * 4 / 1e9:.2f} GB each)",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vit_finetune.bench.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--rate", type=float, default=GOAL_RATE,
                        help=f"training images/s per GPU (default {GOAL_RATE}: the goal, not a measurement; "
                             "give make bench's figure)")
    parser.add_argument("--images", type=int, default=IMAGENET_21K_IMAGES)
    parser.add_argument("--dataset-tb", type=float, default=IMAGENET_21K_BYTES / 1e12)
    parser.add_argument("--classes", type=int, default=IMAGENET_21K_CLASSES)
    parser.add_argument("--image-size", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=128, help="per GPU")
    parser.add_argument("--decode-rate", type=float, default=DECODE_RATE_PER_CORE, help="decoded crops/s per core")
    parser.add_argument("--shard-mb", type=float, default=512, help="largest shard wanted")
    parser.add_argument("--checkpoint-minutes", type=float, default=30, help="training a crash may cost at most")
    args = parser.parse_args(argv)
    for name in ("rate", "images", "dataset_tb", "classes", "image_size", "batch_size", "decode_rate", "shard_mb", "checkpoint_minutes"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be > 0")
    if min(args.gpus) <= 0:
        parser.error(f"--gpus {args.gpus}: every count must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = Workload(args.images, args.dataset_tb * 1e12, vit_parameters(args.image_size, args.classes), args.rate,
                        args.batch_size, args.decode_rate, args.shard_mb * 1e6, args.checkpoint_minutes)
    shards = shard_count(workload.dataset_bytes, args.gpus, workload.shard_bytes)
    print(format_table(workload, [plan(workload, gpus, shards) for gpus in args.gpus], shards))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
