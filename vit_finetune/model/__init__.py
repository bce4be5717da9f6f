"""The model: a pretrained ViT-family model loaded and moved to a new resolution once (loading, positions, families),
its new head, LoRA adapters (lora) or a student cut from its blocks (student), compiled (compiling, speedups) at the
precision the hardware runs best (precision), checked to fit in memory (memory), and a saved model found again
(saved_model).
"""
