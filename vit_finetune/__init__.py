"""vit_finetune: fine-tune Vision Transformers from the Hugging Face Hub at a new resolution."""

__version__ = "0.1.0"
