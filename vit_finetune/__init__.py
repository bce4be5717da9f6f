"""vit_finetune: fine-tune Vision Transformers from the Hugging Face Hub at a new resolution.

From Python (a notebook): load_recipe, train, predict, evaluate, push (api.py); VitFinetuneError is what each raises
for a user's mistake, with the message the CLI prints. Callbacks to observe a run: vit_finetune.callbacks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import VitFinetuneError

if TYPE_CHECKING:
    from .api import Pushed, TrainResult, evaluate, load_recipe, predict, push, train

__version__ = "0.1.0"
__all__ = ["Pushed", "TrainResult", "VitFinetuneError", "evaluate", "load_recipe", "predict", "push", "train"]
API = {"Pushed", "TrainResult", "evaluate", "load_recipe", "predict", "push", "train"}


def __getattr__(name: str):
    """The API's names load on first use: `python -m vit_finetune` imports this package before its --help answers,
    and api.py loads the recipe's schema (pydantic)."""
    if name in API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'vit_finetune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
