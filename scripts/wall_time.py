"""Whole-process wall time of the toolkit's defaults against the peer, one arm after the other, on the transfer study's
cells: what a newcomer sees running each command.

    python scripts/wall_time.py                                  # 5 datasets, 20/60/200 steps, both ways, 56 px
    python scripts/wall_time.py --per-class 10,200 --steps 60 --datasets mnist,fashion,elpv
    python scripts/wall_time.py --table

Each cell runs two commands as fresh processes, one after the other (which goes first alternates from cell to cell),
both on one torch thread, with the cell's base, data, size, steps, batch 16 and seed, in two ways:
  end    both evaluate once, at the end: `python -m vit_finetune ... train.eval_every_steps=STEPS` against
         `python scripts/peer_example.py ... --eval_strategy no`;
  epoch  both evaluate after every epoch and keep the best weights by eval loss: `python -m vit_finetune ...
         train.eval_every_steps=null train.keep_best=eval_loss` against `python scripts/peer_example.py ...
         --eval_strategy epoch` (the example's documented command: it also saves a checkpoint every epoch).
Everything else is each tool's default (the toolkit's train.method=auto included); both save their model. Wall and CPU
seconds of each process and its eval accuracy go to <root>/results.jsonl; a cell already recorded is not redone.
Nothing else should run on the machine meanwhile.

--float32 runs the toolkit with train.mixed_precision=no: what its `auto` picks on a CPU without native bfloat16
(the peer runs float32 either way), so a CPU with it can measure the comparison such a CPU would see.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import transfer_study as study  # noqa: E402

MODES = ("end", "epoch")


def commands(mode: str, base: Path, data: Path, size: int, steps: int, seed: int, out: Path, float32: bool = False
             ) -> dict[str, list[str]]:
    toolkit_eval = [f"train.eval_every_steps={steps}"] if mode == "end" else ["train.eval_every_steps=null",
                                                                               "train.keep_best=eval_loss"]
    precision = ["train.mixed_precision=no"] if float32 else []
    return {
        "toolkit": [sys.executable, "-m", "vit_finetune", f"model.base={base}", f"model.image_size={size}",
                    f"data.dataset={data}", "data.eval_split=validation", f"train.max_steps={steps}", "train.epochs=1000",
                    f"train.batch_size={study.BATCH}", f"train.seed={seed}", "train.cpu_threads=1",
                    f"output_dir={out / 'toolkit'}", "overwrite=true", *toolkit_eval, *precision],
        "peer": [sys.executable, str(REPO / "scripts" / "peer_example.py"), "--dataset", str(data), "--model", str(base),
                 "--image_size", str(size), "--max_steps", str(steps), "--per_device_train_batch_size", str(study.BATCH),
                 "--seed", str(seed), "--eval_strategy", "no" if mode == "end" else "epoch",
                 "--output_dir", str(out / "peer")],
    }


def timed(command: list[str], log: Path) -> dict:
    """Wall and CPU seconds of one process (its children included), its exit code checked."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(log, "w") as handle:
        code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}).returncode
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed ({code}); see {log}")
    return {"wall_s": round(wall, 1), "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1)}


def accuracy(arm: str, out: Path, log: Path) -> float:
    if arm == "toolkit":
        return json.loads((out / "toolkit" / "metrics.json").read_text())["accuracy"]
    return json.loads(log.read_text().strip().splitlines()[-1])["accuracy"]


def run_cell(cell: dict, first: str, base: Path, study_root: Path, root: Path, float32: bool = False) -> dict:
    data = study.write_small_dataset(study.sized(study.DATASETS[cell["dataset"]], cell["per_class"]),
                                     study.data_folder(study_root, study.Cell("", cell["dataset"], cell["size"], cell["steps"],
                                                                        None, cell["seed"], cell["per_class"])))
    name = f"{cell['dataset']}{cell['per_class']}-{cell['size']}px-{cell['steps']}st-{cell['mode']}-s{cell['seed']}"
    out = root / "runs" / (name + ("-float32" if float32 else ""))
    out.mkdir(parents=True, exist_ok=True)
    argv = commands(cell["mode"], base, data, cell["size"], cell["steps"], cell["seed"], out, float32)
    result = dict(cell, first=first, toolkit_precision="float32" if float32 else "auto")
    for arm in (first, "peer" if first == "toolkit" else "toolkit"):
        log = out / f"{arm}.log"
        print("$ " + " ".join(argv[arm]), flush=True)
        result[arm] = {**timed(argv[arm], log), "accuracy": accuracy(arm, out, log)}
    if (out / "toolkit" / "recipe.yaml").exists():
        import yaml

        result["toolkit"]["method"] = yaml.safe_load((out / "toolkit" / "recipe.yaml").read_text())["train"]["method"]
    with open(root / "results.jsonl", "a") as handle:
        handle.write(json.dumps(result) + "\n")
    return result


def table(results: list[dict]) -> str:
    rows = ["| data | size | steps | evaluations | toolkit precision | toolkit wall / CPU s | peer wall / CPU s | "
            "toolkit / peer wall | accuracy toolkit (method) / peer |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["dataset"], r["per_class"], r["size"], r["steps"], r["mode"], r["seed"])):
        t, p = r["toolkit"], r["peer"]
        rows.append(f"| {r['dataset']} {r['per_class']}/class | {r['size']} px | {r['steps']} | {r['mode']} | "
                    f"{r.get('toolkit_precision', 'auto')} | "
                    f"{t['wall_s']} / {t['cpu_s']} | {p['wall_s']} / {p['cpu_s']} | {t['wall_s'] / p['wall_s']:.2f} | "
                    f"{t['accuracy']:.3f} ({t.get('method', '?')}) / {p['accuracy']:.3f} |")
    ratios = [r["toolkit"]["wall_s"] / r["peer"]["wall_s"] for r in results]
    if ratios:
        rows.append(f"\n{len(ratios)} cells: toolkit / peer wall time {min(ratios):.2f}-{max(ratios):.2f} "
                    f"(median {statistics.median(ratios):.2f}); slower than the peer in "
                    f"{sum(ratio > 1 for ratio in ratios)}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=REPO / "outputs" / "wall_time")
    parser.add_argument("--study-root", type=Path, default=REPO / "outputs" / "transfer",
                        help="where the transfer study keeps its base and data")
    parser.add_argument("--datasets", default=",".join(study.DATASETS))
    parser.add_argument("--sizes", default="56")
    parser.add_argument("--steps", default="20,60,200")
    parser.add_argument("--per-class", default="")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--float32", action="store_true", help="the toolkit in float32 (train.mixed_precision=no), as "
                        "auto runs it on a CPU without native bfloat16")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    path = args.root / "results.jsonl"
    results = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not args.table:
        base = study.reference_base(args.study_root)
        key = ("dataset", "per_class", "size", "steps", "mode", "seed")
        precision = "float32" if args.float32 else "auto"
        done = {tuple(r[k] for k in key) for r in results if r.get("toolkit_precision", "auto") == precision}
        index = 0
        for seed in map(int, args.seeds.split(",")):
            for mode in args.modes.split(","):
                for steps in map(int, args.steps.split(",")):
                    for size in map(int, args.sizes.split(",")):
                        for name in args.datasets.split(","):
                            sizes = [int(n) for n in args.per_class.split(",") if n] or [study.DATASETS[name].train_per_class]
                            for per_class in sizes:
                                cell = {"dataset": name, "per_class": per_class, "size": size, "steps": steps,
                                        "mode": mode, "seed": seed}
                                if tuple(cell.values()) in done:
                                    continue
                                first = ("toolkit", "peer")[index % 2]
                                index += 1
                                results.append(run_cell(cell, first, base, args.study_root, args.root,
                                                        args.float32))
                                r = results[-1]
                                print(f"== {cell}: toolkit {r['toolkit']}, peer {r['peer']}", flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
