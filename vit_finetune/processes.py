"""The processes of one run: agreeing on a flag, summing a count, and Accelerate's process-wide state.

Each function that reduces is a collective: every process must call it at the same point, or the others
wait for it forever.
"""

from __future__ import annotations

import torch


def any_process(accelerator, flag: bool | torch.Tensor) -> bool:
    """True on every process if `flag` is true on at least one of them (a collective with several processes)."""
    if accelerator.num_processes == 1:
        return bool(flag)
    raised = torch.as_tensor(flag, device=accelerator.device).float()
    return accelerator.reduce(raised, reduction="sum").item() > 0


def sum_over_processes(accelerator, count: int) -> int:
    """The sum of each process's `count` (a collective)."""
    return int(accelerator.reduce(torch.as_tensor(count, device=accelerator.device), reduction="sum").item())


def reset_accelerate_state() -> None:
    """Accelerate keeps process-wide singletons; a second run in the same process (a test, a benchmark
    configuration) must start from none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
