"""LoRA: which Linear modules of a family's model an adapter wraps, the adapter put on (the new head trained whole and
saved beside it), and the adapter folded back into a plain model for saving and export.
"""

from __future__ import annotations

import copy
import re

from torch import nn
from transformers import PreTrainedModel

from vit_finetune.model.families import Family
from vit_finetune.model.loading import ModelError, family_of, head_names
from vit_finetune.recipe import LoraSettings


def lora_target_modules(model: nn.Module, roles: list[str], family: Family) -> list[str]:
    """Full names of the Linear modules that play `roles` in this model, in the family's own naming."""
    patterns = [re.compile(rf"(^|\.){pattern}$") for role in roles for pattern in family.roles[role]]
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(p.search(name) for p in patterns)
    ]
    if not names:
        raise ModelError(f"model.lora.target_modules={roles} matched no Linear module in this {family.name} model")
    return names


def apply_lora(model: PreTrainedModel, settings: LoraSettings):
    """Wrap with peft LoRA on the chosen roles; the new head trains fully and is saved with the adapter."""
    from peft import LoraConfig, get_peft_model

    family = family_of(model.config)
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=lora_target_modules(model, settings.target_modules, family),
        modules_to_save=list(head_names(model)),
    )
    return get_peft_model(model, config)


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def merged_copy(model: nn.Module) -> PreTrainedModel:
    """A plain transformers model with LoRA folded into the weights (the adapter model is left intact)."""
    return copy.deepcopy(model).merge_and_unload()
