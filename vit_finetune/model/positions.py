"""Position information at a new resolution: pure tensor functions, one per way a ViT-family model stores it.

Each function takes a checkpoint tensor at the base geometry and returns it at the target geometry, resized
once in float32, so the saved model runs at its new size with no forward-time interpolation. Which function a
model needs, and with which settings, is recorded per family in `families.py`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

# When bicubic resampling of a learned table antialiases:
#  when_shrinking: transformers' forward when enlarging (exact), timm's antialiasing when shrinking (no aliasing);
#                  for families whose interpolation is an opt-in flag (ViT, DeiT, ViT-MSN, CLIP, SigLIP, Swin).
#  never / always: exactly what the family's own forward always does (DINOv2: never; DINOv2+registers: always),
#                  so the checkpoint behaves at the new size as it did there before fine-tuning.
Antialias = Literal["when_shrinking", "never", "always"]


class PositionError(ValueError):
    """A position tensor whose shape does not fit the layout the family says it has."""


def square_side(count: int, what: str) -> int:
    side = math.isqrt(count)
    if side * side != count:
        raise PositionError(f"{what} holds {count} entries, not a square grid")
    return side


def resample_position_embeddings(position_embeddings: torch.Tensor, new_grid: tuple[int, int], prefix_rows: int = 1,
                                 antialias: Antialias = "when_shrinking") -> torch.Tensor:
    """(1, P + h*w, D) or (P + h*w, D) -> same layout with H*W patch rows: the P prefix rows (CLS, distillation)
    untouched, the square patch grid resized bicubically in float32. The same size returns an exact copy.

    With the default policy this matches transformers' `interpolate_pos_encoding` when enlarging and
    antialiases when shrinking, where plain bicubic would alias.
    """
    table = position_embeddings if position_embeddings.dim() == 3 else position_embeddings.unsqueeze(0)
    prefix, patches = table[:, :prefix_rows], table[:, prefix_rows:]
    old_side = square_side(patches.shape[1], "the position embeddings' patch part")
    if (old_side, old_side) == tuple(new_grid):
        return position_embeddings.detach().clone()
    dim = patches.shape[-1]
    grid = patches.reshape(1, old_side, old_side, dim).permute(0, 3, 1, 2).float()
    shrinking = new_grid[0] < old_side or new_grid[1] < old_side
    smooth = antialias == "always" or (antialias == "when_shrinking" and shrinking)
    grid = F.interpolate(grid, size=tuple(new_grid), mode="bicubic", align_corners=False, antialias=smooth)
    patches = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim)
    resized = torch.cat([prefix.float(), patches], dim=1).to(position_embeddings.dtype)
    return resized if position_embeddings.dim() == 3 else resized[0]


def resize_relative_bias_table(table: torch.Tensor, new_side: int, mode: Literal["bilinear", "bicubic"],
                               extra_rows: int = 0) -> torch.Tensor:
    """((2W-1)^2 + E, heads) -> ((2W'-1)^2 + E, heads): the (2W-1)x(2W-1) distance grid resized in float32, the
    E trailing rows (BEiT's three CLS terms) kept.

    BEiT/Data2Vec: bilinear with side 2W'-1 for W' the new patch grid, exactly as their forward rebuilds the table
    (timm resizes on a geometric grid instead). Swin: bicubic with W' the new window, as timm and Swin's authors do.
    """
    distances, extra = table[: table.shape[0] - extra_rows], table[table.shape[0] - extra_rows:]
    old_side = square_side(distances.shape[0], "the relative position bias table")
    if old_side == new_side:
        return table.detach().clone()
    heads = table.shape[1]
    grid = distances.reshape(1, old_side, old_side, heads).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=(new_side, new_side), mode=mode, align_corners=False)
    distances = grid.permute(0, 2, 3, 1).reshape(new_side * new_side, heads)
    return torch.cat([distances, extra.float()]).to(table.dtype)
