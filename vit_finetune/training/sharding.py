"""Sharded training (FSDP, DeepSpeed ZeRO) as asked for by Accelerate's own config file.

`accelerate launch --config_file recipes/accelerate/fsdp_full_shard.yaml -m vit_finetune --recipe R` tells every
process, through the environment, which engine to use; Accelerate then shards the model in `prepare`. This module
says which engine was asked for, refuses what does not go with sharding before any work, checks that Accelerate
really set it up (on a machine without GPUs it quietly falls back to DDP), and gathers the full weights at the end.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import accelerate
import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DistributedType
from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

from vit_finetune.core.errors import VitFinetuneError
from vit_finetune.model.loading import family_of
from vit_finetune.model.lora import apply_lora, is_lora
from vit_finetune.recipe import Recipe

# The environment variable `accelerate launch` sets from the config's distributed_type, and the type it must yield.
ENGINES = {
    "FSDP": ("ACCELERATE_USE_FSDP", DistributedType.FSDP),
    "DeepSpeed": ("ACCELERATE_USE_DEEPSPEED", DistributedType.DEEPSPEED),
}
DDP_CONFIG = "recipes/accelerate/ddp.yaml"


class ShardingError(VitFinetuneError):
    """A sharded run that cannot work as asked, with the reason and the fix."""


def requested_engine() -> str | None:
    """The sharding engine the launch asked for ("FSDP", "DeepSpeed"), or None."""
    for name, (variable, _type) in ENGINES.items():
        if os.environ.get(variable, "false").lower() == "true":
            return name
    return None


def is_sharded(accelerator: Accelerator) -> bool:
    """Whether the model's weights are split over the processes (every process must then join a full gather)."""
    return accelerator.distributed_type in {distributed_type for _variable, distributed_type in ENGINES.values()}


def refuse_unsupported(recipe: Recipe, engine: str | None) -> None:
    """Before anything starts: settings that keep a full copy of the weights, or compile before sharding."""
    if engine is None:
        return
    t = recipe.train
    copies = [f"{key}={value}" for key, value in (("train.ema_decay", t.ema_decay), ("train.keep_best", t.keep_best))
              if value is not None]
    if copies:
        raise ShardingError(
            f"{' and '.join(copies)} keep a full copy of the weights on every process, which {engine} shards to save "
            "that very memory; they are not supported with sharding. Fix: drop them (train.ema_decay=null "
            f"train.keep_best=null), or launch with {DDP_CONFIG} if the model fits one device")
    if engine == "DeepSpeed":
        _refuse_unsupported_zero3(DeepSpeedPlugin())  # the plugin Accelerate builds from the launch's environment
    if recipe.model.compile in (True, "regional"):
        raise ShardingError(
            f"model.compile={str(recipe.model.compile).lower()} with {engine}: the model must be compiled after it is sharded, which Accelerate does. "
            "Fix: set model.compile=auto and add `dynamo_config: {dynamo_backend: INDUCTOR}` to the Accelerate "
            "config file")


def _refuse_unsupported_zero3(plugin: DeepSpeedPlugin) -> None:
    if plugin.zero3_init_flag:
        raise ShardingError(
            "the Accelerate config asks for zero3_init_flag=true (ZeRO-3's default when the key is left out): each "
            "model partitioned as it is built. The toolkit builds the model whole on every process (it resizes the "
            "head, resamples the position embeddings, adds LoRA) and DeepSpeed partitions it as training starts. "
            "Fix: set zero3_init_flag: false under deepspeed_config in the config file")
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    if plugin.hf_ds_config.is_zero3() and not zero.get("stage3_gather_16bit_weights_on_model_save"):
        # Accelerate's get_state_dict would stop on it after the training, when the final model is gathered.
        raise ShardingError(
            "the Accelerate config leaves zero3_save_16bit_model false under ZeRO-3: DeepSpeed could not gather the "
            "trained weights into the final model at the end. Fix: set zero3_save_16bit_model: true under "
            "deepspeed_config in the config file (stage3_gather_16bit_weights_on_model_save in a DeepSpeed JSON)")


def could_not_set_up(engine: str, error: RuntimeError) -> ShardingError:
    """Accelerate's own failure to build its Accelerator for `engine` (FSDP1 on a machine without GPUs), explained."""
    return ShardingError(f"Accelerate could not set up {engine} on this machine ({error}). {_on_cpu_advice(engine)}")


def check_set_up(engine: str | None, accelerator: Accelerator, recipe: Recipe) -> None:
    """The launch asked for `engine`: refuse to go on if Accelerate set up something else (it falls back silently),
    or if the Accelerate config overrides what the recipe says about accumulation or clipping."""
    if engine is not None and accelerator.distributed_type != ENGINES[engine][1]:
        raise ShardingError(f"the Accelerate config asks for {engine}, but Accelerate set up "
                            f"{accelerator.distributed_type.value} on this machine, which would train unsharded. "
                            f"{_on_cpu_advice(engine)}")
    t = recipe.train
    # `accelerate launch` exports the config's gradient_accumulation_steps, and Accelerate prefers it to ours.
    if accelerator.gradient_accumulation_steps != t.grad_accum:
        raise ShardingError(f"the Accelerate config sets gradient_accumulation_steps="
                            f"{accelerator.gradient_accumulation_steps} but the recipe has train.grad_accum="
                            f"{t.grad_accum}. Fix: make them equal (edit the config file, or pass "
                            f"train.grad_accum={accelerator.gradient_accumulation_steps})")
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        clipping = accelerator.state.deepspeed_plugin.deepspeed_config.get("gradient_clipping")
        if clipping != t.max_grad_norm and not (clipping in (None, 0, 0.0) and t.max_grad_norm is None):
            raise ShardingError(f"DeepSpeed clips gradients itself, with the config's gradient_clipping={clipping}, "
                                f"but the recipe has train.max_grad_norm={t.max_grad_norm}. Fix: make them equal")


def _on_cpu_advice(engine: str) -> str:
    return (f"Accelerate {accelerate.__version__} runs {engine} on GPUs only. Fix: on a machine without GPUs train "
            f"with DDP (torchrun --nproc_per_node N -m vit_finetune ...); keep the {engine} config for a GPU machine")


@contextmanager
def models_built_whole(accelerator: Accelerator) -> Iterator[None]:
    """Every model built inside is whole on each process, under DeepSpeed ZeRO-3 too, which partitions it in prepare.

    Accelerate hands transformers the DeepSpeed config whatever the config file's zero3_init_flag says (Accelerate
    1.15), and under ZeRO-3 transformers then partitions each model as from_pretrained builds it (deepspeed.zero.Init).
    The toolkit resizes the head, resamples the position embeddings and adds LoRA on the whole model, and one process
    loads first while the others wait (processes.local_main_first): a partitioned build's collectives would wait
    for those processes forever.
    """
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or not is_deepspeed_zero3_enabled():
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()  # Accelerate's own call: transformers sees the config again


def unsharded_model(trained: torch.nn.Module, recipe: Recipe, full_state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain copy of the trained model on the CPU holding `full_state` (the gathered weights), with its LoRA
    adapter if it has one: what save_pretrained and peft's merge work on, which a sharded model is not."""
    config = (trained.get_base_model() if is_lora(trained) else trained).config
    plain = family_of(config).model_class()(config)
    if recipe.model.lora is not None:
        plain = apply_lora(plain, recipe.model.lora)
    plain.load_state_dict(full_state, strict=True)  # strict: every tensor comes from the trained model
    return plain
