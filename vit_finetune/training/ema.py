"""EMA of the weights: a running average of the trainable parameters, often better than the last weights.

After each optimiser step, ema = decay × ema + (1 − decay) × weights, for every trainable parameter
(with LoRA: the adapter and the head); buffers are copied as they are. The average starts from the
weights at the first step. Every process holds the same one, since every process holds the same weights.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors training can change: the trainable parameters and the buffers, by name (not copies)."""
    state = {name: p for name, p in model.named_parameters() if p.requires_grad}
    state.update(dict(model.named_buffers()))
    return state


def load_trainable_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (as trainable_state names it) into the model's own tensors, in place."""
    own = trainable_state(model)
    if own.keys() != state.keys():
        missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        raise ValueError(f"saved weights do not fit this model: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])


class WeightEMA:
    """The exponential moving average of one model's trainable parameters (its buffers copied)."""

    def __init__(self, model: nn.Module, decay: float):
        self.model, self.decay = model, decay
        self.parameters = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        self.buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        self._sources = [p for p in model.parameters() if p.requires_grad]  # in the order of self.parameters

    @torch.no_grad()
    def update(self) -> None:
        """One step of the average, after an optimiser step: ema += (1 - decay) * (weights - ema), in one kernel
        per tensor list rather than one per parameter."""
        torch._foreach_lerp_(list(self.parameters.values()), [p.detach() for p in self._sources], 1 - self.decay)
        for name, buffer in self.model.named_buffers():
            self.buffers[name].copy_(buffer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged tensors, named as in trainable_state(model)."""
        return {**self.parameters, **self.buffers}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from a checkpoint's copy (names as state_dict gives them)."""
        if state.keys() != self.state_dict().keys():
            raise ValueError("the checkpoint's EMA does not fit this model's trainable parameters")
        with torch.no_grad():
            for name, tensor in self.state_dict().items():
                tensor.copy_(state[name])

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside: the model holds the averaged weights; afterwards its own weights are back, bit for bit."""
        raw = {name: t.detach().clone() for name, t in trainable_state(self.model).items()}
        load_trainable_state(self.model, self.state_dict())
        try:
            yield
        finally:
            load_trainable_state(self.model, raw)
