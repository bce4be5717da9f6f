"""The "Beyond one machine" arithmetic (vit_finetune.bench.scale) against real objects: a real checkpoint's size,
the published ViT-B/16 parameter count, and how datasets really splits shards across ranks."""

from __future__ import annotations

import math

import pytest
import torch

from vit_finetune.bench.scale import checkpoint_bytes, shard_count, vit_parameters
from vit_finetune.core.processes import reset_accelerate_state


def test_the_parameter_count_is_vit_b16s_published_one():
    assert vit_parameters(224, 1000) == 86_567_656  # reference: timm / google/vit-base-patch16-224
    assert vit_parameters(384, 1000) - vit_parameters(224, 1000) == (577 - 197) * 768  # the longer position table


def test_checkpoint_size_matches_what_accelerate_writes_for_adamw(tmp_path):
    from accelerate import Accelerator
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                                intermediate_size=128, image_size=32, patch_size=8, num_labels=5))
    accelerator = Accelerator(cpu=True)
    try:
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        model(pixel_values=torch.randn(2, 3, 32, 32)).logits.sum().backward()
        optimizer.step()  # AdamW's moments exist only after a step
        accelerator.save_state(str(tmp_path), safe_serialization=True)
    finally:
        reset_accelerate_state()
    written = (tmp_path / "model.safetensors").stat().st_size + (tmp_path / "optimizer.bin").stat().st_size
    parameters = sum(p.numel() for p in model.parameters())
    assert written == pytest.approx(checkpoint_bytes(parameters), rel=0.05)  # headers and pickling are the rest
    assert written > checkpoint_bytes(parameters)


def test_shard_count_divides_evenly_for_every_gpu_count_and_is_the_fewest_that_fit():
    dataset, largest = 1.31e12, 512e6
    shards = shard_count(dataset, [8, 24, 64], largest)
    assert all(shards % gpus == 0 for gpus in (8, 24, 64))
    assert dataset / shards <= largest < dataset / (shards - math.lcm(8, 24, 64))


@pytest.mark.parametrize("shards, whole_shards", [(8, True), (6, False)])
def test_datasets_gives_each_rank_whole_shards_only_when_they_divide_evenly(shards, whole_shards):
    """Why shard_count wants even division: otherwise every rank reads every shard and keeps 1 row in world_size."""
    from datasets import IterableDataset
    from datasets.distributed import split_dataset_by_node

    def rows(shard_ids):
        for shard in shard_ids:
            for row in range(3):
                yield {"shard": shard, "row": row}

    stream = IterableDataset.from_generator(rows, gen_kwargs={"shard_ids": list(range(shards))})
    ranks = [split_dataset_by_node(stream, rank=rank, world_size=4) for rank in range(4)]
    seen = [[(r["shard"], r["row"]) for r in rank] for rank in ranks]
    assert sorted(sum(seen, [])) == [(s, r) for s in range(shards) for r in range(3)]  # disjoint, all rows
    shards_per_rank = [{shard for shard, _ in rank} for rank in seen]
    if whole_shards:
        assert all(len(rank) == shards // 4 for rank in shards_per_rank) and ranks[0].n_shards == shards // 4
    else:
        assert all(len(rank) > shards / 4 for rank in shards_per_rank)  # each rank opened most shards
