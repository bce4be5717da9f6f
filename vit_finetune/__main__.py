"""`python -m vit_finetune` and `accelerate launch -m vit_finetune` enter here."""

import sys

from vit_finetune.cli import main

sys.exit(main())
