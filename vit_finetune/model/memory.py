"""Memory: estimate what a training step needs at the recipe's size and batch, and refuse what cannot fit.

Checked from the base's config alone, before any weights load: `model.image_size=4096` on ViT-B/16 would
otherwise run for minutes and die in the first forward, and 100000 in the allocator with a raw traceback.
The estimate is deliberately rough (what the backward pass keeps per layer), so it only refuses runs that
are over the device's whole memory, not ones that are merely tight. A refusal suggests a size or batch that
fits in memory and also trains in reasonable time here: attention grows with the square of the tokens, so the
largest size that fits can take many minutes a step on a CPU. Each suggestion says what it costs.
"""

from __future__ import annotations

import os
import time

import torch

from vit_finetune.model.precision import resolved
from vit_finetune.recipe import Recipe

# Per layer and token, the backward keeps about: the two LayerNorm inputs, q, k, v, the attention output and its
# projection (7 x hidden), the MLP's input to the activation and its output (2 x intermediate), and the residual.
ACTIVATIONS_PER_TOKEN_AND_LAYER = (8, 2)  # (x hidden_size, x intermediate_size)
BYTES_PER_PARAMETER = 16  # fp32 weights, gradients and AdamW's two moments
# A suggested fix must fit in memory and take at most this long a step, estimated from the device's measured
# matrix-product speed (a lower bound: a real step has more than matrix products).
SUGGESTED_STEP_SECONDS = 60
# Past this, one forward and backward pass is warned of before training: a stop (Ctrl-C, SIGTERM) is heard only
# between passes, so the first one waits this long.
UNINTERRUPTIBLE_PASS_SECONDS = 120
# No device multiplies slower than this: a pass estimated quick at this speed is quick anywhere, and the device's
# speed is then not measured (0.2 s a run).
SLOWEST_FLOPS_PER_S = 1e9
MATMUL_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def step_flops(config, image_size: int, batch_size: int) -> float:
    """Floating-point operations of one training step: the blocks' matrix products and attention, forward (2 per
    multiply-add) and backward (twice the forward)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    intermediate = getattr(config, "intermediate_size", 4 * hidden)
    tokens = tokens_per_image(image_size, config.patch_size)
    multiply_adds = layers * (tokens * (4 * hidden ** 2 + 2 * hidden * intermediate) + 2 * tokens ** 2 * hidden)
    return 6.0 * multiply_adds * batch_size


def measured_flops_per_s(device: torch.device, mixed_precision: str, seconds: float = 0.2) -> float:
    """The device's matrix-product speed in the run's precision, timed here for about `seconds`."""
    dtype = MATMUL_DTYPES[mixed_precision]
    try:
        a = torch.randn(512, 512, device=device).to(dtype)
        a @ a  # warm-up: the first product pays for kernel selection
    except RuntimeError:  # no such kernel on this device: float32's speed
        a = torch.randn(512, 512, device=device)
    products, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(4):
            a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        products += 4
    return products * 2 * 512 ** 3 / (time.perf_counter() - started)


def available_bytes(device: torch.device) -> tuple[int, str]:
    """The device's whole memory and its name: a CUDA device's, or on CPU the machine's physical RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{torch.cuda.get_device_name(device)} memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical RAM"


def why_it_cannot_fit(config, recipe: Recipe, device: torch.device) -> str | None:
    """None if a training step fits the device; else the estimate and a size or batch that would fit, in memory
    and in time, each with what it costs."""
    size, batch = recipe.model.image_size, recipe.train.batch_size
    precision = resolved(recipe.train.mixed_precision, device.type)
    needed = training_bytes(config, size, batch, precision)
    available, where = available_bytes(device)
    if needed <= available:
        return None
    speed = measured_flops_per_s(device, precision)

    def fits(s: int, b: int) -> bool:
        return training_bytes(config, s, b, precision) <= available

    def quick(s: int, b: int) -> bool:
        return step_flops(config, s, b) / speed <= SUGGESTED_STEP_SECONDS

    def cost(s: int, b: int) -> str:
        return (f"about {gib(training_bytes(config, s, b, precision))} and at least "
                f"{duration(step_flops(config, s, b) / speed)} a step here")

    patch = config.patch_size
    sizes = smaller_sizes(size, patch)
    batches = [b for b in (batch // 2 ** k for k in range(1, 64)) if b >= 1]
    fitting_sizes = [s for s in sizes if s < size and fits(s, batch)]
    fitting_batches = [b for b in batches if fits(size, b)]
    # The largest that also trains in reasonable time; else the largest that fits, its time said plainly.
    fitting_size = next((s for s in fitting_sizes if quick(s, batch)), fitting_sizes[0] if fitting_sizes else None)
    fitting_batch = next((b for b in fitting_batches if quick(size, b)), fitting_batches[0] if fitting_batches else None)
    fixes = [f"model.image_size={fitting_size} ({cost(fitting_size, batch)})" if fitting_size else None,
             f"train.batch_size={fitting_batch} (with train.grad_accum to keep the effective batch; "
             f"{cost(size, fitting_batch)})" if fitting_batch else None]
    fix = " or ".join(f for f in fixes if f) or "a smaller model.base"
    return (
        f"model.image_size={size} with train.batch_size={batch} needs about {gib(needed)} for one training step "
        f"({tokens_per_image(size, patch):,} tokens per image x {config.num_hidden_layers} layers), more than the "
        f"{gib(available)} of {where}. Fix: {fix}"
    )


def smaller_sizes(size: int, patch: int) -> list[int]:
    """The image sizes a fix may suggest below `size`, largest first: each patch size down, or powers of two."""
    return [s for s in (range(size - patch, 0, -patch) if size < 64 * patch else (patch * 2 ** k for k in range(12, 0, -1)))
            if s < size]


def why_a_pass_is_slow(config, recipe: Recipe, device: torch.device) -> str | None:
    """None if one training pass of train.batch_size images is estimated to take under UNINTERRUPTIBLE_PASS_SECONDS
    here; else a warning with the estimate and what trains in reasonable time."""
    size, batch = recipe.model.image_size, recipe.train.batch_size
    if step_flops(config, size, batch) / SLOWEST_FLOPS_PER_S <= UNINTERRUPTIBLE_PASS_SECONDS:
        return None
    speed = measured_flops_per_s(device, resolved(recipe.train.mixed_precision, device.type))
    return slow_pass_warning(config, size, batch, recipe.train.grad_accum, speed)


def slow_pass_warning(config, size: int, batch: int, grad_accum: int, flops_per_s: float) -> str | None:
    """why_a_pass_is_slow at a device speed of `flops_per_s`."""
    def seconds(s: int, b: int) -> float:
        return step_flops(config, s, b) / flops_per_s

    if seconds(size, batch) <= UNINTERRUPTIBLE_PASS_SECONDS:
        return None
    patch = config.patch_size
    quick_size = next((s for s in smaller_sizes(size, patch) if seconds(s, batch) <= SUGGESTED_STEP_SECONDS), None)
    quick_batch = next((b for b in (batch // 2 ** k for k in range(1, 64)) if b >= 1
                        and seconds(size, b) <= SUGGESTED_STEP_SECONDS), None)
    fixes = [f"model.image_size={quick_size} (at least {duration(seconds(quick_size, batch))} a pass here)"
             if quick_size else None,
             f"train.batch_size={quick_batch} with train.grad_accum={grad_accum * (batch // quick_batch)} (the same "
             f"images a step, a stop heard between passes of at least {duration(seconds(size, quick_batch))})"
             if quick_batch else None,
             "a faster device"]
    return (f"warning: model.image_size={size} with train.batch_size={batch} takes at least "
            f"{duration(seconds(size, batch))} a forward and backward pass here ({tokens_per_image(size, patch):,} "
            f"tokens per image, {flops_per_s / 1e9:,.0f} GFLOP/s measured), and a stop (Ctrl-C, SIGTERM) waits for "
            "the pass to end; a second one ends the process at once, without a checkpoint. Fix: "
            + " or ".join(f for f in fixes if f))


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def gib(count: int) -> str:
    return f"{count / 2 ** 30:,.1f} GiB"
