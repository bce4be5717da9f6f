"""The shift study's tables and picture, from its results (scripts/shift_study.py --table)."""

from __future__ import annotations

import statistics
from pathlib import Path

SPLITS = ("test_accuracy", "shifted_accuracy")
# The arms the verdict compares the defaults with: the strongest single recipe each side offers.
RIVALS = ("linear_probe", "lp_ft", "finetune", "peer")


def summary(values: list[float]) -> str:
    if not values:
        return "–"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f} ({len(values)})"


def in_cell(run: dict, name: str, size: int, steps: int) -> bool:
    """A probe's row (steps 0, seed 0) belongs to every schedule of its set and size."""
    return run["set"] == name and run["size"] == size and run["steps"] in (steps, 0)


def cells_of(results: list[dict]) -> list[tuple[str, int, int]]:
    trained = {(r["set"], r["size"], r["steps"]) for r in results if r["steps"]}
    return sorted(trained)


def table(results: list[dict], name: str, size: int, steps: int) -> str:
    rows = [r for r in results if in_cell(r, name, size, steps)]
    arms = list(dict.fromkeys(r["arm"] for r in sorted(rows, key=lambda r: r["arm"] != "defaults")))
    out = [f"\n{name}, {size} px, {steps} steps of 16 ({steps * 16:,} images seen): accuracy mean ± std (n seeds)\n",
           "| arm | in-source test | shifted | chose | CPU s |", "|---|---|---|---|---|"]
    for arm in arms:
        runs = [r for r in rows if r["arm"] == arm]
        chose = ", ".join(sorted({chosen(r) for r in runs}))
        cost = statistics.mean(r["cpu_seconds"] for r in runs)
        out.append(f"| {arm} | {summary([r['test_accuracy'] for r in runs])} | "
                   f"{summary([r['shifted_accuracy'] for r in runs])} | {chose} | {cost:.0f} |")
    return "\n".join(out)


def chosen(run: dict) -> str:
    """What a toolkit run trained with, in a few words."""
    if run["arm"] == "peer":
        return "the Trainer"
    crop = run.get("crop_scale_used") or [1.0, 1.0]
    bits = [run.get("method_used", "?")]
    if tuple(crop) != (1.0, 1.0):
        bits.append(f"crop {crop[0]:g}-{crop[1]:g}")
    if run.get("horizontal_flip_used"):
        bits.append("flip")
    if run.get("alpha_background_used"):
        bits.append(f"on {run['alpha_background_used']}")
    return " ".join(bits)


def print_tables(results: list[dict]) -> None:
    for name, size, steps in cells_of(results):
        print(table(results, name, size, steps))
    print(path_table(results))
    print(loss_choice_table(results))


def path_table(results: list[dict]) -> str:
    """The wise_path arm: each point of WiSE-FT's path (alpha x fine-tuned + (1 - alpha) x the probe's model), the
    run's eval split, in-source test and shifted accuracy, mean over the seeds, beside what the run kept."""
    runs = [r for r in results if r["arm"] == "wise_path"]
    if not runs:
        return ""
    alphas = list(runs[0]["wise_ft_path"])
    out = ["\nWiSE-FT's path: eval split / in-source test / shifted, mean over the seeds (n)\n",
           "| set, px, steps | n | " + " | ".join(f"alpha {a}" for a in alphas) + " | kept by the run |",
           "|---" * (len(alphas) + 3) + "|"]
    for name, size, steps in cells_of(runs):
        cell = [r for r in runs if (r["set"], r["size"], r["steps"]) == (name, size, steps)]
        points = [" / ".join(f"{statistics.mean(r['wise_ft_path'][a][split] for r in cell):.3f}"
                             for split in ("validation", "test", "shifted")) for a in alphas]
        kept = " / ".join(f"{statistics.mean(r[split] for r in cell):.3f}"
                          for split in ("validation_accuracy", "test_accuracy", "shifted_accuracy"))
        out.append(f"| {name}, {size}, {steps} | {len(cell)} | " + " | ".join(points) + f" | {kept} |")
    return "\n".join(out)


def verdict(results: list[dict], arm: str = "defaults") -> list[str]:
    """Per cell and split: `arm` minus the best of RIVALS, against the larger of their seeds' spreads."""
    lines = []
    for name, size, steps in cells_of(results):
        rows = [r for r in results if in_cell(r, name, size, steps)]
        ours = [r for r in rows if r["arm"] == arm]
        if not ours:
            continue
        for split in SPLITS:
            means = {}
            spreads = [statistics.stdev([r[split] for r in ours]) if len(ours) > 1 else 0.0]
            for rival in RIVALS:
                values = [r[split] for r in rows if r["arm"] == rival]
                if values:
                    means[rival] = statistics.mean(values)
                    spreads.append(statistics.stdev(values) if len(values) > 1 else 0.0)
            if not means:
                continue
            best = max(means, key=means.get)
            gap = statistics.mean(r[split] for r in ours) - means[best]
            lines.append(f"{name} {size}px {steps}st {split.split('_')[0]}: {arm} {gap:+.3f} against {best} "
                         f"(spread {max(spreads):.3f})")
    return lines


def draw(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = cells_of(results)
    arms = list(dict.fromkeys(r["arm"] for r in results))
    figure, axes = plt.subplots(1, len(cells), figsize=(3.2 * len(cells), 3.6), squeeze=False, sharey=False)
    for axis, (name, size, steps) in zip(axes[0], cells):
        rows = [r for r in results if in_cell(r, name, size, steps)]
        for arm in arms:
            runs = [r for r in rows if r["arm"] == arm]
            if not runs:
                continue
            x = statistics.mean(r["test_accuracy"] for r in runs)
            y = statistics.mean(r["shifted_accuracy"] for r in runs)
            axis.scatter(x, y, s=40 if arm == "defaults" else 18, marker="*" if arm == "defaults" else "o",
                         label=arm)
        axis.set_title(f"{name}\n{size} px, {steps} steps", fontsize=8)
        axis.set_xlabel("in-source test", fontsize=7)
        axis.set_ylabel("shifted", fontsize=7)
        axis.tick_params(labelsize=6)
    axes[0][0].legend(fontsize=5, loc="best")
    figure.tight_layout()
    figure.savefig(path, dpi=130)


# The points a choice by the eval loss picks among: the run's own two (0.75 and 1) and one nearer the probe.
LOSS_CHOICES = ("0.5", "0.75", "1")


def lowest_eval_loss(run: dict) -> str:
    """The point of LOSS_CHOICES with the lowest eval-split loss; a tie goes to the larger alpha (nearer the run's)."""
    losses = run["wise_ft_path_loss"]
    return min(LOSS_CHOICES, key=lambda alpha: (losses[alpha]["validation"], -float(alpha)))


def loss_choice_table(results: list[dict]) -> str:
    """WiSE-FT's point chosen by the eval loss against the run's own choice (by eval accuracy), from the same
    wise_path runs: in-source test / shifted of each, and the points the loss chose."""
    runs = [r for r in results if r["arm"] == "wise_path" and "wise_ft_path_loss" in r]
    if not runs:
        return ""
    out = [f"\nWiSE-FT's point by the lowest eval loss among {', '.join(LOSS_CHOICES)}: in-source test / shifted\n",
           "| set, px, steps | the run's choice | lowest eval loss | points chosen |", "|---|---|---|---|"]
    for name, size, steps in cells_of(runs):
        cell = [r for r in runs if (r["set"], r["size"], r["steps"]) == (name, size, steps)]
        picks = [lowest_eval_loss(r) for r in cell]
        kept = " / ".join(summary([r[split] for r in cell]) for split in SPLITS)
        by_loss = " / ".join(summary([r["wise_ft_path"][a][split] for r, a in zip(cell, picks)])
                             for split in ("test", "shifted"))
        out.append(f"| {name}, {size}, {steps} | {kept} | {by_loss} | {', '.join(picks)} |")
    return "\n".join(out)
