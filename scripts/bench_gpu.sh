#!/usr/bin/env bash
# The GPU measurements, in two halves, for a GPU machine that reaches no package index.
#
# 1. Here, on a machine that reaches PyPI, from the repository root:
#        bash scripts/bench_gpu.sh fetch
#    downloads into .whl/ (git-ignored) the wheels the GPU image lacks, pinned to the versions installed here.
# 2. On the GPU machine, with .whl/ copied beside the repository and $OUT naming a folder for the results:
#        bash scripts/bench_gpu.sh all                     # the figures of docs/performance.md, in under 8 minutes
#        bash scripts/bench_gpu.sh more                    # profiler tables, fp16 against bf16, the other compile
#        bash scripts/bench_gpu.sh run                     # every configuration of the bench, CUDA defaults
#        bash scripts/bench_gpu.sh run --configs end_to_end --steps 20 --profile "$OUT"   # profiler tables
#        bash scripts/bench_gpu.sh test                    # the CUDA tests (pytest -m gpu)
#    `all` runs, each step at most what is left of DEADLINE_S (480 s), the rest skipped and said: compile_cost.json
#    (the whole model and each block compiled, cold and warm cache: what model.compile=auto decides from);
#    bench.json (the model step with the defaults, then each speed-up lever alone); whole_job.json (the main recipe's
#    job, 20,000 images x 2 epochs, against the Trainer's, each a whole process); inference.json (evaluation against
#    Trainer.evaluate, predict against pipeline()); the CUDA tests; then summary.txt, the rows for
#    docs/performance.md (python -m vit_finetune.bench.summary "$OUT"); all.log holds everything printed.
#    `more` writes profile_model_step.txt and profile_lever_compile.txt (profiler tables of the default step and of the
#    other model.compile setting), precision.json (200 steps in fp16 and in bf16) and bench_other_compile.json (end to
#    end and LoRA with model.compile flipped from what auto chooses for a long run), and resolution_whole.json and
#    resolution_schedule.json (run_info.json of 300 steps at 384 px throughout, and of the same steps with 70 % of them
#    at 224 px: train.resolution_schedule; their wall times are in more.log).
#    `run` writes bench.json, bench.log and nvidia-smi.txt into $OUT; arguments after `run` go to the bench.
#    On a machine without CUDA, `all` and `more` run the same steps on the CPU (tiny model, few steps): a dry run.
#    PLAN=cuda (or PLAN=cpu) prints the commands `all` and `more` run on that device instead of running them
#    (tests/test_bench.py parses them).
set -euo pipefail
cd "$(dirname "$0")/.."

# Missing from the GPU image (it has torch, accelerate, peft, huggingface_hub 1.x, pyarrow, torchvision, timm, pandas,
# requests, tokenizers): transformers, whose 5.17 there is below the package's floor (5.18), datasets and evaluate
# with their needs (dill, multiprocess, xxhash; fsspec in the versions datasets accepts), kornia with its Rust core,
# pydantic with its core (and the typing-extensions that core imports Sentinel from), httpx2 with what it brings
# (for huggingface_hub 2.x's client), and matplotlib with its own (a run's pictures, drawn at its end: the whole job
# times them; the image's own, if it has one, is shadowed by the same version). The image's Python is 3.12.
PACKAGES=(transformers datasets evaluate dill multiprocess xxhash fsspec kornia kornia-rs pydantic pydantic-core
          annotated-types typing-inspection typing-extensions httpx2 httpcore2 truststore
          matplotlib contourpy cycler fonttools kiwisolver pyparsing python-dateutil six)
PYTHON_VERSION=${PYTHON_VERSION:-3.12}  # of the GPU image; another only to try the wheels on another Python
export VIT_FINETUNE_CACHE=${VIT_FINETUNE_CACHE:-/tmp/vit_finetune_cache}  # the bench's data, base and compiled code

fetch() {
    local pins=() name version
    for name in "${PACKAGES[@]}"; do
        version=$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") || {
            echo "bench_gpu.sh: $name is not installed here; run 'make install' first" >&2; exit 1; }
        pins+=("$name==$version")
    done
    rm -rf .whl && mkdir -p .whl
    python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
    du -ch .whl/*.whl | tail -1
    echo "bench_gpu.sh: wheels ready in .whl/"
}

install_wheels() {
    ls .whl/*.whl >/dev/null 2>&1 || {
        echo "bench_gpu.sh: no wheels in .whl/; run 'bash scripts/bench_gpu.sh fetch' here and carry .whl" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
    # Everything is local: a random-weight ViT, generated JPEGs and shapes; nothing may reach for the Hub.
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    python3 -c "import importlib.metadata as m
for n in ('torch', 'transformers', 'accelerate', 'peft', 'huggingface_hub', 'torchvision', 'datasets', 'evaluate',
          'kornia', 'pyarrow', 'pydantic', 'matplotlib'):
    try:
        print(n, m.version(n))
    except m.PackageNotFoundError:
        print(n, 'not installed')"
    # Fail now, naming the module, rather than minutes into the measurements.
    python3 -c "import vit_finetune.training.run, vit_finetune.bench, kornia.augmentation, matplotlib.pyplot" || {
        echo "bench_gpu.sh: the package does not import here (above: the missing module); add it to PACKAGES" >&2
        exit 1; }
}

# ------------------------------------------------------------------ all and more: every measurement, one command

DEADLINE_S=${DEADLINE_S:-480}  # 8 minutes from the start; each step gets at most what is left of it

step() {  # step SECONDS TITLE COMMAND...: run COMMAND for at most SECONDS (less if the deadline is nearer)
    local cap=$1 title=$2 left status=0
    shift 2
    if [[ -n "${PLAN:-}" ]]; then
        echo "$*"
        return 0
    fi
    left=$((DEADLINE_S - SECONDS))
    if ((left < cap)); then cap=$left; fi
    if ((cap < 10)); then
        echo "=== $title: skipped, the ${DEADLINE_S} s budget is spent"
        return 0
    fi
    echo "=== $title (at most ${cap} s; $SECONDS s so far): $*"
    # SIGINT first: the training loop stops cleanly on it; a measurement cut short keeps what its JSON already holds.
    timeout --signal=INT --kill-after=15 "$cap" "$@" || status=$?
    echo "=== $title: exit status $status after $SECONDS s in all"
}

precision_summary() {  # summary WORK OUT: both runs' loss curves, skipped steps and metrics.json, as one file
    python3 - "$1" "$2" <<'PYTHON'
import json, pathlib, sys
work, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
summary = {}
for folder in sorted(work.glob("precision-*")):
    read = lambda name: json.loads((folder / name).read_text()) if (folder / name).exists() else None
    metrics, history = read("metrics.json"), read("history.json") or []
    losses = [[entry["step"], entry["loss"]] for entry in history if "loss" in entry]
    skipped = {key: value for key, value in (metrics or {}).items() if "skip" in key and "image" not in key}
    summary[folder.name.removeprefix("precision-")] = {"finished": metrics is not None, "losses": losses,
                                                       "skipped": skipped, "metrics": metrics}
    ends = f"loss {losses[0][1]:.4f} at step {losses[0][0]} -> {losses[-1][1]:.4f} at step {losses[-1][0]}" if losses else "no loss logged"
    print(f"{folder.name}: finished {metrics is not None}; {ends}; skipped steps {skipped}")
out.write_text(json.dumps(summary, indent=1))
PYTHON
}

has_cuda() {  # PLAN=cuda or PLAN=cpu: the device whose commands are printed
    if [[ -n "${PLAN:-}" ]]; then [[ "$PLAN" == cuda ]]; return; fi
    python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"
}

start() {  # the machine and the software first; a scratch folder for what is not a result
    if [[ -n "${PLAN:-}" ]]; then
        work=/tmp/vit-gpu.PLAN
        return 0
    fi
    nvidia-smi || true
    install_wheels
    work=$(mktemp -d /tmp/vit-gpu.XXXX)
}

dry_run() {  # true without CUDA: the steps then run on the CPU with the tiny model, few images and steps
    has_cuda && return 1
    [[ -n "${PLAN:-}" ]] || echo "bench_gpu.sh: no CUDA device: a dry run of every step on the CPU (tiny model, few steps)"
}

all() {
    local work
    start
    # CUDA: ViT-B/16 at 384 px, batch 128, bf16 (each module's defaults), 20,000 + 5,000 images for the job.
    local compile=(--steps 4) job=() inference=() levers=(--warmup 2 --steps 10)
    if dry_run; then
        compile=(--steps 2) job=(--images 64 --eval-images 16) inference=(--images 64 --eval-images 16)
        levers=(--warmup 1 --steps 2 --batch-size 4)
    fi
    # In the order of the goals; the CUDA tests last: `bash scripts/bench_gpu.sh test` runs them alone if cut.
    step 90 "compile cost: the whole model and each block, cold and warm cache" \
        python3 -m vit_finetune.bench.compile_cost "${compile[@]}" --out "$OUT/compile_cost.json"
    step 100 "bench: the model step with the defaults, then each speed-up lever alone" \
        python3 -m vit_finetune.bench --configs model_step "${levers[@]}" \
        --levers regional_compile,fused_qkv,layernorm_cast,flash_attention --markdown --out "$OUT/bench.json"
    step 200 "the main recipe's job, timed whole: ours against the Trainer" \
        python3 -m vit_finetune.bench.whole_job "${job[@]}" --work "$work/whole_job" --out "$OUT/whole_job.json"
    step 60 "evaluation and predict: ours against Trainer.evaluate and pipeline()" \
        python3 -m vit_finetune.bench.inference "${inference[@]}" --out "$OUT/inference.json"
    step 120 "the CUDA tests" python3 -m pytest -q -p no:cacheprovider -m gpu $(grep -l "mark.gpu" tests/test_*.py)
    step 20 "the figures for docs/performance.md" python3 -m vit_finetune.bench.summary "$OUT" --write "$OUT/summary.txt"
    [[ -n "${PLAN:-}" ]] || { echo "=== done in $SECONDS s; in $OUT:"; ls -la "$OUT"; }
}

more() {
    local work
    start
    # The bench's defaults on CUDA: ViT-B/16 at 384 px, batch 128, bf16. The precision runs: that random-weight ViT-B
    # (which the bench writes) at 224 px on the demo's shapes, 200 optimiser steps, evaluated once at the end.
    local bench=(--warmup 3 --steps 25) profile=(--warmup 3 --steps 8) precisions=(fp16 bf16)
    local model=(model.base="$VIT_FINETUNE_CACHE/bench/base-vit-b16-384-101-v1" model.image_size=224)
    local steps=200 batch=32 workers=8 warmup=20
    if dry_run; then  # no fp16 either
        bench=(--warmup 1 --steps 2 --batch-size 4) profile=(--warmup 1 --steps 2 --batch-size 4) precisions=(bf16)
        model=(model.base="$VIT_FINETUNE_CACHE/bench/base-tiny-4-v1" model.image_size=64) steps=4 batch=8 workers=0 warmup=1
    fi
    step 90 "profiler tables: the default step and the other model.compile setting" \
        python3 -m vit_finetune.bench --configs model_step --levers compile "${profile[@]}" --profile "$OUT" \
        --out "$work/profiled.json"
    for precision in "${precisions[@]}"; do
        step 60 "$steps steps in $precision" python3 -m vit_finetune "${model[@]}" model.pretrained=false \
            data.dataset=builtin:shapes data.num_workers="$workers" train.method=finetune train.max_steps="$steps" \
            train.batch_size="$batch" train.lr=1e-4 train.warmup_steps="$warmup" train.log_every_steps=10 \
            train.eval_every_steps="$steps" train.mixed_precision="$precision" pictures=false \
            output_dir="$work/precision-$precision"
    done
    [[ -n "${PLAN:-}" ]] || precision_summary "$work" "$OUT/precision.json"
    # The resolution schedule against the whole run at the final size: the same optimiser steps and images, each run
    # a whole process; each run_info.json's resolution_stages holds every stage's seconds and images/s.
    local final=384 low=224 rsteps=300 rbatch=64
    if dry_run; then final=64 low=32 rsteps=4 rbatch=8; fi
    for arm in "whole:null" "schedule:[[$low,0.7],[$final,0.3]]"; do
        step 150 "resolution ${arm%%:*}: $rsteps steps at batch $rbatch, final size $final" python3 -m vit_finetune \
            "${model[0]}" model.image_size="$final" model.pretrained=false data.dataset=builtin:shapes \
            data.num_workers="$workers" train.method=finetune train.max_steps="$rsteps" train.batch_size="$rbatch" \
            train.lr=1e-4 train.warmup_steps="$warmup" train.log_every_steps=50 train.eval_every_steps="$rsteps" \
            train.resolution_schedule="${arm#*:}" pictures=false output_dir="$work/resolution-${arm%%:*}"
    done
    [[ -n "${PLAN:-}" ]] || for arm in whole schedule; do
        cp "$work/resolution-$arm/run_info.json" "$OUT/resolution_$arm.json" 2>/dev/null || true
    done
    # End to end and LoRA under the other compile setting: what auto's choice is worth beyond the model step.
    step 120 "end to end and LoRA, model.compile flipped from auto's choice" python3 -m vit_finetune.bench \
        --configs end_to_end,lora --compile other "${bench[@]}" --out "$OUT/bench_other_compile.json"
    [[ -n "${PLAN:-}" ]] || { echo "=== done in $SECONDS s; in $OUT:"; ls -la "$OUT"; }
}

case "${1:-run}" in
    fetch)
        fetch
        ;;
    all | more)
        : "${OUT:?OUT is unset: set OUT to the folder for the results}"
        if [[ -n "${PLAN:-}" ]]; then "$1"; exit 0; fi
        mkdir -p "$OUT"
        "$1" 2>&1 | tee "$OUT/$1.log"
        ;;
    run)
        shift || true
        : "${OUT:?OUT is unset: set OUT to the folder for bench.json, bench.log and nvidia-smi.txt}"
        install_wheels
        nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
        python3 -m vit_finetune.bench --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
        ;;
    test)
        shift || true
        install_wheels
        python3 -m pytest -q -p no:cacheprovider -m gpu $(grep -l "mark.gpu" tests/test_*.py) "$@"
        ;;
    *)
        echo "usage: bash scripts/bench_gpu.sh fetch | all | more | run [bench arguments] | test [pytest arguments]" >&2
        exit 2
        ;;
esac
