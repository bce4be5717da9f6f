"""Model: load a pretrained ViT, move it to a new resolution once, give it a new head, optionally LoRA.

The position embeddings are resampled a single time at load (CLS kept aside, patch grid resized as a
2-D image in float32), so the saved model runs at its new size with plain `from_pretrained`, no
`interpolate_pos_encoding` flag, and nothing but the classifier is ever re-initialised.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoImageProcessor, PretrainedConfig, ViTConfig, ViTForImageClassification
from transformers.models.auto.image_processing_auto import (IMAGE_PROCESSOR_MAPPING_NAMES,
                                                            get_image_processor_class_from_name)

from .errors import VitFinetuneError
from .recipe import ASSETS_DIR, BUILTIN_PREFIX, LoraSettings, ModelSettings

# LoRA roles mapped to module-name suffixes under both transformers naming schemes:
# 5.x: vit.layers.N.attention.q_proj / mlp.fc1 ; 4.x: vit.encoder.layer.N.attention.attention.query / intermediate.dense
ROLE_SUFFIXES = {
    "query": (r"attention\.q_proj", r"attention\.attention\.query"),
    "key": (r"attention\.k_proj", r"attention\.attention\.key"),
    "value": (r"attention\.v_proj", r"attention\.attention\.value"),
    "attention_output": (r"attention\.o_proj", r"attention\.output\.dense"),
    "mlp_in": (r"mlp\.fc1", r"intermediate\.dense"),
    "mlp_out": (r"mlp\.fc2", r"layer\.\d+\.output\.dense"),
}
HEAD_NAME = "classifier"
# Families whose transformers config has a stochastic-depth rate (ViT and DeiT have none).
DROP_PATH_FAMILIES = ("beit", "data2vec-vision", "dinov2", "swin")
# The data pipeline decodes and crops with PIL, and torchvision is not required: evaluation and every later
# pipeline() use the PIL image processors, chosen by name, so transformers 5 does not fall back to them with a
# warning, and a machine with torchvision does not resize slightly differently from the one that measured.
IMAGE_PROCESSOR_BACKEND = "pil"


class ModelError(VitFinetuneError):
    """A base model that this toolkit cannot fine-tune as asked."""


def base_location(settings: ModelSettings) -> str:
    """The Hub id or folder to load: `builtin:NAME` names a model shipped in vit_finetune/assets."""
    if not settings.base.startswith(BUILTIN_PREFIX):
        return settings.base
    name = settings.base.removeprefix(BUILTIN_PREFIX)
    path = ASSETS_DIR / name
    if not (path / "config.json").is_file():
        shipped = sorted(p.name for p in ASSETS_DIR.iterdir() if (p / "config.json").is_file()) if ASSETS_DIR.is_dir() else []
        raise ModelError(f"model.base={settings.base!r}: no shipped model {name!r}; shipped: {shipped}")
    return str(path)


def load_base_config(settings: ModelSettings) -> ViTConfig:
    """Fetch only config.json and check the base is a ViT the target size suits, before any weights move."""
    location = base_location(settings)  # a ModelError of its own for an unknown builtin: name
    try:
        config = AutoConfig.from_pretrained(location, revision=settings.revision,
                                            trust_remote_code=settings.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ModelError(
            f"model.base={settings.base!r} could not be loaded: {error}\n"
            "Fix: give a Hub id such as google/vit-base-patch16-224 or a folder holding config.json."
        ) from None
    if config.model_type != "vit":
        raise ModelError(
            f"model.base={settings.base!r} is a {config.model_type!r} model, not a ViT; "
            "use a ViT checkpoint such as google/vit-base-patch16-224"
        )
    check_image_size(settings.image_size, config.patch_size)
    set_drop_path_rate(config, settings)  # a family without stochastic depth is refused before any download
    return config


def set_drop_path_rate(config: PretrainedConfig, settings: ModelSettings) -> None:
    """model.drop_path_rate (stochastic depth) into the config; null keeps the base's own rate."""
    if settings.drop_path_rate is None:
        return
    if not hasattr(config, "drop_path_rate"):
        raise ModelError(
            f"model.drop_path_rate={settings.drop_path_rate}: model.base={settings.base!r} is a {config.model_type!r} "
            f"model, whose config has no drop-path rate (stochastic depth). Families that have one: "
            f"{', '.join(DROP_PATH_FAMILIES)}. Set model.drop_path_rate=null"
        )
    config.drop_path_rate = settings.drop_path_rate


def check_image_size(image_size: int, patch_size: int) -> None:
    if image_size % patch_size:
        low, high = (image_size // patch_size) * patch_size, (image_size // patch_size + 1) * patch_size
        raise ModelError(
            f"model.image_size={image_size} is not a multiple of the patch size {patch_size}; "
            f"use {low or high} or {high}"
        )


def resample_position_embeddings(position_embeddings: torch.Tensor, new_grid: tuple[int, int]) -> torch.Tensor:
    """(1, 1 + h*w, D) -> (1, 1 + H*W, D): CLS untouched, the square patch grid resized bicubically in float32.

    Matches transformers' `interpolate_pos_encoding` when enlarging; antialiases when shrinking, where plain
    bicubic would alias. The same size returns an exact copy.
    """
    cls_embedding, patch_embeddings = position_embeddings[:, :1], position_embeddings[:, 1:]
    old_side = math.isqrt(patch_embeddings.shape[1])
    if old_side * old_side != patch_embeddings.shape[1]:
        raise ModelError(f"position embeddings hold {patch_embeddings.shape[1]} patches, not a square grid")
    if (old_side, old_side) == tuple(new_grid):
        return position_embeddings.detach().clone()
    dim = patch_embeddings.shape[-1]
    grid = patch_embeddings.reshape(1, old_side, old_side, dim).permute(0, 3, 1, 2).float()
    shrinking = new_grid[0] < old_side or new_grid[1] < old_side
    grid = F.interpolate(grid, size=new_grid, mode="bicubic", align_corners=False, antialias=shrinking)
    patch_embeddings = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim)
    return torch.cat([cls_embedding.float(), patch_embeddings], dim=1).to(position_embeddings.dtype)


def load_pretrained(settings: ModelSettings) -> ViTForImageClassification:
    """The base checkpoint as it is, failing loudly if anything but the classifier was missing or reshaped."""
    model, info = ViTForImageClassification.from_pretrained(
        base_location(settings),
        revision=settings.revision,
        trust_remote_code=settings.trust_remote_code,
        dtype=torch.float32,  # master weights stay float32; mixed precision is autocast's job
        output_loading_info=True,
    )
    reinitialised = [
        key
        for key in [*info.get("missing_keys", []), *[m[0] if isinstance(m, tuple) else m for m in info.get("mismatched_keys", [])]]
        if not key.startswith(HEAD_NAME)
    ]
    if reinitialised:
        raise ModelError(
            f"model.base={settings.base!r}: these weights would be re-initialised instead of loaded: "
            f"{sorted(reinitialised)[:8]}{' ...' if len(reinitialised) > 8 else ''}. "
            "The checkpoint does not match a ViT layout; check the id or revision."
        )
    return model


def target_config(base_config: PretrainedConfig, settings: ModelSettings, labels: list[str]) -> ViTConfig:
    """The base architecture at the target resolution with a head for `labels`."""
    config: ViTConfig = ViTConfig.from_dict(base_config.to_dict())
    check_image_size(settings.image_size, config.patch_size)
    config.image_size = settings.image_size
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: index for index, label in enumerate(labels)}
    config.architectures = ["ViTForImageClassification"]
    set_drop_path_rate(config, settings)
    return config


def build_model(settings: ModelSettings, labels: list[str],
                on_resample: Callable[[torch.Tensor | None, torch.Tensor], None] | None = None) -> ViTForImageClassification:
    """Pretrained ViT at `settings.image_size` with a new head for `labels` (LoRA not yet applied).

    `on_resample(before, after)` receives the position table as loaded and as resampled (before is None for a
    model from random weights), e.g. to draw them.
    """
    if not settings.pretrained:
        model = ViTForImageClassification(target_config(load_base_config(settings), settings, labels)).float()
        if on_resample is not None:
            on_resample(None, model.vit.embeddings.position_embeddings.detach().clone())
        return model
    pretrained = load_pretrained(settings)
    config = target_config(pretrained.config, settings, labels)
    model = ViTForImageClassification(config).float()

    state = {k: v for k, v in pretrained.state_dict().items() if not k.startswith(HEAD_NAME)}
    grid_side = settings.image_size // config.patch_size
    key = "vit.embeddings.position_embeddings"
    before = state[key]
    state[key] = resample_position_embeddings(before, (grid_side, grid_side))
    if on_resample is not None:
        on_resample(before.detach().clone(), state[key].detach().clone())
    state.update(new_head_state(model.classifier, settings.head_init))
    model.load_state_dict(state, strict=True)  # strict: every tensor but the new head comes from the checkpoint
    return model


def new_head_state(head: nn.Linear, init: str) -> dict[str, torch.Tensor]:
    if init == "zero":
        return {f"{HEAD_NAME}.weight": torch.zeros_like(head.weight), f"{HEAD_NAME}.bias": torch.zeros_like(head.bias)}
    return {f"{HEAD_NAME}.weight": head.weight.detach().clone(), f"{HEAD_NAME}.bias": torch.zeros_like(head.bias)}


def lora_target_modules(model: nn.Module, roles: list[str]) -> list[str]:
    """Full names of the Linear modules that play `roles` in this model, whichever naming scheme it uses."""
    patterns = [re.compile(rf"(^|\.){suffix}$") for role in roles for suffix in ROLE_SUFFIXES[role]]
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(p.search(name) for p in patterns)
    ]
    if not names:
        raise ModelError(f"model.lora.target_modules={roles} matched no Linear module in this model")
    return names


def apply_lora(model: nn.Module, settings: LoraSettings):
    """Wrap with peft LoRA on the chosen roles; the new head trains fully and is saved with the adapter."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=lora_target_modules(model, settings.target_modules),
        modules_to_save=[HEAD_NAME],
    )
    return get_peft_model(model, config)


def load_image_processor(settings: ModelSettings, image_size: int):
    """The base's image processor, PIL backend, resized to the target resolution (mean/std kept from the base)."""
    location = base_location(settings)
    try:
        processor = AutoImageProcessor.from_pretrained(location, revision=settings.revision,
                                                       trust_remote_code=settings.trust_remote_code,
                                                       backend=IMAGE_PROCESSOR_BACKEND)
    except OSError:  # the base has no preprocessor_config.json: its family's defaults (ViT: mean = std = 0.5)
        config = AutoConfig.from_pretrained(location, revision=settings.revision,
                                            trust_remote_code=settings.trust_remote_code)
        family = IMAGE_PROCESSOR_MAPPING_NAMES[config.model_type]
        processor = get_image_processor_class_from_name(family[IMAGE_PROCESSOR_BACKEND])()
    processor.size = {"height": image_size, "width": image_size}
    if getattr(processor, "crop_size", None):
        processor.crop_size = {"height": image_size, "width": image_size}
    return processor


def count_parameters(model: nn.Module) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def merged_copy(model: nn.Module) -> ViTForImageClassification:
    """A plain transformers model with LoRA folded into the weights (the adapter model is left intact)."""
    import copy

    return copy.deepcopy(model).merge_and_unload()


def describe(config: PretrainedConfig) -> str:
    grid = config.image_size // config.patch_size
    return f"ViT {config.hidden_size}d x {config.num_hidden_layers} layers, patch {config.patch_size}, {config.image_size}px ({grid}x{grid} grid)"
