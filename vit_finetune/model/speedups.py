"""Changes to the training step that may make it faster, one entry each, applied to the model before it is compiled.
None is part of a run until a GPU measurement shows it pays (`on`); the bench's `--levers` turns each on alone,
beside the defaults, so that making one the default is flipping its `on` (docs/performance.md).

What each removes, in the memory-bound work between the matrix products that the profile of the compiled step on an
H200 shows (40 % of its time):
  fused_qkv       one matrix product for query, key and value instead of three (as timm's ViT computes them): the
                  block's normalised input is read once and, under autocast, cast to bfloat16 and kept for the
                  backward once, not three times. The three Linear layers stay, with their names: the state dict,
                  LoRA's targets and the saved model are unchanged.
  layernorm_cast  each LayerNorm's output cast once to the autocast dtype, so that the projections after it do not
                  each cast (and keep) a copy of their own. The forward is bit-identical; the gradients of the three
                  projections then add up in bfloat16 before the cast back (in float32 without it).
  flash_attention PyTorch's flash attention kernel rather than its first choice (cuDNN on an H100/H200); CUDA only.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.vit.modeling_vit import eager_attention_forward

from vit_finetune.model import compiling

# The attention modules whose forward is ViTAttention's, word for word (tests/test_bench.py compares the outputs):
# fused_qkv replaces that forward with one that computes the same from one matrix product.
VIT_ATTENTION = {"ViTAttention", "DeiTAttention", "ViTMSNAttention", "Dinov2Attention", "Dinov2WithRegistersAttention",
                 "BeitAttention"}
FLASH_SDPA = "sdpa_flash_outside_compile"


def fused_qkv_forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
    """ViTAttention.forward with query, key and value from one matrix product. The three weights are concatenated
    at each call (a copy of 3 x hidden^2 values, small beside the activations), so their gradients reach the three
    Linear layers themselves."""
    input_shape = hidden_states.shape[:-1]
    projections = (self.q_proj, self.k_proj, self.v_proj)
    weight = torch.cat([projection.weight for projection in projections])
    bias = None
    if any(projection.bias is not None for projection in projections):  # BEiT's key has none: zeros in its place
        bias = torch.cat([projection.weight.new_zeros(projection.out_features) if projection.bias is None
                          else projection.bias for projection in projections])
    qkv = F.linear(hidden_states, weight, bias).view(*input_shape, 3, -1, self.head_dim)
    query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, tokens, head_dim)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    output, weights = attention(self, query, key, value, attention_mask,
                                dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                **kwargs)
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


def fuse_qkv(model: PreTrainedModel) -> int:
    """Each ViT-style attention whose projections are plain Linear layers (not LoRA's wrappers) computes them in one
    matrix product; returns how many were changed."""
    changed = 0
    for module in model.modules():
        if type(module).__name__ in VIT_ATTENTION and all(
                type(getattr(module, name)) is nn.Linear for name in ("q_proj", "k_proj", "v_proj")):
            module.forward = types.MethodType(fused_qkv_forward, module)
            changed += 1
    return changed


def cast_to_autocast_dtype(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    """A forward hook: under autocast, the output in the dtype the next matrix product computes in."""
    device = output.device.type
    return output.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else output


def cast_layernorm_outputs(model: PreTrainedModel) -> int:
    layernorms = [module for module in model.modules() if isinstance(module, nn.LayerNorm)]
    for layernorm in layernorms:
        layernorm.register_forward_hook(cast_to_autocast_dtype)
    return len(layernorms)


def flash_sdpa(*args, **kwargs):
    """transformers' SDPA attention with PyTorch's flash kernel only: a call it cannot serve raises, saying why."""
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return sdpa_attention_forward(*args, **kwargs)


compiling.keep_out_of_compile(FLASH_SDPA, flash_sdpa)


def use_flash_attention(model: PreTrainedModel) -> int:
    """Point the model's SDPA attention at the flash kernel (kept out of a compiled graph, as compiling.py keeps
    SDPA); a model whose attention is not SDPA is left as it is."""
    if compiling.why_attention_is_compiled(model) is not None:
        return 0
    model.set_attn_implementation(FLASH_SDPA)
    return 1


@dataclasses.dataclass(frozen=True)
class Speedup:
    what: str  # in words, for the bench's table
    apply: Callable[[PreTrainedModel], int]  # changes the model in place; returns how many modules it changed
    device: str | None = None  # the one device type it runs on; None: any
    on: bool = False  # part of every run; only after a GPU measured it paying (docs/performance.md)


SPEEDUPS: dict[str, Speedup] = {
    "fused_qkv": Speedup("query, key and value from one matrix product", fuse_qkv),
    "layernorm_cast": Speedup("each LayerNorm's output cast once to the autocast dtype", cast_layernorm_outputs),
    "flash_attention": Speedup("PyTorch's flash attention kernel, not its first choice", use_flash_attention,
                               device="cuda"),
}
ON = tuple(name for name, speedup in SPEEDUPS.items() if speedup.on)


def unavailable(name: str, device_type: str) -> str | None:
    """Why speed-up `name` cannot run on this device type; None when it can."""
    needed = SPEEDUPS[name].device
    return None if needed in (None, device_type) else f"{name} runs on {needed} only"


def apply_those_on(model: nn.Module, device_type: str) -> dict[str, int]:
    """The speed-ups that are part of every run (ON), those this device can run, applied (apply)."""
    return apply(model, [name for name in ON if not unavailable(name, device_type)], device_type)


def apply(model: nn.Module, names: Iterable[str], device_type: str) -> dict[str, int]:
    """The speed-ups `names` applied to the transformers model in `model` (under peft's wrappers, say), before it is
    compiled; returns how many modules each changed. A name this device cannot run raises ValueError."""
    inner = compiling.transformers_model(model)
    changed = {}
    for name in names:
        why_not = unavailable(name, device_type)
        if why_not:
            raise ValueError(why_not)
        changed[name] = SPEEDUPS[name].apply(inner)
    return changed
