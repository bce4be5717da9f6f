"""The device side of a measurement: its FLOP/s peak, its peak memory, and a clean state between configurations."""

from __future__ import annotations

import gc
import math
import re
import resource
import time
from pathlib import Path
from typing import Any

import torch

from vit_finetune.data import cpu_cores

# Dense (no 2:4 sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s; first match on the device name wins.
DATASHEET_BF16_TFLOPS = (
    ("H100 PCIe", 756.0, "NVIDIA H100 PCIe datasheet"),
    ("H100 NVL", 835.0, "NVIDIA H100 NVL datasheet"),
    ("H200 NVL", 835.0, "NVIDIA H200 NVL datasheet"),
    ("GH200", 989.4, "NVIDIA GH200 datasheet"),
    ("H100", 989.4, "NVIDIA H100 SXM datasheet"),  # "NVIDIA H100 80GB HBM3" is the SXM part
    ("H200", 989.4, "NVIDIA H200 SXM datasheet"),
    ("A100", 312.0, "NVIDIA A100 datasheet"),
    ("L40S", 362.0, "NVIDIA L40S datasheet"),
    ("L40", 181.0, "NVIDIA L40 datasheet"),
    ("L4", 121.0, "NVIDIA L4 datasheet"),
)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    """Best rate of `repeats` size^3 matrix products after warm-up, in TFLOP/s."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def device_peak(device: torch.device) -> dict[str, Any]:
    """The FLOP/s that MFU divides by, with where it comes from; a measured matmul rate beside it."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        measured = matmul_tflops(device, torch.bfloat16, 8192, 10)
        info = {"measured_matmul_tflops": measured, "measured_matmul": "8192^3 bf16 torch.matmul, best of 10"}
        for key, tflops, source in DATASHEET_BF16_TFLOPS:
            if key.lower() in name.lower():
                return {"tflops": tflops, "dtype": "bf16", "source": f"{source}, dense bf16 (no sparsity)", **info}
        return {"tflops": measured, "dtype": "bf16",
                "source": f"measured bf16 matmul (no datasheet figure known for {name!r})", **info}
    measured = matmul_tflops(device, torch.float32, 1024, 10)
    return {"tflops": measured, "dtype": "float32", "source": "measured float32 matmul, 1024^3, best of 10 "
            "(a CPU has no datasheet bf16 figure here)", "measured_matmul_tflops": measured,
            "measured_matmul": "1024^3 float32 torch.matmul, best of 10"}


class PeakMemory:
    """Peak GPU memory allocated by torch on CUDA; on CPU the main process's peak resident set (VmHWM)."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.label = "torch.cuda.max_memory_allocated"
        elif self._reset_rss():
            self.label = "peak RSS of the main process (VmHWM, reset per configuration)"
        else:  # kernels without clear_refs: the peak since the process started
            self.label = "peak RSS of the main process since it started (ru_maxrss; could not reset per configuration)"

    @staticmethod
    def _reset_rss() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS
            return "VmHWM" in Path("/proc/self/status").read_text()
        except OSError:
            return False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._reset_rss()

    def read_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        status = Path("/proc/self/status")
        match = re.search(r"VmHWM:\s+(\d+) kB", status.read_text()) if status.exists() else None
        kib = int(match.group(1)) if match else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kib / 2**20


def device_info(device: torch.device) -> dict[str, Any]:
    cores = cpu_cores()
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "cpu_cores": cores,
                "memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30}
    return {"type": "cpu", "name": f"CPU ({cores} cores, {torch.get_num_threads()} torch threads)", "cpu_cores": cores}


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
