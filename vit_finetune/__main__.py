"""`python -m vit_finetune` and `accelerate launch -m vit_finetune` enter here."""

from vit_finetune.cli import main_exit

main_exit()
