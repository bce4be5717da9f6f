"""Test-only: Accelerate 1.15 set up FSDP2 on CPU processes over gloo, as it does on GPUs.

Accelerate turns an FSDP config into FSDP only for GPU-like devices; with CPU processes it keeps DDP
(MULTI_CPU) and drops its fsdp_plugin, without a word (the toolkit refuses that: vit_finetune/training/sharding.py).
PyTorch's FSDP2 itself runs on CPU over gloo, and so do Accelerate's FSDP2 code paths (prepare's fully_shard,
sharded save_state/load_state through torch.distributed.checkpoint, get_state_dict) once its state says FSDP.
This stands in for the GPU machine the tests do not have: it changes only the two lines of Accelerate's state
that a GPU would have set. Loaded by tests/observed_site/sitecustomize.py when VIT_FINETUNE_FSDP_ON_CPU is set.
"""

from __future__ import annotations

ENV = "VIT_FINETUNE_FSDP_ON_CPU"


def install() -> None:
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # later AcceleratorState()s copy it
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init
