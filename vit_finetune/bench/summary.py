"""The figures docs/performance.md needs, from the JSON reports `bash scripts/bench_gpu.sh all` writes into a folder:
each report's own table, then each goal beside what was measured.

    python -m vit_finetune.bench.summary OUT [--write OUT/summary.txt]

A report that is missing (its step failed or was skipped) is said to be missing; the others are shown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vit_finetune.bench import compile_cost, inference, report, whole_job

REPORTS = {"compile_cost.json": compile_cost.format_table, "whole_job.json": whole_job.format_table,
           "inference.json": inference.format_table, "bench.json": report.format_table}


def goals(found: dict[str, dict]) -> list[str]:
    """The goals on one H100/H200 (ViT-B/16 at 384 px, bf16, batch 128), each with the figure measured for it."""
    lines = []
    job = found.get("whole_job.json", {})
    if "ours / peer wall time" in job:
        lines.append(f"the whole job in {job['ours / peer wall time']:.3f}x the Trainer's wall time (goal <= 0.67)")
    for name, goal in (("evaluation: ours / Trainer.evaluate images/s", 1.5), ("predict: ours / pipeline() images/s", 2)):
        value = found.get("inference.json", {}).get("ratios", {}).get(name)
        if value is not None:
            lines.append(f"{name} {value:.3f} (goal >= {goal:g})")
    for name, ratio in found.get("bench.json", {}).get("lever_ratios", {}).items():
        lines.append(f"lever {name}: images/s x{ratio['images/s']:.3f}, peak memory x{ratio['peak memory']:.3f} "
                     "against the defaults' model step")
    return lines


def summary(folder: Path) -> str:
    found = {name: json.loads((folder / name).read_text()) for name in REPORTS if (folder / name).exists()}
    sections = []
    for name, table in REPORTS.items():
        sections.append(f"== {name}\n" + (table(found[name]) if name in found else "missing: its step did not finish"))
    if "bench.json" in found:
        sections.append("== rows for docs/performance.md's table\n" + "\n".join(report.markdown_rows(found["bench.json"])))
    sections.append("== the goals\n" + ("\n".join(goals(found)) or "nothing measured"))
    return "\n\n".join(sections)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vit_finetune.bench.summary", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where `bash scripts/bench_gpu.sh all` wrote its reports ($OUT)")
    parser.add_argument("--write", type=Path, help="also write the summary to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = summary(args.folder)
    print(text)
    if args.write:
        args.write.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
