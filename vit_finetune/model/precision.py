"""train.mixed_precision=auto: bf16 autocast where the hardware multiplies bfloat16 natively; fp16 with a loss scaler
on a CUDA GPU without it (T4, V100); else float32.

Under bf16 autocast the matrix products run in bfloat16 and the weights, the optimiser and the loss stay float32
(Accelerate's mixed precision). Where bfloat16 is native that is about twice as fast as float32 for a whole
training step; where it is emulated it is slower, so auto keeps float32 on such a CPU. The GPUs before Ampere that
have tensor cores (Volta and Turing: V100, T4) have them for float16 only: there fp16 autocast runs the matrix products
on them, and its loss scaler skips the steps whose gradients overflow float16 (loss_scale.py). Older GPUs have none.
"""

from __future__ import annotations

import torch

FLOAT16_TENSOR_CORES = (7, 0)  # CUDA compute capability of Volta, the first GPUs with tensor cores (float16)


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slow."""
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check is not None and check() for check in checks)


def resolved(setting: str, device_type: str) -> str:
    """train.mixed_precision as it runs on `device_type`: auto's choice there, any other setting as it is."""
    return auto_mixed_precision(device_type)[0] if setting == "auto" else setting


def auto_mixed_precision(device_type: str) -> tuple[str, str]:
    """The precision train.mixed_precision=auto stands for on `device_type` ("cuda", "cpu", ...), and why."""
    if device_type == "cuda":
        # Not counting emulation: torch says yes to bfloat16 on a T4 or V100, which only emulate it.
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16", "this GPU computes bfloat16 natively; the weights stay float32"
        if torch.cuda.get_device_capability() >= FLOAT16_TENSOR_CORES:
            return "fp16", ("this GPU has no native bfloat16 but float16 tensor cores (V100, T4); a loss scaler skips "
                            "the steps whose gradients overflow float16 (counted: skipped_steps); the weights stay float32")
        return "no", "this GPU has neither native bfloat16 nor tensor cores (older than Volta)"
    if device_type == "cpu":
        if native_bf16_cpu():
            return "bf16", ("this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX): a ViT's training step took "
                            "about half of float32's time on such a CPU (docs/training.md); the weights stay float32")
        return "no", "this CPU has no native bfloat16 (emulated, it would be slower than float32)"
    return "no", f"float32 on {device_type}: bfloat16 was measured on CUDA and CPU only"
