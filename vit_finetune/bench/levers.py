"""The levers of our training step, each changed alone from the defaults in one bench run (`--levers`).

The defaults are what a run gets with the recipe's defaults on the device. Each lever then measures the model step
(batches on the device, so the data pipeline cannot hide a change) with that one setting flipped: what it is worth
is its row's images/s and memory against the defaults' row of the same run. LoRA is measured beside the full
fine-tune by the `lora` configuration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import torch

from vit_finetune.model import compiling, speedups


@dataclasses.dataclass(frozen=True)
class Variant:
    """The settings of our step that the levers change."""

    compile: bool | Literal["auto", "regional"] = "auto"  # model.compile; auto: the bench's own (Setup.compile)
    speedups: tuple[str, ...] = ()  # speedups.SPEEDUPS applied beyond those on (speedups.ON)
    fused_adamw: bool = True  # PyTorch's fused AdamW kernel (optim.build_optimizer), or its default for-each one
    finite_check_every_step: bool = False  # non_finite.NonFiniteWatch read back after every step, not at logs/checkpoints
    batch_scale: int = 1  # times the bench's batch


DEFAULTS = Variant()


@dataclasses.dataclass(frozen=True)
class Lever:
    title: str  # the table's row
    flip: Callable[[Variant, str], Variant]  # the defaults with this lever changed, on a device type
    change: Callable[[str], str]  # what differs from the defaults, in words, on a device type
    unavailable: Callable[[str], str | None] = lambda device: None  # why it cannot run on a device type; None: it can


# A long run of the bench's CUDA model, ViT-B/16 at 384 px: Food-101's 75,750 training images for 40 epochs.
LONG_RUN_IMAGES = 3_000_000


def long_run_compile(device_type: str) -> bool | str:
    """What model.compile=auto chooses for one process of a long run of ViT-B/16 at 384 px: the bench times a few
    steps of such a run, not a run that short."""
    facts = compiling.CompileFacts(work_per_image=compiling.VIT_B16_384_WORK)
    return compiling.auto_compile(device_type, False, LONG_RUN_IMAGES, processes=1, facts=facts)[0]


def _compile_flipped(device_type: str) -> bool:
    return long_run_compile(device_type) is False


def speedup_lever(name: str) -> Lever:
    """A lever that turns speed-up `name` on (speedups.py): its row is what turning it on for every run would give."""
    return Lever(f"lever: {name.replace('_', ' ')}",
                 lambda variant, device: dataclasses.replace(variant, speedups=(*variant.speedups, name)),
                 lambda device: f"speedups.{name} off -> on ({speedups.SPEEDUPS[name].what})",
                 lambda device: speedups.unavailable(name, device))


LEVERS: dict[str, Lever] = {
    "compile": Lever(
        "lever: model.compile flipped",
        lambda variant, device: dataclasses.replace(variant, compile=_compile_flipped(device)),
        lambda device: f"model.compile: {str(long_run_compile(device)).lower()} (auto, for a long run) -> "
                       f"{str(_compile_flipped(device)).lower()} (compiled whole: attention kept out of the graph)"),
    "regional_compile": Lever(
        "lever: each block compiled",
        lambda variant, device: dataclasses.replace(variant, compile="regional"),
        lambda device: f"model.compile: {str(long_run_compile(device)).lower()} (auto, for a long run) -> regional "
                       "(each repeated block compiled on its own, attention kept out)"),
    **{name: speedup_lever(name) for name in speedups.SPEEDUPS if name not in speedups.ON},
    "fused_adamw": Lever(
        "lever: AdamW not fused",
        lambda variant, device: dataclasses.replace(variant, fused_adamw=False),
        lambda device: "AdamW(fused=True) -> AdamW() (PyTorch's default: its for-each kernels)"),
    "host_sync": Lever(
        "lever: NaN check every step",
        lambda variant, device: dataclasses.replace(variant, finite_check_every_step=True),
        lambda device: "the NaN/Inf check read back at logs, evaluations and checkpoints -> after every step "
                       "(the host waits for each step's end)"),
    "batch": Lever(
        "lever: twice the batch",
        lambda variant, device: dataclasses.replace(variant, batch_scale=2),
        lambda device: "train.batch_size x2 (what the memory another lever saves could hold)"),
}


def parse_levers(value: str) -> list[str]:
    """`all` or a comma-separated subset of LEVERS; raises ValueError naming the unknown ones."""
    names = list(LEVERS) if value == "all" else [name for name in value.split(",") if name]
    unknown = [name for name in names if name not in LEVERS]
    if unknown or not names:
        raise ValueError(f"--levers={value!r}: unknown {unknown}; choose all or from {','.join(LEVERS)}")
    return names


def unfused_adamw(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same parameter groups (lr scales, decay) under PyTorch's default AdamW implementation."""
    groups = [{key: value for key, value in group.items() if key not in ("fused", "foreach")}
              for group in optimizer.param_groups]
    return torch.optim.AdamW(groups)
