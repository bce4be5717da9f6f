"""`python -m vit_finetune` and `accelerate launch -m vit_finetune` enter here."""

import sys

from .cli import main

sys.exit(main())
