"""The report: one JSON document (schema vit_finetune.bench/1) and the table printed from it."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from datetime import datetime, timezone

from vit_finetune.bench.device import PeakMemory, device_info
from vit_finetune.bench.flops import vit_macs
from vit_finetune.bench.levers import LEVERS
from vit_finetune.bench.workload import Setup
from vit_finetune.model.loading import describe

SCHEMA = "vit_finetune.bench/1"
LEVER_TITLES = {name: lever.title for name, lever in LEVERS.items()}
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


def lever_ratios(levers: dict) -> dict[str, dict[str, float]]:
    """Each lever's images/s and peak memory over the defaults' (the model step of the same run)."""
    defaults = levers.get("defaults", {})
    if "error" in defaults or not defaults:
        return {}
    return {name: {"images/s": figures["images_per_s"] / defaults["images_per_s"],
                   "peak memory": figures["peak_memory_gib"] / defaults["peak_memory_gib"]}
            for name, figures in levers.items() if name != "defaults" and "images_per_s" in figures}


def build_report(argv: list[str], setup: Setup, jpeg_stats: dict, peak: dict, memory: PeakMemory,
                 results: dict, levers: dict | None = None) -> dict:
    config = setup.spec.vit_config()
    levers = levers or {}
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
        # Present when --levers was given: "defaults" (our model step as a run gets it) and each lever changed alone.
        **({"levers": levers, "lever_ratios": lever_ratios(levers)} if levers else {}),
    }


def _row(title: str, result: dict) -> str:
    if "error" in result:
        return f"{title:32s} failed: {result['error'][:200]}"
    if "skipped" in result:
        return f"{title:32s} skipped: {result['skipped']}"
    mfu = "-" if result["mfu"] is None else f"{100 * result['mfu']:.2f}%"
    return (f"{title:32s} {result['images_per_s']:10,.1f} {mfu:>8s} {result['peak_memory_gib']:8.2f} GiB "
            f"{100 * result['data_wait_share']:9.1f}%")


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
    lines += [_row(TITLES[name], result) for name, result in report["configs"].items()]
    levers = report.get("levers", {})
    if levers:
        lines += ["", "levers: our model step with the defaults, then each lever changed alone"]
        lines += [_row("defaults" if name == "defaults" else LEVER_TITLES[name], result)
                  for name, result in levers.items()]
        lines += [f"  {LEVER_TITLES[name]}: {levers[name]['change']}; images/s x{ratio['images/s']:.3f}, "
                  f"peak memory x{ratio['peak memory']:.3f}" for name, ratio in report["lever_ratios"].items()]
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


def markdown_rows(report: dict) -> list[str]:
    """The report as rows of docs/performance.md's table: card, date, configuration, images/s, MFU, peak memory and
    the command, one row per configuration and lever measured."""
    card, date = report["device"]["name"], report["date"][:10]
    measured = {**{TITLES[name]: result for name, result in report["configs"].items()},
                **{("defaults (model step)" if name == "defaults" else LEVER_TITLES[name]): result
                   for name, result in report.get("levers", {}).items()}}
    rows = []
    for title, result in measured.items():
        if "error" in result or "skipped" in result:
            why = f"failed: {result['error'][:80]}" if "error" in result else f"skipped: {result['skipped']}"
            rows.append(f"| {card} | {date} | {title} | {why} | | | `{report['command']}` |")
            continue
        mfu = "" if result["mfu"] is None else f"{100 * result['mfu']:.1f} %"
        rows.append(f"| {card} | {date} | {title} | {result['images_per_s']:,.0f} | {mfu} | "
                    f"{result['peak_memory_gib']:.1f} GiB | `{report['command']}` |")
    return rows
