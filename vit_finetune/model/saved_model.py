"""A saved model found and loaded: a run's output folder, a model shipped with the package (builtin:NAME) or a Hub id,
as an image classifier in eval mode with the image processor saved beside it; a model's own Python code never runs.
"""

from __future__ import annotations

from pathlib import Path

from vit_finetune.core.errors import VitFinetuneError, shortened
from vit_finetune.core.layout import ASSETS_DIR, BUILTIN_PREFIX, CONFIG_FILE, REPO_ID_PATTERN
from vit_finetune.core.previous_run import not_a_model_because_stopped

# torch, transformers and datasets are imported where they are used: a wrong model path or output name must
# fail in a fraction of a second, before seconds of imports.


class InputError(VitFinetuneError):
    """A model, image or output that cannot be used as given; the message names it and the fix."""


def model_location(name: str) -> str:
    """A folder that exists, builtin:NAME, or a Hub id that is cached or found on the Hub.

    Anything else fails at once with "folder not found": handed to from_pretrained, a missing `outputs/run` is
    looked up as a Hub id through a minute of retries and ends in a traceback.
    """
    if name.startswith(BUILTIN_PREFIX):
        return str(ASSETS_DIR / name.removeprefix(BUILTIN_PREFIX))
    path = Path(name).expanduser()
    if path_kind(path, name, "the model") == "folder":
        if not (path / CONFIG_FILE).is_file():
            stopped = not_a_model_because_stopped(path)
            raise InputError(f"{name} is a folder but holds no config.json: "
                             + (stopped or "not a saved model. Give a run's output_dir or a Hub model id"))
        return str(path)
    not_found = f"folder not found: {name}"
    looks_local = (name.startswith((".", "/", "~")) or name.endswith("/") or name.count("/") > 1
                   or path.parent != Path(".") and path.parent.is_dir() or not REPO_ID_PATTERN.match(name))
    if looks_local:
        raise InputError(f"{not_found}. Give an existing output folder, or a Hub model id such as "
                                "google/vit-base-patch16-224")
    from vit_finetune.core.hub import unreachable_problem  # here: this module stays light to import (the CLI's --help)

    problem = unreachable_problem(name)
    if problem:
        raise InputError(f"{not_found}, and {problem}")
    return name


OWN_CODE = ("{name} ships its own Python code (an auto_map in its config), which vit_finetune never runs: it would "
            "run with your permissions. Use a model of a supported family saved with save_pretrained (no auto_map), "
            "such as a run's output_dir")


def refuse_own_code(name: str, location: str) -> None:
    """A model whose config maps its classes to its own Python code (`auto_map`) is refused, read from config.json
    alone, even when its model_type is a built-in one: loaded with the built-in class instead, it would silently not
    be the model its author wrote."""
    from transformers import PretrainedConfig

    try:
        raw, _ = PretrainedConfig.get_config_dict(location)
    except (OSError, ValueError):  # unreadable: loading it says why
        return
    if isinstance(raw, dict) and raw.get("auto_map"):
        raise InputError(OWN_CODE.format(name=name))


def load_classifier(name: str, device: str = "cpu", eager_attention: bool = False):
    """(model in eval mode on `device`, its saved image processor). Eager attention returns attention weights,
    which explain needs and training never does (it is slower).

    A model's own Python code (an `auto_map` in its config) never runs: trust_remote_code is False, not left unset,
    so transformers refuses instead of asking on stdin, where a piped `yes` would have run it."""
    from safetensors import SafetensorError
    from transformers import AutoImageProcessor, AutoModelForImageClassification
    from transformers.utils import SAFE_WEIGHTS_NAME

    location = model_location(name)
    refuse_own_code(name, location)
    extra = {"attn_implementation": "eager"} if eager_attention else {}
    try:
        model = AutoModelForImageClassification.from_pretrained(location, trust_remote_code=False, **extra)
        processor = AutoImageProcessor.from_pretrained(location, trust_remote_code=False)
    except SafetensorError as error:
        raise InputError(f"{name}: its weights file {SAFE_WEIGHTS_NAME} is damaged or incomplete ({error}); "
                         "copy or download the model again") from None
    except (OSError, ValueError) as error:
        if "trust_remote_code" in str(error):
            raise InputError(OWN_CODE.format(name=name)) from None
        raise InputError(f"{name} could not be loaded as an image classifier: {shortened(error, 400)}") from None
    return model.to(device).eval(), processor


def path_kind(path: Path, given: str, what: str) -> str:
    """'folder', 'file' or 'missing'; a path the system refuses to look up (a name over 255 bytes, a loop of
    links) is an InputError naming it, not an OSError from deep inside a glob."""
    try:
        return "folder" if path.is_dir() else "file" if path.exists() else "missing"
    except OSError as error:
        shown = given if len(given) <= 120 else given[:60] + "..." + given[-40:]
        raise InputError(f"{what} {shown!r} cannot be looked up: {error.strerror or error}; give a shorter or "
                         "valid path") from None
