"""Optimiser parameter groups: no weight decay on biases, norms and embeddings, and layer-wise lr decay.

Layer-wise lr decay (BEiT, MAE) trains the blocks near the input less than those near the head:
a parameter at depth d gets lr × decay^(L + 1 − d), where the embeddings have depth 0, block i (from 0)
depth i + 1, and the final norm and the head depth L + 1 (so they train at the full lr). A LoRA adapter
takes the depth of the block it sits in. Each group carries its `lr_scale`; the scheduler scales every
group by the same factor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from .errors import VitFinetuneError


class LayerDecayError(VitFinetuneError):
    """train.layer_decay asked for a model whose block naming is not known."""


@dataclass(frozen=True)
class BlockNaming:
    """How a family names its transformer blocks and its embeddings in parameter names."""

    block: str  # a regex whose first group is the block's index, counting from 0
    embeddings: str  # a regex matching the parameters that come before the first block


# Keyed by config.model_type. The block index sits after `.layers.N.` (transformers 5) or
# `.encoder.layer.N.` (4.x); the prefix (vit., base_model.model.vit. under peft) does not matter.
BLOCK_NAMING = {
    "vit": BlockNaming(block=r"\.(?:layers|encoder\.layer)\.(\d+)\.", embeddings=r"(?:^|\.)embeddings\."),
}


def block_naming(model_type: str) -> BlockNaming:
    if model_type not in BLOCK_NAMING:
        raise LayerDecayError(f"train.layer_decay is not available for {model_type!r} models; it knows "
                              f"{sorted(BLOCK_NAMING)}. Set train.layer_decay=null")
    return BLOCK_NAMING[model_type]


def layer_depth(name: str, num_layers: int, naming: BlockNaming) -> int:
    """0 for the embeddings, i + 1 for a parameter of block i, num_layers + 1 for everything after the blocks."""
    block = re.search(naming.block, name)
    if block:
        return int(block.group(1)) + 1
    if re.search(naming.embeddings, name):
        return 0
    return num_layers + 1


def is_decayed(name: str, parameter: nn.Parameter) -> bool:
    """Weight decay on matrices only: not on biases, norms, the CLS token or the position embeddings."""
    return parameter.ndim >= 2 and parameter.shape[:2] != (1, 1) and not name.endswith("position_embeddings")


def parameter_groups(model: nn.Module, weight_decay: float, layer_decay: float | None) -> list[dict]:
    """Trainable parameters grouped by (lr scale, weight decay). Without layer decay: the decayed group, then the
    rest (always both, as before). With it: one pair per depth, the head's first, empty groups left out."""
    config = model.config
    naming = block_naming(config.model_type) if layer_decay is not None else None
    groups: dict[tuple[int, bool], dict] = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        depth = layer_depth(name, config.num_hidden_layers, naming) if naming else 0
        scale = layer_decay ** (config.num_hidden_layers + 1 - depth) if naming else 1.0
        decayed = is_decayed(name, parameter)
        groups.setdefault((depth, decayed), _group(scale, decayed, weight_decay))["params"].append(parameter)
    if naming is None:
        for decayed in (True, False):
            groups.setdefault((0, decayed), _group(1.0, decayed, weight_decay))
    # Deepest first, decayed before not: the head's group leads, and the loop logs its lr as the run's lr.
    return [groups[key] for key in sorted(groups, key=lambda key: (-key[0], not key[1]))]


def _group(lr_scale: float, decayed: bool, weight_decay: float) -> dict:
    # `decayed` and `lr_scale` travel in the optimizer's state, so a resume can re-apply a changed lr or weight decay.
    return {"params": [], "weight_decay": weight_decay if decayed else 0.0, "decayed": decayed, "lr_scale": lr_scale}
