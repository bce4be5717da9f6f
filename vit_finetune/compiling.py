"""torch.compile for training, with each attention call kept out of the compiled graph; and what `model.compile=auto`
chooses on each kind of device.

Why attention stays out: compiled whole, the model hands `F.scaled_dot_product_attention` to the compiler, which
picks its kernel while it traces and bakes that choice into the graph. On one H200 (2026-11-28, ViT-B/16 at 384 px,
bf16, batch 128, transformers 5.17) it picked PyTorch's math path: float32 matrix products and a separate softmax,
the attention probabilities of every layer kept for the backward (aten::bmm 32 % of the GPU's time, `_safe_softmax`
13 %, float32 GEMMs 20 %), 519 images/s and 48.7 GiB against eager's 903 and 27.7 GiB. Inductor does not fuse a
decomposed attention back into one kernel. The cause could not be reproduced on a CPU, where the same compile keeps
the fused op; so rather than trust whatever the compiler decides, the attention call is not given to it at all. On
the same card, compiled so, the step ran cuDNN's fused attention kernels forward and backward, at 1.12x eager's
images/s with 0.86x its memory (docs/performance.md).

How: transformers' models call attention through `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`. This module
registers one more entry, transformers' own SDPA function under `torch.compiler.disable`, and points the model's
config at it before compiling. Dynamo then breaks the graph at each attention call: the patch embedding, LayerNorms,
projections, MLP and residuals of every block are compiled (and fused) around it, while the attention itself runs
as in an eager model, through PyTorch's dispatcher, which picks the fused kernel (cuDNN, flash or memory-efficient
on a GPU, the flash kernel on a CPU) for the forward and its own backward. transformers leaves `_attn_implementation`
out of the saved config.json, so a saved model loads anywhere as an ordinary SDPA model.

Families whose attention does not go through that interface cannot be treated so (`Family.own_attention` says why);
compiled, their attention is traced with the rest, and the run says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .families import FAMILIES

# The name under which the kept-out attention is registered with transformers (a model's config points at it).
EAGER_SDPA = "sdpa_outside_compile"


@torch.compiler.disable
def sdpa_outside_compile(*args, **kwargs):
    """transformers' SDPA attention, run by the eager dispatcher even inside a compiled model."""
    return sdpa_attention_forward(*args, **kwargs)


AttentionInterface.register(EAGER_SDPA, sdpa_outside_compile)

# On a CUDA GPU the compile that keeps attention out trained faster than eager and in less memory (one H200,
# 2026-11-28, ViT-B/16 at 384 px, bf16, batch 128, end to end from JPEGs: 1,011 and 1,026 images/s against 902 and 914
# eager, 23.8 GiB against 27.6; docs/performance.md), and compiling took 12-17 s more before the first steps. At that
# gain a run makes the compile time back after about 150,000 training images; auto waits for twice that, since an
# evaluation compiles graphs of its own and other models and cards were not measured.
CUDA_COMPILE_PAYS_FROM_IMAGES = 300_000
CUDA_MEASURED = ("on a GPU the compile that keeps attention out trained ViT-B/16 at 384 px at 1.12x eager's images/s "
                 "with 0.86x its memory, after 12-17 s of compiling (H200, 2026-11-28; docs/performance.md)")
CPU_MEASURED = ("on a CPU the demo recipe trained in 287 s compiled against 232 s eager, compiling included (2 cores, "
                "2026-11-28; docs/performance.md)")


def auto_compile(device_type: str, sharded: bool, images_seen: int, processes: int,
                 attention_compiled: str | None = None) -> tuple[bool, str]:
    """What model.compile=auto chooses for a run of `images_seen` training images on `processes` processes of this
    device type, and why: on only where compiling was measured faster, for a run long enough to pay for it.
    `attention_compiled`: why the base's attention could not be kept out of the graph (why_attention_is_compiled)."""
    if sharded:
        return False, ("sharded weights: Accelerate compiles after sharding, when its config file has a dynamo_config "
                       "(docs/distributed.md)")
    if device_type == "cpu":
        return False, CPU_MEASURED
    if device_type != "cuda":
        return False, f"compiling was never measured on {device_type}"
    if attention_compiled is not None:
        return False, (f"{attention_compiled}, so compiled, its attention would be traced with the rest of the graph, "
                       "as in the one compile measured slower on a GPU (0.57x eager's images/s, H200; "
                       "docs/performance.md)")
    if processes > 1:
        return False, f"{CUDA_MEASURED}, on one process; {processes} processes were not measured compiled"
    if images_seen < CUDA_COMPILE_PAYS_FROM_IMAGES:
        return False, (f"{CUDA_MEASURED}: it pays for its compile time after about 150,000 training images, and this "
                       f"run sees {images_seen:,} (auto compiles from {CUDA_COMPILE_PAYS_FROM_IMAGES:,})")
    return True, f"{CUDA_MEASURED}, and this run sees {images_seen:,} training images, enough to pay for it"


def transformers_model(model: nn.Module) -> PreTrainedModel:
    """The outermost transformers model in `model` (under peft's wrappers, say)."""
    return next(module for module in model.modules() if isinstance(module, PreTrainedModel))


def why_attention_is_compiled(model: PreTrainedModel) -> str | None:
    """Why this model's attention cannot be kept out of the compiled graph; None when it can."""
    family = FAMILIES[model.config.model_type]
    if family.own_attention is not None:
        return f"{family.name} {family.own_attention}"
    vision = getattr(model.config, family.vision_config_key) if family.vision_config_key else model.config
    implementation = vision._attn_implementation
    if implementation not in ("sdpa", EAGER_SDPA):
        return f"the model's attention is {implementation!r}, not SDPA"
    return None


# torch.compile's backend for training (a test may swap it for one that skips code generation).
BACKEND = "inductor"


def compile_for_training(model: nn.Module, backend: str | Callable | None = None) -> tuple[nn.Module, str]:
    """torch.compile(model) with its attention left to the eager dispatcher where the family allows it; returns the
    compiled model and a sentence saying where attention runs. `backend`: torch.compile's, BACKEND unless given."""
    inner = transformers_model(model)
    why_not = why_attention_is_compiled(inner)
    if why_not is None:
        inner.set_attn_implementation(EAGER_SDPA)
        said = "attention runs outside the compiled graph, on PyTorch's fused SDPA kernels as in eager mode"
    else:
        said = (f"{why_not}, so its attention is compiled with the rest of the graph, and on a GPU the compiler may "
                "run it on PyTorch's slower float32 math path")
    return torch.compile(model, backend=backend or BACKEND), said
