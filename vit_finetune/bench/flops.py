"""What is benchmarked and what it costs: the ViT shapes, and model FLOPs per training image from the config."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import ViTConfig

    from vit_finetune.recipe import LoraSettings


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The ViT shape benchmarked; `vit-b16-384` is ViT-B/16 with a Food-101-sized head."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    image_size: int
    num_labels: int

    def vit_config(self) -> ViTConfig:
        from transformers import ViTConfig

        fields = dataclasses.asdict(self)
        labels = {i: f"class_{i:03d}" for i in range(self.num_labels)}
        return ViTConfig(**fields, id2label=labels, label2id={v: k for k, v in labels.items()})


MODELS = {
    "vit-b16-384": ModelSpec(768, 12, 12, 3072, 16, 384, 101),
    "tiny": ModelSpec(64, 2, 2, 128, 8, 64, 4),
}


def vit_macs(config: ViTConfig) -> dict[str, int]:
    """Multiply-accumulates of one image's forward pass by kind: patch embedding, linear layers, attention, head."""
    patches = (config.image_size // config.patch_size) ** 2
    tokens = patches + 1  # the CLS token
    d, m = config.hidden_size, config.intermediate_size
    per_layer_linear = tokens * (3 * d * d + d * d + 2 * d * m)  # q, k, v, output projection, MLP in and out
    per_layer_attention = 2 * tokens * tokens * d  # Q K^T and A V over all heads
    return {
        "patch_embedding": patches * config.num_channels * config.patch_size**2 * d,
        "linear": config.num_hidden_layers * per_layer_linear,
        "attention": config.num_hidden_layers * per_layer_attention,
        "head": d * config.num_labels,  # only the CLS token is classified
    }


def lora_macs(config: ViTConfig, lora: LoraSettings) -> int:
    """Forward MACs the LoRA adapters add (x A then B, rank r) on the roles they wrap."""
    d, m = config.hidden_size, config.intermediate_size
    shapes = {"query": (d, d), "key": (d, d), "value": (d, d), "attention_output": (d, d),
              "mlp_in": (d, m), "mlp_out": (m, d)}
    tokens = (config.image_size // config.patch_size) ** 2 + 1
    per_layer = sum(lora.r * (shapes[role][0] + shapes[role][1]) for role in lora.target_modules)
    return config.num_hidden_layers * tokens * per_layer


def training_flops_per_image(config: ViTConfig, lora: LoraSettings | None = None) -> float:
    """Model FLOPs of one training image (2 FLOPs per MAC), forward plus backward.

    Full fine-tuning: backward is twice the forward (gradients for inputs and weights), 3x forward in all.
    LoRA: frozen linear layers need input gradients only and the patch embedding needs none; attention's
    activation products, the head and the adapters still cost 3x.
    """
    macs = vit_macs(config)
    if lora is None:
        return 2.0 * 3 * sum(macs.values())
    adapters = lora_macs(config, lora)
    total = macs["patch_embedding"] + 2 * macs["linear"] + 3 * (macs["attention"] + macs["head"] + adapters)
    return 2.0 * total
