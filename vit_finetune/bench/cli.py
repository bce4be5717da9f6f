"""The command line: choose configurations, write the inputs once, run each configuration, report."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from vit_finetune import data
from vit_finetune.bench.device import PeakMemory, device_peak, release_memory
from vit_finetune.bench.flops import MODELS
from vit_finetune.bench.levers import DEFAULTS, LEVERS, long_run_compile, parse_levers
from vit_finetune.bench.ours import run_our_loader, run_ours
from vit_finetune.bench.peer import run_peer, run_peer_loader
from vit_finetune.bench.report import TITLES, build_report, format_table, markdown_rows
from vit_finetune.bench.workload import DEVICE_DEFAULTS, Setup, ensure_base_model, ensure_jpeg_folder
from vit_finetune.core.processes import reset_accelerate_state

CONFIGS = ("model_step", "end_to_end", "lora", "peer", "data_ours", "data_peer")
RUNNERS = {
    "model_step": functools.partial(run_ours, "model_step"),
    "end_to_end": functools.partial(run_ours, "end_to_end"),
    "lora": functools.partial(run_ours, "lora"),
    "peer": run_peer,
    "data_ours": run_our_loader,
    "data_peer": run_peer_loader,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m vit_finetune.bench",
        description="Train for a fixed number of steps after warm-up and report images/s, MFU, peak memory and "
                    "the share of step time spent waiting for data, for our step, our pipeline, LoRA and the "
                    "transformers Trainer peer, and the rate each data pipeline feeds alone.",
        epilog="Defaults on CUDA: vit-b16-384, batch 128, bf16, 10 warm-up + 50 steps. "
               "On CPU: the tiny model, batch 8, float32, 2 + 5 steps.",
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--model", choices=sorted(MODELS), help="default: vit-b16-384 on CUDA, tiny on CPU")
    parser.add_argument("--batch-size", type=int, help="per device; the same for every configuration")
    parser.add_argument("--warmup", type=int, help="steps run before the measured window (compilation happens here)")
    parser.add_argument("--steps", type=int, help="measured steps")
    parser.add_argument("--workers", type=int,
                        help="data loader workers for ours and the peer; default: data.default_num_workers")
    parser.add_argument("--precision", choices=("bf16", "no"), help="default: bf16 on CUDA, no (float32) on CPU")
    parser.add_argument("--compile", choices=("auto", "on", "regional", "off", "other"), default="auto",
                        help="model.compile for our configurations (on: the whole model; regional: each block); auto = "
                             "what model.compile=auto chooses for one process of a long run (levers.long_run_compile); "
                             "other = the whole model compiled where auto does not compile, else off")
    parser.add_argument("--levers", metavar="all|" + ",".join(LEVERS),
                        help="after the configurations, our model step with the defaults and then with each of these "
                             "levers changed alone (see vit_finetune/bench/levers.py)")
    parser.add_argument("--images", type=int, help="training JPEGs to write; default: one epoch covers warm-up + steps")
    parser.add_argument("--cache", type=Path, help="where the JPEGs and the base model are written once "
                        "(default: $VIT_FINETUNE_CACHE/bench or ~/.cache/vit_finetune/bench)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/bench.json"), help="the JSON report")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the figures as rows of docs/performance.md's table (card, date, command)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="also write a torch.profiler table of each measured window to DIR (perturbs timings)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.configs.split(",") if name not in CONFIGS]
    if unknown or not args.configs:
        parser.error(f"--configs={args.configs!r}: unknown {unknown}; choose from {','.join(CONFIGS)}")
    for name in ("batch_size", "warmup", "steps", "images"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')}={value} must be {'>= 0' if name == 'warmup' else '> 0'}")
    if args.levers is not None:
        try:
            args.levers = parse_levers(args.levers)
        except ValueError as error:
            parser.error(str(error))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                     "use --device cpu")
    return args


def compile_setting(asked: str, device_type: str) -> bool | str:
    """model.compile of our configurations for --compile `asked` on this device type."""
    auto = long_run_compile(device_type)
    return {"auto": auto, "on": True, "regional": "regional", "off": False, "other": auto is False}[asked]


def make_setup(args: argparse.Namespace, work_dir: Path) -> tuple[Setup, dict]:
    device_type = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    defaults = DEVICE_DEFAULTS[device_type]
    model_name = args.model or defaults["model"]
    spec = MODELS[model_name]
    batch_size = args.batch_size or defaults["batch_size"]
    warmup = defaults["warmup"] if args.warmup is None else args.warmup
    steps = args.steps or defaults["steps"]
    workers = data.default_num_workers(device_type, 1) if args.workers is None else args.workers
    cache = args.cache or data.cache_dir() / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    needed = (warmup + steps) * batch_size
    images = args.images or needed
    if images < needed:  # crossing an epoch would time its restart and, in our loop, an evaluation
        raise SystemExit(f"--images={images} is less than one epoch of warm-up + steps needs "
                         f"({warmup + steps} steps x batch {batch_size} = {needed}); raise it or leave it out")
    jpegs, jpeg_stats = ensure_jpeg_folder(cache, images, spec.num_labels, data.cpu_cores())
    base = ensure_base_model(cache, model_name, spec)
    setup = Setup(
        device=torch.device(device_type), model_name=model_name, spec=spec, batch_size=batch_size, warmup=warmup,
        steps=steps, workers=workers, precision=args.precision or defaults["precision"],
        compile=compile_setting(args.compile, device_type), jpegs=jpegs,
        base=base, work_dir=work_dir,
        profile_dir=args.profile,
    )
    return setup, jpeg_stats


def quiet_libraries() -> None:
    """Per-file progress bars of datasets and transformers would bury the table; our loop's own bar stays."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def write_atomically(path: Path, text: str) -> None:
    """A run killed while writing leaves the previous report whole, never half of the new one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen configurations, print the table and write the JSON report (after every configuration,
    so a run cut short keeps what it measured). Exit status 1 when a configuration failed."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    quiet_libraries()
    results: dict[str, dict] = {}
    levers: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="vit-bench-") as work:
        setup, jpeg_stats = make_setup(args, Path(work))
        if setup.device.type == "cpu":
            os.environ["ACCELERATE_USE_CPU"] = "true"  # --device cpu on a GPU machine: our Accelerator must obey too
        print(f"vit_finetune bench on {setup.device.type}: measuring the device peak ...", flush=True)
        peak = device_peak(setup.device)
        memory = PeakMemory(setup.device)
        args.out.parent.mkdir(parents=True, exist_ok=True)

        def measure(title: str, run) -> dict:
            print(f"vit_finetune bench: {title} ...", flush=True)
            try:
                return run()
            except Exception as error:  # one broken configuration must not lose the others' figures
                traceback.print_exc()
                return {"error": " ".join(f"{type(error).__name__}: {error}".split())}  # one line, for the table
            finally:
                # Once the configuration's objects are out of scope (and, after a failure, its traceback's frames are
                # gone too): free them before the next one measures its peak.
                reset_accelerate_state()
                release_memory(setup.device)

        def write() -> dict:
            report = build_report(argv, setup, jpeg_stats, peak, memory, results, levers)
            write_atomically(args.out, json.dumps(report, indent=2) + "\n")
            return report

        for config in args.configs.split(","):
            results[config] = measure(TITLES[config], lambda: RUNNERS[config](setup, peak, memory))
            report = write()
        if args.levers:
            levers["defaults"] = results.get("model_step") or measure(
                "model step, defaults", lambda: run_ours("model_step", setup, peak, memory))
            for name in args.levers:
                lever = LEVERS[name]
                device_type = setup.device.type
                variant = lever.flip(DEFAULTS, device_type)
                skipped = lever.unavailable(device_type)
                if skipped:
                    print(f"vit_finetune bench: {lever.title} skipped: {skipped}", flush=True)
                levers[name] = {"change": lever.change(device_type), **({"skipped": skipped} if skipped else measure(
                    lever.title, lambda: run_ours("model_step", setup, peak, memory, variant, f"lever_{name}")))}
                report = write()
    print(format_table(report))
    if args.markdown:
        print("\n".join(["", "rows for docs/performance.md:", *markdown_rows(report)]))
    print(f"wrote {args.out}")
    failed = [*results.values(), *levers.values()]
    return 1 if any("error" in result for result in failed) else 0

