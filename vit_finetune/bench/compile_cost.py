"""What compiling costs and gains, per compile mode, cold and warm: the figures model.compile=auto decides from
(compiling.MEASURED).

    python -m vit_finetune.bench.compile_cost                                # CUDA: ViT-B/16 at 384 px, bf16, batch 128
    python -m vit_finetune.bench.compile_cost --device cpu --model vit-b16-384 --image-size 224 --batch-size 8

Each mode (compiling.MODES: the whole model, or each block on its own) runs twice, each time in a fresh process:
first with an empty compile cache (cold), then with the cache the first one left (warm: a second run of the same
model). A process trains the model eagerly for a few steps, then compiles it through the training path's own seam
(compiling.compile_for_training, attention kept out) and trains on: the compile's cost is its first compiled step
less a compiled step, its gain the compiled steps' rate over eager's; then one evaluation forward (no gradients)
compiles the evaluation's graphs, timed the same way. Steps run on random pixels already on the device, with the
fused AdamW, under bf16 autocast on CUDA. The report (JSON) ends with the entry of compiling.MEASURED each mode's
cold figures would make.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from vit_finetune.bench.device import PeakMemory, synchronize
from vit_finetune.bench.flops import MODELS
from vit_finetune.model import compiling

DEFAULTS = {"cuda": {"model": "vit-b16-384", "batch_size": 128, "precision": "bf16", "steps": 8},
            "cpu": {"model": "tiny", "batch_size": 8, "precision": "no", "steps": 3}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vit_finetune.bench.compile_cost",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--model", choices=sorted(MODELS), help="default: vit-b16-384 on CUDA, tiny on CPU")
    parser.add_argument("--image-size", type=int, help="default: the model's own")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--steps", type=int, help="eager and compiled steps timed, after one of each untimed")
    parser.add_argument("--modes", default=",".join(dict.fromkeys(compiling.MODES.values())),
                        help="comma-separated compile modes")
    parser.add_argument("--out", type=Path, default=Path("bench_out/compile_cost.json"))
    parser.add_argument("--one", metavar="MODE", help=argparse.SUPPRESS)  # a single measurement, in this process
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    known = set(compiling.MODES.values())
    if not modes or not set(modes) <= known:
        parser.error(f"--modes={args.modes!r}: choose from {','.join(sorted(known))}")
    args.modes = modes
    for name in ("image_size", "batch_size", "steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    args.device = device
    for name, value in DEFAULTS[device].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


def timed_step(step, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def measure_one(args: argparse.Namespace) -> dict:
    """One process's measurement of `args.one`: eager steps, the compile, compiled steps, an evaluation's compile."""
    from transformers import ViTForImageClassification

    device = torch.device(args.device)
    spec = MODELS[args.model]
    config = spec.vit_config()
    config.image_size = args.image_size or spec.image_size
    torch.manual_seed(0)
    model = ViTForImageClassification(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    pixels = torch.randn(args.batch_size, 3, config.image_size, config.image_size, device=device)
    labels = torch.randint(0, config.num_labels, (args.batch_size,), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    memory = PeakMemory(device)

    def train_step(network):
        def step():
            with autocast:
                loss = network(pixel_values=pixels, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step

    def eval_forward(network):
        def forward():
            with torch.no_grad(), autocast:
                network(pixel_values=pixels)
        return forward

    eager = train_step(model)
    timed_step(eager, device)
    memory.reset()
    eager_s = median([timed_step(eager, device) for _ in range(args.steps)])
    eager_memory = memory.read_gib()
    model.eval()
    eval_eager_s = median([timed_step(eval_forward(model), device) for _ in range(3)][1:])
    model.train()
    torch._dynamo.utils.counters.clear()
    compiled_model, said = compiling.compile_for_training(model, args.one)
    compiled = train_step(compiled_model)
    memory.reset()
    first_s = timed_step(compiled, device)
    compiled_s = median([timed_step(compiled, device) for _ in range(args.steps)])
    compiled_memory = memory.read_gib()
    compiled_model.eval()
    evaluate = eval_forward(compiled_model)
    eval_first_s = timed_step(evaluate, device)
    eval_compiled_s = median([timed_step(evaluate, device) for _ in range(2)])
    stats = torch._dynamo.utils.counters
    return {
        "mode": args.one, "compiled": said, "work_per_image": compiling.work_per_image(model, config.image_size), "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "compile_s": first_s - compiled_s, "first_compiled_step_s": first_s,
        "eager_step_ms": 1000 * eager_s, "compiled_step_ms": 1000 * compiled_s, "speedup": eager_s / compiled_s,
        "eager_images_per_s": args.batch_size / eager_s, "compiled_images_per_s": args.batch_size / compiled_s,
        "eager_peak_memory_gib": eager_memory, "compiled_peak_memory_gib": compiled_memory,
        "memory": compiled_memory / eager_memory,
        "eval_compile_s": eval_first_s - eval_compiled_s, "eval_speedup": eval_eager_s / eval_compiled_s,
        "unique_graphs": stats["stats"]["unique_graphs"],
        "graph_breaks": sum(stats["graph_break"].values()),
    }


def run_fresh(args: argparse.Namespace, mode: str, cache: Path) -> dict:
    """measure_one in a new interpreter whose compile cache is `cache`: nothing compiled in this process helps it."""
    command = [sys.executable, "-m", "vit_finetune.bench.compile_cost", "--one", mode, "--device", args.device,
               "--model", args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    if args.image_size:
        command += ["--image-size", str(args.image_size)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # --device cpu on a GPU machine
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        return {"mode": mode, "error": " ".join(result.stderr.strip().splitlines()[-1:]) or f"exit {result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def measured_entry(args: argparse.Namespace, cold: dict) -> str:
    """The compiling.MEASURED entry these cold figures make, for a reader to copy once they are in the docs."""
    precision = "bf16" if args.precision == "bf16" else "float32"
    where = f"{device_name(args.device)}, {args.model} at {args.image_size or MODELS[args.model].image_size} px, " \
            f"{precision}, batch {args.batch_size}, {time.strftime('%Y-%m-%d')}"
    return (f'("{args.device}", "{cold["mode"]}"): CompileCost("{where}", {cold["compile_s"]:.1f}, '
            f'{cold["speedup"]:.3f}, {cold["eager_images_per_s"]:.1f}, {cold["work_per_image"]:.0f}, {cold["memory"]:.2f})')


def device_name(device_type: str) -> str:
    return torch.cuda.get_device_name() if device_type == "cuda" else f"CPU ({os.cpu_count()} cores)"


def format_table(report: dict) -> str:
    lines = [f"{'mode':10s} {'cache':6s} {'compile s':>10s} {'eval compile s':>15s} {'eager ms':>9s} "
             f"{'compiled ms':>12s} {'speed-up':>9s} {'memory':>7s} {'graphs':>7s}"]
    for mode, runs in report["modes"].items():
        for cache, figures in runs.items():
            if "error" in figures:
                lines.append(f"{mode:10s} {cache:6s} failed: {figures['error'][:200]}")
                continue
            lines.append(f"{mode:10s} {cache:6s} {figures['compile_s']:10.2f} {figures['eval_compile_s']:15.2f} "
                         f"{figures['eager_step_ms']:9.1f} {figures['compiled_step_ms']:12.1f} "
                         f"{figures['speedup']:8.3f}x {figures['memory']:6.2f}x {figures['unique_graphs']:7d}")
    return "\n".join(lines + [f"  {entry}" for entry in report["measured_entries"]])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.one:
        print(json.dumps(measure_one(args)))
        return 0
    report = {"command": " ".join(["python -m vit_finetune.bench.compile_cost", *(argv or sys.argv[1:])]),
              "device": device_name(args.device), "model": args.model, "image_size": args.image_size,
              "batch_size": args.batch_size, "precision": args.precision, "steps": args.steps,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "modes": {}, "measured_entries": []}
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix=f"compile-cache-{mode}-") as cache:
            print(f"compile_cost: {mode}, cold cache ...", flush=True)
            cold = run_fresh(args, mode, Path(cache))
            print(f"compile_cost: {mode}, warm cache ...", flush=True)
            warm = run_fresh(args, mode, Path(cache))
        report["modes"][mode] = {"cold": cold, "warm": warm}
        if "error" not in cold:
            report["measured_entries"].append(measured_entry(args, cold))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"wrote {args.out}")
    return 1 if any("error" in run for runs in report["modes"].values() for run in runs.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
