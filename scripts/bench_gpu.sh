#!/usr/bin/env bash
# The GPU benchmark (python -m vit_finetune.bench), in two halves, for a GPU machine that reaches no package index.
#
# 1. Here, on a machine that reaches PyPI, from the repository root:
#        bash scripts/bench_gpu.sh fetch
#    downloads into .whl/ (git-ignored) the wheels the GPU image lacks, pinned to the versions installed here.
# 2. On the GPU machine, with .whl/ copied beside the repository and $OUT naming a folder for the results:
#        bash scripts/bench_gpu.sh run                     # every configuration, CUDA defaults
#        bash scripts/bench_gpu.sh run --configs end_to_end --steps 20 --profile "$OUT"   # profiler tables
#        bash scripts/bench_gpu.sh test                    # the CUDA smoke test in tests/test_bench.py
#    `run` writes bench.json, bench.log and nvidia-smi.txt into $OUT; arguments after `run` go to the bench.
set -euo pipefail
cd "$(dirname "$0")/.."

# Missing from the GPU image: datasets and evaluate with their needs (dill, multiprocess; fsspec and pyarrow in
# the versions datasets accepts) and pydantic, which the recipe schema uses (with the typing-extensions its core
# imports Sentinel from). The image's Python is 3.12.
PACKAGES=(datasets evaluate dill multiprocess fsspec pyarrow pydantic pydantic-core annotated-types typing-inspection
          typing-extensions)

fetch() {
    local pins=() name version
    for name in "${PACKAGES[@]}"; do
        version=$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") || {
            echo "bench_gpu.sh: $name is not installed here; run 'make install' first" >&2; exit 1; }
        pins+=("$name==$version")
    done
    rm -rf .whl && mkdir -p .whl
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
    du -ch .whl/*.whl | tail -1
    echo "bench_gpu.sh: wheels ready in .whl/"
}

install_wheels() {
    ls .whl/*.whl >/dev/null 2>&1 || {
        echo "bench_gpu.sh: no wheels in .whl/; run 'bash scripts/bench_gpu.sh fetch' here and carry .whl" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    # Everything is local: a random-weight ViT and generated JPEGs; nothing may reach for the Hub.
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
    export VIT_FINETUNE_CACHE=${VIT_FINETUNE_CACHE:-/tmp/vit_finetune_cache}
    python3 -c "import importlib.metadata as m
for n in ('torch', 'transformers', 'accelerate', 'peft', 'torchvision', 'datasets', 'evaluate', 'pyarrow', 'pydantic'):
    print(n, m.version(n))"
}

case "${1:-run}" in
    fetch)
        fetch
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
        python3 -m pytest -q -p no:cacheprovider tests/test_bench.py "$@"
        ;;
    *)
        echo "usage: bash scripts/bench_gpu.sh fetch | run [bench arguments] | test [pytest arguments]" >&2
        exit 2
        ;;
esac
