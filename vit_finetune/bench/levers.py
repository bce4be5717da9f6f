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

from .. import compiling


@dataclasses.dataclass(frozen=True)
class Variant:
    """The settings of our step that the levers change."""

    compile: bool | Literal["auto"] = "auto"  # model.compile; auto: the bench's own setting (Setup.compile)
    fused_adamw: bool = True  # PyTorch's fused AdamW kernel (optim.build_optimizer), or its default for-each one
    finite_check_every_step: bool = False  # non_finite.NonFiniteWatch read back after every step, not at logs/checkpoints
    batch_scale: int = 1  # times the bench's batch


DEFAULTS = Variant()


@dataclasses.dataclass(frozen=True)
class Lever:
    title: str  # the table's row
    flip: Callable[[Variant, str], Variant]  # the defaults with this lever changed, on a device type
    change: Callable[[str], str]  # what differs from the defaults, in words, on a device type


def long_run_compile(device_type: str) -> bool:
    """What model.compile=auto chooses for one process of a run long enough for compiling to pay: the bench times a
    few steps of such a run, not a run that short."""
    return compiling.auto_compile(device_type, False, compiling.CUDA_COMPILE_PAYS_FROM_IMAGES, processes=1)[0]


def _compile_flipped(device_type: str) -> bool:
    return not long_run_compile(device_type)


LEVERS: dict[str, Lever] = {
    "compile": Lever(
        "lever: model.compile flipped",
        lambda variant, device: dataclasses.replace(variant, compile=_compile_flipped(device)),
        lambda device: f"model.compile: {str(not _compile_flipped(device)).lower()} (auto, for a long run) -> "
                       f"{str(_compile_flipped(device)).lower()} (compiled: attention kept out of the graph)"),
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
