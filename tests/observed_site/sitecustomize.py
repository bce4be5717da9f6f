"""Loaded by every interpreter started with this folder on PYTHONPATH (tests only): see tests/recorder.py,
tests/fsdp_on_cpu.py and tests/deepspeed_on_cpu.py."""

import os

if os.environ.get("VIT_FINETUNE_RECORD"):
    import recorder

    recorder.install_in_subprocess(os.environ["VIT_FINETUNE_RECORD"])

if os.environ.get("VIT_FINETUNE_FSDP_ON_CPU"):
    import fsdp_on_cpu

    fsdp_on_cpu.install()

if os.environ.get("VIT_FINETUNE_DEEPSPEED_ON_CPU"):
    import deepspeed_on_cpu

    deepspeed_on_cpu.install()
