"""The ViT family: one entry per transformers `model_type` says everything the toolkit needs to know about it.

An entry names the class that is fine-tuned, where the image and patch size live in the config, every tensor
that carries position and how it moves to a new resolution, the module names of the LoRA roles, the head, and
the block depth of a parameter (for layer-wise lr decay). Supporting a new family is adding one entry here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import transformers
from transformers import PretrainedConfig

from vit_finetune.model.positions import Antialias, resample_position_embeddings, resize_relative_bias_table


@dataclass(frozen=True)
class Geometry:
    """Patch grid and attention window of the base checkpoint and of the target model."""

    old_grid: tuple[int, int]
    new_grid: tuple[int, int]
    old_window: int | None = None
    new_window: int | None = None


State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class AbsoluteTable:
    """A learned absolute table, (1, P + N, D) Parameter or (P + N, D) nn.Embedding weight; P prefix rows kept."""

    suffix: str  # the state-dict key ends with this; absent from the checkpoint = the model does not use one
    prefix_rows: int  # CLS (1), CLS + distillation (2), none (SigLIP, Swin); registers carry no position
    antialias: Antialias = "when_shrinking"

    def __call__(self, state: State, geometry: Geometry) -> None:
        for key in [k for k in state if k.endswith(self.suffix)]:
            state[key] = resample_position_embeddings(state[key], geometry.new_grid, self.prefix_rows, self.antialias)


@dataclass(frozen=True)
class PatchGridBiasTables:
    """BEiT/Data2Vec relative position bias, per layer or shared: sized by the patch grid, 3 CLS rows at the end."""

    suffix: str = "relative_position_bias_table"

    def __call__(self, state: State, geometry: Geometry) -> None:
        for key in [k for k in state if k.endswith(self.suffix)]:
            state[key] = resize_relative_bias_table(state[key], 2 * geometry.new_grid[0] - 1, "bilinear", extra_rows=3)


@dataclass(frozen=True)
class WindowBiasTables:
    """Swin relative position bias: sized by the attention window, so resized only when the window changes."""

    suffix: str = "relative_position_bias_table"

    def __call__(self, state: State, geometry: Geometry) -> None:
        if geometry.new_window == geometry.old_window:
            return
        for key in [k for k in state if k.endswith(self.suffix)]:
            state[key] = resize_relative_bias_table(state[key], 2 * geometry.new_window - 1, "bicubic")


# LoRA roles -> regexes matched at the end of module names. The leading `\d+\.` anchors them inside a numbered
# block, so e.g. SigLIP's pooling head (vision_model.head.mlp.fc1) is never adapted as an MLP.
TRANSFORMERS5_ROLES = {  # ViT, DeiT, BEiT, DINOv2, Swin as transformers 5.x names them: vit.layers.N.attention.q_proj
    "query": (r"\d+\.attention\.q_proj",),
    "key": (r"\d+\.attention\.k_proj",),
    "value": (r"\d+\.attention\.v_proj",),
    "attention_output": (r"\d+\.attention\.o_proj",),
    "mlp_in": (r"\d+\.mlp\.fc1",),
    "mlp_out": (r"\d+\.mlp\.fc2",),
}
LEGACY_ROLES = {  # transformers 4.x names, kept in 5.x by Data2Vec-vision: encoder.layer.N.attention.attention.query
    "query": (r"\d+\.attention\.attention\.query",),
    "key": (r"\d+\.attention\.attention\.key",),
    "value": (r"\d+\.attention\.attention\.value",),
    "attention_output": (r"\d+\.attention\.output\.dense",),
    "mlp_in": (r"\d+\.intermediate\.dense",),
    "mlp_out": (r"\d+\.output\.dense",),  # the digit keeps attention.output.dense out
}
SWINV2_ROLES = {**LEGACY_ROLES, **{role: (rf"\d+\.attention\.self\.{role}",) for role in ("query", "key", "value")}}
CLIP_ROLES = {  # CLIP and SigLIP vision towers: vision_model.encoder.layers.N.self_attn.q_proj
    "query": (r"\d+\.self_attn\.q_proj",),
    "key": (r"\d+\.self_attn\.k_proj",),
    "value": (r"\d+\.self_attn\.v_proj",),
    "attention_output": (r"\d+\.self_attn\.out_proj",),
    "mlp_in": (r"\d+\.mlp\.fc1",),
    "mlp_out": (r"\d+\.mlp\.fc2",),
}
VIT_ROLES = {role: TRANSFORMERS5_ROLES[role] + LEGACY_ROLES[role] for role in TRANSFORMERS5_ROLES}

# A block of a one-stack family: group 1 is its 0-based index (layer decay reads it, model.keep_blocks renumbers it).
SEQUENTIAL_BLOCK = re.compile(r"(?:^|\.)layers?\.(\d+)\.")
_SWIN_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:blocks\.(\d+)|downsample)\.")


def sequential_block_index(name: str, config: PretrainedConfig) -> int | None:
    """0-based depth of the transformer block holding parameter `name`; None outside the blocks."""
    match = SEQUENTIAL_BLOCK.search(name)
    return int(match.group(1)) if match else None


def swin_block_index(name: str, config: PretrainedConfig) -> int | None:
    """Swin counts blocks across stages; a stage's patch merging sits at the depth of its last block."""
    match = _SWIN_BLOCK.search(name)
    if not match:
        return None
    stage = int(match.group(1))
    before = sum(config.depths[:stage])
    return before + int(match.group(2)) if match.group(2) is not None else before + config.depths[stage] - 1


def set_swin_window(config: PretrainedConfig, window: int) -> None:
    config.window_size = window


def set_swinv2_window(config: PretrainedConfig, window: int) -> None:
    """Swinv2 normalises its continuous position coordinates by the pretraining window; keep that scale."""
    config.pretrained_window_sizes = [size or config.window_size for size in config.pretrained_window_sizes]
    config.window_size = window


@dataclass(frozen=True)
class Family:
    """Everything the toolkit needs to move one transformers model_type to a new resolution and fine-tune it."""

    name: str  # shown to users
    classification_class: str  # the transformers class that is fine-tuned and saved
    backbone: str  # attribute of that class holding the encoder (its last_hidden_state is the invariant's subject)
    position: tuple[Callable[[State, Geometry], None], ...]  # each resizes the tensors it knows, in place
    resized: str  # what moves at a new resolution, in words (docs/families.md, errors)
    roles: dict[str, tuple[str, ...]] = field(default_factory=lambda: TRANSFORMERS5_ROLES)
    block_index: Callable[[str, PretrainedConfig], int | None] = sequential_block_index
    vision_config_key: str | None = None  # CLIP/SigLIP: image and patch size live in config.vision_config
    set_window: Callable[[PretrainedConfig, int], None] | None = None  # None: the family has no attention window
    head: str = "classifier"
    # Modules between backbone and head that a backbone-only checkpoint lacks (BEiT's mean-pooling norm after
    # masked-image pretraining): initialised fresh with the head, as timm does, instead of refusing the checkpoint.
    fresh_with_head: tuple[str, ...] = ()
    # A family with a distillation token (DeiT): the class a train.distill student is saved as, and its two heads
    # (the class token's, the distillation token's); None: the student keeps its one head.
    distilled_class: str | None = None
    distilled_heads: tuple[str, str] | None = None
    # One stack of blocks of the same width, numbered 0..N-1: a shallower model can keep any of them
    # (model.keep_blocks). Swin's blocks sit in stages that change width and resolution: no such cut.
    one_block_stack: bool = True
    # Why a compiled model cannot keep this family's attention out of the graph (compiling.py); None: its attention
    # goes through transformers' attention interface, which can.
    own_attention: str | None = None

    def new_modules(self) -> tuple[str, ...]:
        """Name prefixes of what may be newly initialised: the head, and what the family adds with it."""
        return (f"{self.head}.", *(f"{name}." for name in self.fresh_with_head))

    def position_keys(self, state: State) -> list[str]:
        """The keys of `state` that one of self.position resizes (its `suffix` ends them): the tensors a new size moves."""
        suffixes = tuple(resize.suffix for resize in self.position)
        return [key for key in state if suffixes and key.endswith(suffixes)]

    def model_class(self) -> type:
        return getattr(transformers, self.classification_class)

    def vision_config(self, config: PretrainedConfig) -> PretrainedConfig:
        return getattr(config, self.vision_config_key) if self.vision_config_key else config

    def image_size(self, config: PretrainedConfig) -> int:
        return _side(self.vision_config(config).image_size)

    def patch_size(self, config: PretrainedConfig) -> int:
        return _side(self.vision_config(config).patch_size)

    def set_image_size(self, config: PretrainedConfig, image_size: int) -> None:
        self.vision_config(config).image_size = image_size

    def window(self, config: PretrainedConfig) -> int | None:
        return config.window_size if self.set_window else None

    def num_blocks(self, config: PretrainedConfig) -> int:
        """How many transformer blocks `block_index` counts (block_index is in [0, num_blocks))."""
        vision = self.vision_config(config)
        return sum(vision.depths) if self.block_index is swin_block_index else vision.num_hidden_layers


def _side(size: int | list[int] | tuple[int, int]) -> int:
    return size if isinstance(size, int) else int(size[0])


def _vit_like(name: str, cls: str, backbone: str, prefix_rows: int, **extra) -> Family:
    return Family(name, cls, backbone, (AbsoluteTable("embeddings.position_embeddings", prefix_rows),),
                  f"absolute table resampled ({prefix_rows} prefix row{'s' * (prefix_rows > 1)} kept)", **extra)


_BEIT_POSITION = (AbsoluteTable("embeddings.position_embeddings", 1, antialias="never"), PatchGridBiasTables())
_BEIT_RESIZED = "relative position bias tables (per layer or shared) resized bilinearly, absolute table if used"
_DINOV2_RESIZED = "stored absolute table resampled as its forward does ({}), registers carry no position"

FAMILIES: dict[str, Family] = {
    "vit": _vit_like("ViT", "ViTForImageClassification", "vit", 1, roles=VIT_ROLES),
    "vit_msn": _vit_like("ViT-MSN", "ViTMSNForImageClassification", "vit", 1, roles=VIT_ROLES),
    # Distilled checkpoints (…WithTeacher) fine-tune as DeiTForImageClassification: the distillation token stays.
    "deit": _vit_like("DeiT", "DeiTForImageClassification", "deit", 2, roles=VIT_ROLES,
                      distilled_class="DeiTForImageClassificationWithTeacher",
                      distilled_heads=("cls_classifier", "distillation_classifier")),
    "beit": Family("BEiT", "BeitForImageClassification", "beit", _BEIT_POSITION, _BEIT_RESIZED,
                   fresh_with_head=("beit.pooler",)),
    "data2vec-vision": Family("Data2Vec-vision", "Data2VecVisionForImageClassification", "data2vec_vision",
                              _BEIT_POSITION, _BEIT_RESIZED, roles=LEGACY_ROLES,
                              fresh_with_head=("data2vec_vision.pooler",),
                              own_attention="calls PyTorch's attention itself, not through transformers' interface"),
    "dinov2": Family("DINOv2", "Dinov2ForImageClassification", "dinov2",
                     (AbsoluteTable("embeddings.position_embeddings", 1, antialias="never"),),
                     _DINOV2_RESIZED.format("bicubic, no antialias")),
    "dinov2_with_registers": Family(
        "DINOv2 with registers", "Dinov2WithRegistersForImageClassification", "dinov2_with_registers",
        (AbsoluteTable("embeddings.position_embeddings", 1, antialias="always"),),
        _DINOV2_RESIZED.format("bicubic, antialiased")),
    "swin": Family("Swin", "SwinForImageClassification", "swin",
                   (AbsoluteTable("embeddings.position_embeddings", 0), WindowBiasTables()),
                   "config size only (window kept); bias tables resized bicubically when model.window_size changes",
                   block_index=swin_block_index, set_window=set_swin_window, one_block_stack=False),
    "swinv2": Family("Swinv2", "Swinv2ForImageClassification", "swinv2", (),
                     "config size only: continuous position MLP, no tensor to resize",
                     roles=SWINV2_ROLES, block_index=swin_block_index, set_window=set_swinv2_window,
                     one_block_stack=False),
    "clip": Family("CLIP vision tower", "CLIPForImageClassification", "vision_model",
                   (AbsoluteTable("embeddings.position_embedding.weight", 1),),
                   "position nn.Embedding resampled (class row kept), vision_config.image_size",
                   roles=CLIP_ROLES, vision_config_key="vision_config"),
    "siglip": Family("SigLIP vision tower", "SiglipForImageClassification", "vision_model",
                     (AbsoluteTable("embeddings.position_embedding.weight", 0),),
                     "position nn.Embedding resampled (no class row), vision_config.image_size",
                     roles=CLIP_ROLES, vision_config_key="vision_config"),
}

# Parameters that carry position or stand for a token rather than a weight matrix: no weight decay (timm's
# no_weight_decay lists, across the family). Matched at the end of a parameter name.
NO_WEIGHT_DECAY = re.compile(
    r"(position_embeddings|position_embedding\.weight|relative_position_bias_table|continuous_position_bias_mlp\.\S+"
    r"|logit_scale|cls_token|class_embedding|distillation_token|register_tokens|mask_token)$"
)
