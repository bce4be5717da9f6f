"""Memory: estimate what a training step needs at the recipe's size and batch, and refuse what cannot fit.

Checked from the base's config alone, before any weights load: `model.image_size=4096` on ViT-B/16 would
otherwise run for minutes and die in the first forward, and 100000 in the allocator with a raw traceback.
The estimate is deliberately rough (what the backward pass keeps per layer), so it only refuses runs that
are over the device's whole memory, not ones that are merely tight.
"""

from __future__ import annotations

import os

import torch

from .recipe import Recipe

# Per layer and token, the backward keeps about: the two LayerNorm inputs, q, k, v, the attention output and its
# projection (7 x hidden), the MLP's input to the activation and its output (2 x intermediate), and the residual.
ACTIVATIONS_PER_TOKEN_AND_LAYER = (8, 2)  # (x hidden_size, x intermediate_size)
BYTES_PER_PARAMETER = 16  # fp32 weights, gradients and AdamW's two moments


def tokens_per_image(image_size: int, patch_size: int) -> int:
    return (image_size // patch_size) ** 2 + 1  # the patches and CLS


def training_bytes(config, image_size: int, batch_size: int, mixed_precision: str) -> int:
    """Bytes one training step needs: activations kept for the backward, plus weights, gradients and optimiser."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, intermediate = config.num_attention_heads, getattr(config, "intermediate_size", 4 * hidden)
    element = 4 if mixed_precision == "no" else 2
    tokens = tokens_per_image(image_size, config.patch_size)
    per_layer = tokens * (ACTIVATIONS_PER_TOKEN_AND_LAYER[0] * hidden + ACTIVATIONS_PER_TOKEN_AND_LAYER[1] * intermediate)
    if getattr(config, "_attn_implementation", None) == "eager":  # scores and probabilities, tokens^2 per head
        per_layer += 2 * heads * tokens ** 2
    parameters = layers * (4 * hidden ** 2 + 2 * hidden * intermediate) + tokens * hidden
    return batch_size * layers * per_layer * element + parameters * BYTES_PER_PARAMETER


def available_bytes(device: torch.device) -> tuple[int, str]:
    """The device's whole memory and its name: a CUDA device's, or on CPU the machine's physical RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{torch.cuda.get_device_name(device)} memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical RAM"


def why_it_cannot_fit(config, recipe: Recipe, device: torch.device) -> str | None:
    """None if a training step fits the device; else the estimate and a size or batch that would fit."""
    size, batch, precision = recipe.model.image_size, recipe.train.batch_size, recipe.train.mixed_precision
    needed = training_bytes(config, size, batch, precision)
    available, where = available_bytes(device)
    if needed <= available:
        return None
    fitting_batch = next((b for b in (batch // 2 ** k for k in range(1, 64)) if b >= 1 and
                          training_bytes(config, size, b, precision) <= available), None)
    patch = config.patch_size
    sizes = range(size - patch, 0, -patch) if size < 64 * patch else (patch * 2 ** k for k in range(12, 0, -1))
    fitting_size = next((s for s in sizes if s < size and training_bytes(config, s, batch, precision) <= available), None)
    fixes = [f"model.image_size={fitting_size}" if fitting_size else None,
             f"train.batch_size={fitting_batch} (with train.grad_accum to keep the effective batch)" if fitting_batch else None]
    fix = " or ".join(f for f in fixes if f) or "a smaller model.base"
    return (
        f"model.image_size={size} with train.batch_size={batch} needs about {gib(needed)} for one training step "
        f"({tokens_per_image(size, patch):,} tokens per image x {config.num_hidden_layers} layers), more than the "
        f"{gib(available)} of {where}. Fix: {fix}"
    )


def gib(count: int) -> str:
    return f"{count / 2 ** 30:,.1f} GiB"
