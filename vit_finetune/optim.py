"""Optimiser parameter groups: no weight decay on biases, norms and embeddings, and layer-wise lr decay.

Layer-wise lr decay (BEiT, MAE) trains the blocks near the input less than those near the head:
a parameter at depth d gets lr × decay^(L + 1 − d), where the embeddings have depth 0, block i (from 0)
depth i + 1, and the final norm and the head depth L + 1 (so they train at the full lr). A LoRA adapter
takes the depth of the block it sits in. Each family says which block a parameter is in (families.py). Each group carries its `lr_scale`; the scheduler scales every
group by the same factor.
"""

from __future__ import annotations

import re
from typing import Callable

from torch import nn

from .families import NO_WEIGHT_DECAY


BlockIndex = Callable[[str], "int | None"]  # parameter name -> its block's index from 0, None outside the blocks
# What comes before the first block, in every family: patch and position embeddings, CLIP's pre-norm.
BEFORE_BLOCKS = re.compile(r"(?:^|\.)(?:embeddings|pre_layrnorm)\.")


def layer_depth(name: str, block_index: BlockIndex, num_blocks: int) -> int:
    """0 for the embeddings, i + 1 for a parameter of block i, num_blocks + 1 for everything after the blocks."""
    block = block_index(name)
    if block is not None:
        return block + 1
    return 0 if BEFORE_BLOCKS.search(name) else num_blocks + 1


def is_decayed(name: str, parameter: nn.Parameter) -> bool:
    """Weight decay on matrices only: not on biases, norms, tokens or position tables (families.NO_WEIGHT_DECAY)."""
    return parameter.ndim >= 2 and parameter.shape[:2] != (1, 1) and not NO_WEIGHT_DECAY.search(name)


def parameter_groups(model: nn.Module, weight_decay: float, layer_decay: float | None,
                     block_index: BlockIndex | None = None, num_blocks: int = 0) -> list[dict]:
    """Trainable parameters grouped by (lr scale, weight decay). Without layer decay: the decayed group, then the
    rest (always both, as before). With it (and the model's block_index and num_blocks): one pair per depth, the
    head's first, empty groups left out."""
    groups: dict[tuple[int, bool], dict] = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        depth = layer_depth(name, block_index, num_blocks) if layer_decay is not None else 0
        scale = layer_decay ** (num_blocks + 1 - depth) if layer_decay is not None else 1.0
        decayed = is_decayed(name, parameter)
        groups.setdefault((depth, decayed), _group(scale, decayed, weight_decay))["params"].append(parameter)
    if layer_decay is None:
        for decayed in (True, False):
            groups.setdefault((0, decayed), _group(1.0, decayed, weight_decay))
    # Deepest first, decayed before not: the head's group leads, and the loop logs its lr as the run's lr.
    return [groups[key] for key in sorted(groups, key=lambda key: (-key[0], not key[1]))]


def _group(lr_scale: float, decayed: bool, weight_decay: float) -> dict:
    # `decayed` and `lr_scale` travel in the optimizer's state, so a resume can re-apply a changed lr or weight decay.
    return {"params": [], "weight_decay": weight_decay if decayed else 0.0, "decayed": decayed, "lr_scale": lr_scale}
