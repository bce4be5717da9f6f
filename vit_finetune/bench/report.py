"""The report: one JSON document (schema vit_finetune.bench/1) and the table printed from it."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from datetime import datetime, timezone

from ..model import describe
from .device import PeakMemory, device_info
from .flops import vit_macs
from .workload import Setup

SCHEMA = "vit_finetune.bench/1"
TITLES = {
    "model_step": "model step (batches on device)",
    "end_to_end": "end to end (JPEG -> train)",
    "lora": "LoRA end to end",
    "peer": "peer: transformers Trainer",
    "data_ours": "data pipeline alone: ours",
    "data_peer": "data pipeline alone: peer",
}


def versions() -> dict[str, str]:
    import importlib.metadata as metadata

    found = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "accelerate", "datasets", "peft", "torchvision", "pillow"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def ratios(results: dict) -> dict[str, float]:
    results = {name: result for name, result in results.items() if "error" not in result}
    rate = {name: result["images_per_s"] for name, result in results.items()}
    found = {}
    if {"end_to_end", "model_step"} <= rate.keys():
        found["end_to_end / model_step images/s"] = rate["end_to_end"] / rate["model_step"]
    if {"end_to_end", "peer"} <= rate.keys():
        found["end_to_end / peer images/s"] = rate["end_to_end"] / rate["peer"]
    if {"lora", "end_to_end"} <= results.keys():
        memory = {name: results[name]["peak_memory_gib"] for name in ("lora", "end_to_end")}
        found["lora / end_to_end peak memory"] = memory["lora"] / memory["end_to_end"]
    if {"data_ours", "model_step"} <= rate.keys():
        found["data_ours / model_step images/s"] = rate["data_ours"] / rate["model_step"]
    if {"data_ours", "data_peer"} <= rate.keys():
        found["data_ours / data_peer images/s"] = rate["data_ours"] / rate["data_peer"]
    return found


def build_report(argv: list[str], setup: Setup, jpeg_stats: dict, peak: dict, memory: PeakMemory,
                 results: dict) -> dict:
    config = setup.spec.vit_config()
    return {
        "schema": SCHEMA,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "vit_finetune.bench", *argv]),
        "device": device_info(setup.device),
        "software": versions(),
        "peak": peak,
        "memory_measure": memory.label,
        "setup": {
            "model": setup.model_name,
            "model_description": describe(config),
            **dataclasses.asdict(setup.spec),
            "batch_size": setup.batch_size,
            "warmup_steps": setup.warmup,
            "steps": setup.steps,
            "num_workers": setup.workers,
            "precision": setup.precision,
            "jpegs": {"folder": str(setup.jpegs), **jpeg_stats},
            "forward_gmacs": sum(vit_macs(config).values()) / 1e9,
        },
        "configs": results,
        "ratios": ratios(results),
    }


def format_table(report: dict) -> str:
    setup, peak = report["setup"], report["peak"]
    lines = [
        f"vit_finetune bench: {setup['model_description']}, batch {setup['batch_size']}, "
        f"precision {setup['precision']}, {setup['num_workers']} workers, {setup['steps']} steps after "
        f"{setup['warmup_steps']} warm-up",
        f"device: {report['device']['name']}; {report['date']}",
        "",
        f"{'configuration':32s} {'images/s':>10s} {'MFU':>8s} {'peak memory':>12s} {'data wait':>10s}",
    ]
    for name, result in report["configs"].items():
        if "error" in result:
            lines.append(f"{TITLES[name]:32s} failed: {result['error'][:200]}")
            continue
        mfu = "-" if result["mfu"] is None else f"{100 * result['mfu']:.2f}%"
        lines.append(f"{TITLES[name]:32s} {result['images_per_s']:10,.1f} {mfu:>8s} "
                     f"{result['peak_memory_gib']:8.2f} GiB {100 * result['data_wait_share']:9.1f}%")
    flops = ", ".join(f"{name} {result['flops_per_image'] / 1e9:,.4g} GFLOP"
                      for name, result in report["configs"].items()
                      if "error" not in result and result["flops_per_image"] is not None)
    lines += [
        "",
        f"MFU = model FLOPs per training image x images/s / {peak['tflops']:,.2f} TFLOP/s ({peak['source']}); "
        f"FLOPs per image: {flops}",
        f"peak memory: {report['memory_measure']}",
        "data wait: time in next() on the batches (incl. the host-to-device copy) / measured time",
        "data pipeline alone: the loader drained with no model step (what these workers can feed)",
    ]
    if report["ratios"]:
        lines.append("ratios: " + ", ".join(f"{key} {value:.3f}" for key, value in report["ratios"].items()))
    return "\n".join(lines)
