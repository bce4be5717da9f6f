"""Benchmark: images/s, MFU, peak memory and data-wait share of our training, beside the transformers Trainer.

    python -m vit_finetune.bench                                   # every configuration, defaults for the device
    python -m vit_finetune.bench --configs end_to_end,peer --batch-size 64 --steps 30 --out bench_out/b64.json
    python -m vit_finetune.bench --configs model_step --levers all   # then each lever of our step changed alone

Each configuration trains `--steps` steps after `--warmup` steps (compilation and autotuning happen there):
  model_step  our step (loop.train_loop over build.run_parts, devices.prepare) on batches already on the device;
  end_to_end  the same run from JPEGs on disk through our decode, crop-before-resize augmentation and loaders;
  lora        end_to_end with model.lora (peft, r=16 on query/value);
  peer        transformers.Trainer as its image-classification example uses it: per-sample transforms set with
              `set_transform`, float32 collation, bf16=True, SDPA attention, the same workers, batch and model;
  data_ours, data_peer  each one's training loader drained alone, no model: the rate its workers can feed.
With --levers, our model step again with one lever changed at a time (levers.py): compile, each block compiled, the
step's speed-ups (vit_finetune/model/speedups.py: fused qkv, one cast per LayerNorm output, the flash kernel), fused AdamW,
the NaN check read after every step, twice the batch; each row beside the defaults' row of the same run.
On CUDA the model is ViT-B/16 at 384 px (random weights: speed does not depend on them, and the machine may be
offline) over ~512 px JPEGs sized like Food-101's; on CPU a tiny ViT, so the command is testable anywhere.
The bench synchronises the device only where the measured window opens and closes; the loops keep their own syncs.

Modules, in the order a run uses them: cli (arguments, the run), workload (inputs written once), flops (model
cost), device (peak, memory), timing (the measured window), levers (what --levers changes), ours / peer (the
configurations), report. Commands of their own: compile_cost (what compiling costs and gains, cold and warm),
whole_job (the main recipe's job against the Trainer's, each a whole process), inference (evaluation and predict
against Trainer.evaluate and pipeline()), summary (every figure of `bash scripts/bench_gpu.sh all`), scale (a
cluster's needs from one GPU's rate).
"""

from vit_finetune.bench.cli import CONFIGS, main
from vit_finetune.bench.flops import MODELS, ModelSpec, training_flops_per_image, vit_macs

__all__ = ["CONFIGS", "MODELS", "ModelSpec", "main", "training_flops_per_image", "vit_macs"]
