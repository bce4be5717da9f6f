"""Test-only: a rank that asks `vit_finetune.core.processes.unshared_folder_refusal` about two folders (run as
`-m shared_folder_probe ROOT`; tests/test_launch.py).

ROOT/shared is one folder for every rank; ROOT/rank-<N> is each rank's own, which is what one output_dir path is on
machines without a shared filesystem. Each rank writes its answers to ROOT/answer-<N>.json: one file per rank, as two
processes printing to one pipe can interleave their lines.
"""

import json
import sys
from pathlib import Path

from accelerate import Accelerator

from vit_finetune.core.processes import unshared_folder_refusal

accelerator = Accelerator(cpu=True)
root = Path(sys.argv[1])
shared = unshared_folder_refusal(accelerator, root / "shared", ".check", patience_s=0.5)
own = unshared_folder_refusal(accelerator, root / f"rank-{accelerator.process_index}", ".check", patience_s=0.5)
answer = {"rank": accelerator.process_index, "shared": shared, "own": own}
(root / f"answer-{accelerator.process_index}.json").write_text(json.dumps(answer))
accelerator.wait_for_everyone()
accelerator.end_training()  # the process group ends together, not torn down by the first process to exit
