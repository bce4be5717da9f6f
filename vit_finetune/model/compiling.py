"""torch.compile for training, with each attention call kept out of the compiled graph, the whole model or one
region per repeated block, its compiled code cached for the next run; and what `model.compile=auto` chooses, from
what compiling was measured to cost and to gain.

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

Two ways to compile (model.compile): `true` compiles the whole model; `regional` compiles each block of the model's
repeated stack of blocks in place (PyTorch's regional compilation): the blocks share one compiled code, so compiling
costs about one block's tracing however deep the model, and the embeddings and head around them stay eager. Either
way inductor's compiled code is cached on disk (COMPILE_CACHE), and a second run of the same model reads it back.

Families whose attention does not go through that interface cannot be treated so (`Family.own_attention` says why);
compiled, their attention is traced with the rest, and the run says so.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vit_finetune.data import cache_dir
from vit_finetune.model.families import FAMILIES

# The name under which the kept-out attention is registered with transformers (a model's config points at it).
EAGER_SDPA = "sdpa_outside_compile"
# Every attention registered to run outside a compiled graph: a model already pointed at one keeps it.
KEPT_OUT: set[str] = set()


def keep_out_of_compile(name: str, attention: Callable) -> Callable:
    """Register `attention` (transformers' attention signature) with transformers under `name`, run by the eager
    dispatcher even inside a compiled model; returns it so wrapped."""
    kept_out = torch.compiler.disable(attention)
    AttentionInterface.register(name, kept_out)
    KEPT_OUT.add(name)
    return kept_out


sdpa_outside_compile = keep_out_of_compile(EAGER_SDPA, sdpa_attention_forward)

Mode = Literal["whole", "regional"]
# model.compile's values that compile, and how (model.compile=false and a resolved auto of false do not).
MODES: dict[bool | str, Mode] = {True: "whole", "regional": "regional"}
# Where inductor keeps the compiled code unless TORCHINDUCTOR_CACHE_DIR says otherwise: under the toolkit's own
# cache, not in /tmp (PyTorch's default), which a reboot empties.
COMPILE_CACHE = "torch_compile"


@dataclasses.dataclass(frozen=True)
class CompileCost:
    """One measurement of a compile mode against eager on one kind of device: what auto's rule reads."""

    measured: str  # where and on what, in words: the card, model, precision, batch, date
    compile_seconds: float  # before the first steps, the compile cache cold (the larger figure measured)
    speedup: float  # compiled images/s over eager's, on the same steps
    eager_images_per_s: float  # the measured model's eager rate: a run of another model is scaled by its work
    work_per_image: float  # the measured model's (work_per_image)
    memory: float  # compiled peak memory over eager's


# ViT-B/16 at 384 px (work_per_image): 86,090,496 parameters in the backbone, a 24x24 patch grid.
VIT_B16_384_WORK = 86_090_496 * 576

# What compiling was measured to cost and gain, per (device type, mode); a mode not here is not chosen by auto there.
MEASURED: dict[tuple[str, Mode], CompileCost] = {
    # End to end from JPEGs, one H200, 2026-11-28 (docs/performance.md): 1,011 and 1,026 images/s compiled against
    # 902 and 914 eager, 23.8 GiB against 27.6; the first steps came 12-17 s later than eager's, the cache cold.
    ("cuda", "whole"): CompileCost("H200, ViT-B/16 at 384 px, bf16, batch 128, 2026-11-28", 17.0, 1.12, 902.0,
                                   VIT_B16_384_WORK, 0.86),
}
# A run waits for twice the images that pay back the compile: an evaluation compiles graphs of its own, and the
# other models and cards are an estimate from one measurement.
PAYBACK_MARGIN = 2.0
CPU_MEASURED = ("on a CPU the demo recipe trained in 287 s compiled against 232 s eager, compiling included (2 cores, "
                "2026-11-28; docs/performance.md)")
MEASURES_IT = "python -m vit_finetune.bench.compile_cost measures it"


@dataclasses.dataclass(frozen=True)
class CompileFacts:
    """What auto's rule reads of the base: why its attention would be traced with the rest (None: it is kept out),
    and its work per image (work_per_image; None: not estimated for this family)."""

    attention_compiled: str | None = None
    work_per_image: float | None = None


def work_per_image(model: PreTrainedModel, image_size: int) -> float | None:
    """The backbone's parameters times the patches of one image: the multiply-adds of its linear layers, most of a
    ViT's step, so the measure by which a run's eager rate is scaled from the measured model's. None for a family
    whose blocks do not all see every patch (Swin's stages merge them)."""
    family = FAMILIES[model.config.model_type]
    if not family.one_block_stack:
        return None
    parameters = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(f"{family.head}."))
    return float(parameters * (image_size // family.patch_size(model.config)) ** 2)


def facts_of(model: PreTrainedModel, image_size: int) -> CompileFacts:
    """The base's facts for auto's rule (the base may sit on the meta device: only its shapes are read)."""
    return CompileFacts(why_attention_is_compiled(model), work_per_image(model, image_size))


def seconds_saved_per_image(cost: CompileCost, work: float) -> float:
    """Training seconds one image saves compiled, on a base of this work per image: eager's rate is the measured
    model's, scaled by the work."""
    eager_rate = cost.eager_images_per_s * cost.work_per_image / work
    return (1 - 1 / cost.speedup) / eager_rate


def auto_compile(device_type: str, sharded: bool, images_seen: int, processes: int,
                 facts: CompileFacts = CompileFacts()) -> tuple[bool | str, str]:
    """What model.compile=auto chooses for a run of `images_seen` training images on `processes` processes of this
    device type, and why: of the modes measured there (MEASURED), the one that saves this run the most time once
    its compile is paid PAYBACK_MARGIN times over; false where none was measured, or none pays so."""
    if sharded:
        return False, ("sharded weights: Accelerate compiles after sharding, when its config file has a dynamo_config "
                       "(docs/distributed.md)")
    if device_type == "cpu":
        return False, CPU_MEASURED
    costs = {mode: cost for (kind, mode), cost in MEASURED.items() if kind == device_type}
    if not costs:
        return False, f"compiling was never measured on {device_type}"
    if facts.attention_compiled is not None:
        return False, (f"{facts.attention_compiled}, so compiled, its attention would be traced with the rest of the "
                       "graph, as in the one compile measured slower on a GPU (0.57x eager's images/s, H200; "
                       "docs/performance.md)")
    measured = "; ".join(f"on a GPU {said_of(mode, cost)}" for mode, cost in costs.items())
    unmeasured = [mode for mode in MODES.values() if mode not in costs]
    if unmeasured:
        measured += f"; {' and '.join(unmeasured)} compilation not measured on {device_type} ({MEASURES_IT})"
    if processes > 1:
        return False, f"{measured}, on one process; {processes} processes were not measured compiled"
    if facts.work_per_image is None:
        return False, f"{measured}; this base's work per image is not estimated (its stages merge patches)"
    per_image = {mode: seconds_saved_per_image(cost, facts.work_per_image) for mode, cost in costs.items()}
    net = {mode: images_seen * per_image[mode] - PAYBACK_MARGIN * costs[mode].compile_seconds for mode in costs}
    mode = max(net, key=net.get)
    pays_back = costs[mode].compile_seconds / per_image[mode]
    enough = (f"{PAYBACK_MARGIN:g}x the {rounded(pays_back)} training images that pay it back on this base "
              f"({rounded(PAYBACK_MARGIN * pays_back)}; an evaluation compiles graphs of its own)")
    if net[mode] <= 0:
        return False, f"{measured}: auto compiles from {enough}, and this run sees {images_seen:,}"
    saved = images_seen * per_image[mode] - costs[mode].compile_seconds
    return (True if mode == "whole" else mode), (f"{measured}: this run sees {images_seen:,} training images, more "
                                                 f"than {enough}; estimated to save {saved:,.0f} s")


def rounded(images: float) -> str:
    """An image count estimated from measured rates, to the thousand: more digits would claim a precision it lacks."""
    return f"{round(images, -3):,.0f}"


MODE_WORDS: dict[Mode, str] = {
    "whole": "the whole model compiled (attention kept out)",
    "regional": "each block compiled (regional compilation, attention kept out)",
}


def said_of(mode: Mode, cost: CompileCost) -> str:
    return (f"{MODE_WORDS[mode]} trained at {cost.speedup:g}x eager's images/s with {cost.memory:g}x its memory, after "
            f"{cost.compile_seconds:g} s of compiling ({cost.measured}; docs/performance.md)")


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
    if implementation != "sdpa" and implementation not in KEPT_OUT:
        return f"the model's attention is {implementation!r}, not SDPA"
    return None


# torch.compile's backend for training (a test may swap it for one that skips code generation).
BACKEND = "inductor"


def use_compile_cache() -> str:
    """Where inductor caches compiled code: TORCHINDUCTOR_CACHE_DIR if the user set it, else COMPILE_CACHE under the
    toolkit's cache, set for this process (and the compile workers it starts) before anything is compiled. torch
    itself writes its default (/tmp/torchinductor_USER) into the variable once transformers is imported, so that
    value is not taken for the user's choice."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / COMPILE_CACHE)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of every stack of same-class blocks in `model` (an nn.ModuleList of one class: a ViT's encoder
    layers, each Swin stage's blocks), outermost first, none inside another one's blocks."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(block) for block in module}) == 1:
            blocks.extend(module)
            inside.update(id(part) for block in module for part in block.modules())
    return blocks


def compile_for_training(model: nn.Module, mode: Mode = "whole",
                         backend: str | Callable | None = None) -> tuple[nn.Module, str]:
    """The model compiled for training with its attention left to the eager dispatcher where the family allows it:
    `whole`, torch.compile(model); `regional`, each repeated block compiled in place (the model returned is the same
    object, its state dict unchanged). Returns the model and a sentence saying what was compiled, where attention
    runs and where the compiled code is cached. `backend`: torch.compile's, BACKEND unless given."""
    inner = transformers_model(model)
    why_not = why_attention_is_compiled(inner)
    if why_not is None:
        if inner.config._attn_implementation not in KEPT_OUT:
            inner.set_attn_implementation(EAGER_SDPA)
        said = "attention runs outside the compiled graph, on PyTorch's fused SDPA kernels as in eager mode"
    else:
        said = (f"{why_not}, so its attention is compiled with the rest of the graph, and on a GPU the compiler may "
                "run it on PyTorch's slower float32 math path")
    cache = use_compile_cache()
    backend = backend or BACKEND
    if mode == "whole":
        return torch.compile(model, backend=backend), f"the whole model compiled; {said}; compiled code cached in {cache}"
    blocks = repeated_blocks(inner)
    if not blocks:
        raise ValueError(f"{type(inner).__name__} has no repeated blocks to compile one by one; "
                         "set model.compile=true to compile the whole model")
    for block in blocks:
        block.compile(backend=backend)
    return model, (f"{len(blocks)} blocks compiled one by one ({type(blocks[0]).__name__}), the rest eager; {said}; "
                   f"compiled code cached in {cache}")
