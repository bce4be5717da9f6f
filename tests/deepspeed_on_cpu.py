"""Test-only: Accelerate 1.15 set up DeepSpeed ZeRO on CPU processes over gloo, as it does on GPUs.

On a machine without GPUs the toolkit asks Accelerate for CPU processes (cpu=True); Accelerate then keeps DDP
(MULTI_CPU) and leaves a DeepSpeed config unused, without a word (the toolkit refuses that: vit_finetune/training/sharding.py).
DeepSpeed itself runs ZeRO-2 and ZeRO-3 on CPU (its CPU accelerator, over the gloo process group Accelerate has
started), and so do Accelerate's DeepSpeed code paths (prepare's deepspeed.initialize, save_state/load_state through
the engine's own checkpoints, get_state_dict's gather) once its state says DEEPSPEED. This stands in for the GPU
machine the tests do not have: it sets the fields of Accelerate's state that AcceleratorState.__init__ sets for
DeepSpeed on a GPU, and leaves out the one thing DeepSpeed's CPU accelerator has and its GPU one has not: a
shared-memory all-reduce for tensor-parallel inference, which DeepSpeed compiles with ninja at its first use on a
machine (about 140 CPU-seconds, measured) and training never calls. Loaded by tests/observed_site/sitecustomize.py
when VIT_FINETUNE_DEEPSPEED_ON_CPU is set.
"""

from __future__ import annotations

import os

ENV = "VIT_FINETUNE_DEEPSPEED_ON_CPU"


def install() -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's own choice here, said rather than guessed with a warning
    import deepspeed.ops
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # DeepSpeed's own table of what it may build
    original = AcceleratorState.__init__

    def init(self, *args, deepspeed_plugin=None, **kwargs):
        original(self, *args, deepspeed_plugin=deepspeed_plugin, **kwargs)
        if deepspeed_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED  # later states copy it
            self.distributed_type = DistributedType.DEEPSPEED
            # As on a GPU: the precision goes into DeepSpeed's config, and Accelerate's own autocast is off.
            deepspeed_plugin.set_mixed_precision(self._mixed_precision)
            deepspeed_plugin.select(_from_accelerator_state=True)
            self._mixed_precision = "no"
            self.deepspeed_plugins = deepspeed_plugin

    AcceleratorState.__init__ = init
