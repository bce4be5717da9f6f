"""Model: load a pretrained ViT-family model, move it to a new resolution once, give it a new head (LoRA: lora.py).

Every tensor that carries position (absolute tables, relative-bias tables) is resized a single time at load, in
float32, the way `families.py` records for the model's family, so the saved model runs at its new size with plain
`from_pretrained`, no `interpolate_pos_encoding` flag, and nothing but the classifier is ever re-initialised.
"""

from __future__ import annotations

import copy
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoImageProcessor, PretrainedConfig, PreTrainedModel
from transformers.utils import logging as transformers_logging
from transformers.models.auto.image_processing_auto import (IMAGE_PROCESSOR_MAPPING_NAMES,
                                                            get_image_processor_class_from_name)

from vit_finetune.core import hub, previous_run
from vit_finetune.core.errors import RunError, VitFinetuneError
from vit_finetune.core.layout import ASSETS_DIR, BUILTIN_PREFIX, CONFIG_FILE, REPO_ID_PATTERN
from vit_finetune.model import memory, student
from vit_finetune.model.families import FAMILIES, AbsoluteTable, Family, Geometry
from vit_finetune.model.positions import resample_position_embeddings  # noqa: F401  (re-exported: the ViT reference resampling)
from vit_finetune.recipe import ModelSettings, Recipe
from vit_finetune.recipe.limits import MAX_GRID_SIDE

# The data pipeline decodes and crops with PIL, and torchvision is not required: evaluation and every later
# pipeline() use the PIL image processors, chosen by name, so transformers 5 does not fall back to them with a
# warning, and a machine with torchvision does not resize slightly differently from the one that measured.
IMAGE_PROCESSOR_BACKEND = "pil"
# What a base's config.json may ask for, checked before transformers parses it or builds anything: a damaged or
# hostile config would otherwise make tables of any size (image_size 100000 at patch 4: a 240 GB position table),
# divide by a patch size of 0, or spend minutes parsing a million labels.
MAX_BASE_LABELS = 100_000  # ImageNet-21k's 21,843 are the most a public ViT checkpoint has
MAX_CONFIG_BYTES = 64_000_000  # a ViT's config.json is a few KB, about 1 MB with 21,843 labels


class ModelError(VitFinetuneError):
    """A base model that this toolkit cannot fine-tune as asked."""


def base_location(settings: ModelSettings) -> str:
    """The Hub id or folder to load: `builtin:NAME` names a model shipped in vit_finetune/model/assets."""
    if not settings.base.startswith(BUILTIN_PREFIX):
        return settings.base
    name = settings.base.removeprefix(BUILTIN_PREFIX)
    path = ASSETS_DIR / name
    if not (path / CONFIG_FILE).is_file():
        shipped = sorted(p.name for p in ASSETS_DIR.iterdir() if (p / CONFIG_FILE).is_file()) if ASSETS_DIR.is_dir() else []
        raise ModelError(f"model.base={settings.base!r}: no shipped model {name!r}; shipped: {shipped}")
    return str(path)


def family_of(config: PretrainedConfig, base: str = "") -> Family:
    """The family entry for this config's model_type; any other model_type is refused, naming the supported ones."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        supported = ", ".join(f"{f.name} ({t})" for t, f in FAMILIES.items())
        raise ModelError(
            f"model.base={base!r} is a {config.model_type!r} model, which this toolkit cannot fine-tune; "
            f"supported families (model_type): {supported}"
        )
    return family


def preflight(recipe: Recipe, device: torch.device) -> tuple[PretrainedConfig | None, list[VitFinetuneError]]:
    """The model's problems with a recipe, from the base's config alone (no weights): a base that is not there or
    not a supported family, a size it cannot take, a training step that cannot fit `device`. Returns the config too
    (None where it could not be read), for the rest of the run."""
    try:
        config = load_base_config(recipe.model)
    except VitFinetuneError as problem:
        return None, [problem]
    # CLIP and SigLIP keep the vision tower's sizes under vision_config, as every family entry knows.
    too_big = memory.why_it_cannot_fit(family_of(config).vision_config(config), recipe, device)
    sizes = schedule_size_problems(recipe, family_of(config).patch_size(config))
    return config, ([RunError(too_big)] if too_big else []) + sizes


def schedule_size_problems(recipe: Recipe, patch_size: int) -> list[VitFinetuneError]:
    """train.resolution_schedule's sizes that are no multiple of the base's patch size, each with the sizes that are."""
    schedule = recipe.train.resolution_schedule
    problems = []
    for size, _share in schedule if isinstance(schedule, list) else []:
        if size % patch_size:
            low, high = (size // patch_size) * patch_size, (size // patch_size + 1) * patch_size
            problems.append(ModelError(f"train.resolution_schedule size {size} is not a multiple of the base's patch "
                                       f"size {patch_size}; use {low or high} or {high}"))
    return problems


def load_base_config(settings: ModelSettings) -> PretrainedConfig:
    """Fetch only config.json and check the base is a supported family the target size suits, before any weights move."""
    location = base_location(settings)  # a ModelError of its own for an unknown builtin: name
    if not Path(location).expanduser().exists():
        could_be_hub_id = not location.startswith((".", "/", "~")) and bool(REPO_ID_PATTERN.match(location))
        problem = hub.missing_source_problem(location, "model", could_be_hub_id, settings.revision)
        if problem:
            raise ModelError(f"model.base={settings.base!r}: {problem}")
    try:
        check_config_file(location, settings)
        config = AutoConfig.from_pretrained(location, revision=settings.revision,
                                            trust_remote_code=settings.trust_remote_code)
    except (OSError, ValueError, RecursionError) as error:
        raise ModelError(
            f"model.base={settings.base!r} could not be loaded: {error}\n"
            "Fix: give a Hub id such as google/vit-base-patch16-224 or a folder holding config.json."
        ) from None
    family = family_of(config, settings.base)
    check_base_geometry(config, family, settings.base)
    check_image_size(settings.image_size, family.patch_size(config))
    check_target_grid(settings.image_size, family.patch_size(config))
    if settings.window_size is not None and family.set_window is None:
        raise ModelError(
            f"model.window_size={settings.window_size} applies to Swin and Swinv2 only; {family.name} has no "
            "attention window: remove the key or set it to null"
        )
    set_drop_path_rate(config, settings)  # a family without stochastic depth is refused before any download
    student.check(settings, config, family)  # model.keep_blocks: a family or depth that cannot be cut
    return config


def check_config_file(location: str, settings: ModelSettings) -> None:
    """The base's config.json as stored (fetched alone for a Hub id): its size and label count, before transformers
    parses it (which takes about a minute per million labels)."""
    from transformers.utils import CONFIG_NAME, cached_file

    path = cached_file(location, CONFIG_NAME, revision=settings.revision)
    if path is None:  # a local folder without the file: cached_file answers None, not an error
        stopped = previous_run.not_a_model_because_stopped(Path(location).expanduser())
        raise ModelError(f"model.base={settings.base!r} is a folder but holds no {CONFIG_NAME}: " + (
            stopped or "not a saved model. Fix: give a folder written by save_pretrained (a run's output_dir) or a "
                       "Hub id such as google/vit-base-patch16-224"))
    size = os.path.getsize(path)
    if size > MAX_CONFIG_BYTES:
        raise ModelError(f"model.base={settings.base!r}: its {CONFIG_NAME} is {size:,} bytes; a ViT's is a few KB. "
                         "It is damaged or not a model config: check the id, revision or folder")
    raw = json.loads(Path(path).read_text())
    labels = raw.get("id2label") if isinstance(raw, dict) else None
    count = len(labels) if isinstance(labels, dict) else raw.get("num_labels", 0) if isinstance(raw, dict) else 0
    if isinstance(count, int) and count > MAX_BASE_LABELS:
        raise ModelError(f"model.base={settings.base!r}: its {CONFIG_NAME} has {count:,} labels; the most a ViT "
                         f"checkpoint has is ImageNet-21k's 21,843 (this toolkit takes up to {MAX_BASE_LABELS:,}). "
                         "It is damaged or not the base meant: check the id, revision or folder")


def check_base_geometry(config: PretrainedConfig, family: Family, base: str) -> None:
    """The base's image and patch size, from its config alone: positive whole pixels, and a patch grid of a size a
    ViT has (the base model is built at it before its position table is resampled)."""
    vision = family.vision_config(config)
    for key in ("patch_size", "image_size"):
        value = getattr(vision, key, None)
        sides = list(value) if isinstance(value, (list, tuple)) else [value]
        if not sides or not all(isinstance(side, int) and not isinstance(side, bool) and side > 0 for side in sides):
            raise ModelError(f"model.base={base!r}: its config.json has {key}={value!r}, not a positive whole number "
                             "of pixels. It is damaged: check the id, revision or folder")
    image_size, patch_size = family.image_size(config), family.patch_size(config)
    grid = image_size // patch_size
    if not 1 <= grid <= MAX_GRID_SIDE:
        raise ModelError(f"model.base={base!r}: its config.json's image_size={image_size} at patch_size={patch_size} "
                         f"makes a {grid}x{grid} grid of positions; a ViT's has 1 to {MAX_GRID_SIDE} a side (DINOv2's: "
                         "37). It is damaged: check the id, revision or folder")


def set_drop_path_rate(config: PretrainedConfig, settings: ModelSettings) -> None:
    """model.drop_path_rate (stochastic depth) into the config; null keeps the base's own rate."""
    if settings.drop_path_rate is None:
        return
    if not hasattr(config, "drop_path_rate"):
        having = sorted(t for t in FAMILIES if hasattr(AutoConfig.for_model(t), "drop_path_rate"))
        raise ModelError(
            f"model.drop_path_rate={settings.drop_path_rate}: model.base={settings.base!r} is a {config.model_type!r} "
            f"model, whose config has no drop-path rate (stochastic depth). Families that have one: "
            f"{', '.join(having)}. Set model.drop_path_rate=null"
        )
    config.drop_path_rate = settings.drop_path_rate


def check_image_size(image_size: int, patch_size: int) -> None:
    if image_size % patch_size:
        low, high = (image_size // patch_size) * patch_size, (image_size // patch_size + 1) * patch_size
        raise ModelError(
            f"model.image_size={image_size} is not a multiple of the patch size {patch_size}; "
            f"use {low or high} or {high}"
        )


def check_target_grid(image_size: int, patch_size: int) -> None:
    """model.image_size's patch grid within MAX_GRID_SIDE a side, as the base's is. Attention grows with the square
    of the tokens: at 256 a side one image's forward pass through the tests' 2-block tiny ViT took 47 s on a CPU,
    at 512 (2048 px, patch 4) sixteen times the attention, in ops that Ctrl-C and SIGTERM cannot interrupt."""
    grid = image_size // patch_size
    if grid > MAX_GRID_SIDE:
        largest = MAX_GRID_SIDE * patch_size
        raise ModelError(f"model.image_size={image_size} at the base's patch size {patch_size} makes a {grid}x{grid} "
                         f"grid of patches ({grid * grid + 1:,} tokens an image); this toolkit takes at most "
                         f"{MAX_GRID_SIDE} a side. Fix: model.image_size={largest} or less, or a base with larger "
                         "patches")


@contextmanager
def report_errors_only():
    """transformers' warnings off while the base loads: its load report names the new head MISSING in a table that
    reads like an error, where the head is swapped on purpose; load_pretrained checks the loading info itself."""
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)


def load_pretrained(settings: ModelSettings, family: Family) -> PreTrainedModel:
    """The base checkpoint as the family's classification class, failing loudly if anything but the head was
    missing or reshaped. Weights the class has no place for (a distilled DeiT's teacher head, CLIP's text tower)
    are dropped."""
    try:
        with report_errors_only():
            model, info = family.model_class().from_pretrained(
                base_location(settings),
                revision=settings.revision,
                trust_remote_code=settings.trust_remote_code,
                dtype=torch.float32,  # master weights stay float32; mixed precision is autocast's job
                output_loading_info=True,
            )
    except OSError as error:  # config.json was there (load_base_config read it), the weights are not
        raise ModelError(
            f"model.base={settings.base!r}: its weights could not be loaded: {error}\n"
            "Fix: a folder needs model.safetensors (or pytorch_model.bin) beside config.json, as save_pretrained "
            "writes it; for a Hub id, check the revision holds weights"
        ) from None
    reinitialised = [
        key
        for key in [*info.get("missing_keys", []), *[m[0] if isinstance(m, tuple) else m for m in info.get("mismatched_keys", [])]]
        if not key.startswith(family.new_modules())
    ]
    if reinitialised:
        raise ModelError(
            f"model.base={settings.base!r}: these weights would be re-initialised instead of loaded: "
            f"{sorted(reinitialised)[:8]}{' ...' if len(reinitialised) > 8 else ''}. "
            f"The checkpoint does not match a {family.name} layout; check the id or revision."
        )
    return model


def target_config(base_config: PretrainedConfig, settings: ModelSettings, labels: list[str]) -> PretrainedConfig:
    """The base architecture at the target resolution (and window, when asked) with a head for `labels`."""
    family = family_of(base_config, settings.base)
    config = copy.deepcopy(base_config)
    check_image_size(settings.image_size, family.patch_size(config))
    family.set_image_size(config, settings.image_size)
    if settings.window_size is not None and settings.window_size != family.window(config):
        family.set_window(config, settings.window_size)
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: index for index, label in enumerate(labels)}
    config.architectures = [family.classification_class]
    if settings.keep_blocks is None:  # a base an earlier run cut: that record is not this run's
        student.forget_cut(config)
    set_drop_path_rate(config, settings)
    return config


def geometry(family: Family, base: PretrainedConfig, target: PretrainedConfig) -> Geometry:
    """Patch grids and windows before and after: what every position resize needs to know."""
    old, new = (family.image_size(c) // family.patch_size(c) for c in (base, target))
    return Geometry((old, old), (new, new), family.window(base), family.window(target))


def absolute_table(family: Family, state: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The family's absolute position table as (1, rows, D), if the model has one (Swin, most BEiTs: none)."""
    suffixes = tuple(r.suffix for r in family.position if isinstance(r, AbsoluteTable))
    table = next((t for k, t in state.items() if suffixes and k.endswith(suffixes)), None)
    return None if table is None else table.detach().reshape(1, -1, table.shape[-1]).clone()


class BaseTables(NamedTuple):
    """The base's own position tensors as loaded, at its own geometry (`config`): what every later size is resampled
    from (at_image_size), so no table is ever resampled from a resampled one."""

    config: PretrainedConfig
    state: dict[str, torch.Tensor]


def base_tables_of(family: Family, config: PretrainedConfig, state: dict[str, torch.Tensor]) -> BaseTables:
    return BaseTables(copy.deepcopy(config), {key: state[key].detach().float().clone()
                                              for key in family.position_keys(state)})


def build_model(settings: ModelSettings, labels: list[str],
                on_resample: Callable[[torch.Tensor | None, torch.Tensor], None] | None = None,
                keep_base: Callable[[BaseTables], None] | None = None) -> PreTrainedModel:
    """Pretrained model at `settings.image_size` with a new head for `labels` (LoRA not yet applied).

    `on_resample(before, after)` receives the absolute position table as loaded and as resampled (before is None
    for a model from random weights), e.g. to draw them; it is not called for a family without one, nor for a table
    kept at the base's own grid (nothing moved: a "before and after" would show the same table twice).
    `keep_base(tables)` receives the base's position tensors before any resample (from random weights: the model's
    own), for a run that changes size later (train.resolution_schedule).
    """
    if not settings.pretrained:
        config = target_config(load_base_config(settings), settings, labels)
        if settings.keep_blocks is not None:  # the cut student's architecture, from random weights
            config = student.with_depth(config, family_of(config), len(student.chosen_blocks(settings.keep_blocks)))
        model = family_of(config).model_class()(config).float()
        after = absolute_table(family_of(config), model.state_dict())
        if on_resample is not None and after is not None:
            on_resample(None, after)
        if keep_base is not None:
            keep_base(base_tables_of(family_of(config), config, model.state_dict()))
        return model
    family = family_of(load_base_config(settings), settings.base)
    pretrained = load_pretrained(settings, family)
    if settings.keep_blocks is not None:  # a student cut from the base's own blocks, its head kept if it fits
        pretrained = student.cut(pretrained, settings.keep_blocks, labels)
    keeps_head = settings.keep_blocks is not None and student.kept_head(pretrained.config)
    config = target_config(pretrained.config, settings, labels)
    model = family.model_class()(config).float()

    # What the family initialises with the head (BEiT's pooling norm) is in `pretrained`: loaded, or fresh there.
    state = {k: v for k, v in pretrained.state_dict().items() if keeps_head or not k.startswith(f"{family.head}.")}
    if keep_base is not None:
        keep_base(base_tables_of(family, pretrained.config, state))
    before = absolute_table(family, state)
    moved = geometry(family, pretrained.config, config)
    for resize in family.position:
        resize(state, moved)
    if on_resample is not None and before is not None and moved.old_grid != moved.new_grid:  # a table resampled
        on_resample(before, absolute_table(family, state))
    if not keeps_head:
        state.update(new_head_state(getattr(model, family.head), settings.head_init, family.head))
    model.load_state_dict(state, strict=True)  # strict: every tensor but the new head comes from the checkpoint
    return model


def at_image_size(model: nn.Module, base: BaseTables, size: int) -> dict[nn.Parameter, Callable[[torch.Tensor], torch.Tensor]]:
    """`model` (a built classifier, LoRA's wrapper too) moved in place to `size` px, as build_model would have built
    it there: each position tensor resampled from the base's own (`base`), plus what training has changed in it since
    (its difference from the base's at the current size, resampled once), and every size the modules keep (patch
    counts, grids, Swin's windows, CLIP's position ids) taken from a model built fresh at `size`. The parameters stay
    the same objects, so an optimiser keeps them. Returns, for each parameter whose shape changed, how a tensor of
    its old shape moves (an optimiser's moments)."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA's wrapper: the model inside
    family = family_of(core.config)
    if family.image_size(core.config) == size:
        return {}
    target = copy.deepcopy(core.config)
    check_image_size(size, family.patch_size(target))
    family.set_image_size(target, size)
    with report_errors_only():
        fresh = type(core)(target)
    now, after = geometry(family, base.config, core.config), geometry(family, base.config, target)
    step = geometry(family, core.config, target)

    def moved(key: str, tensor: torch.Tensor, how: Geometry) -> torch.Tensor:
        one = {key: tensor}
        for resize in family.position:
            resize(one, how)
        return one[key]

    parameters = dict(core.named_parameters())
    movers: dict[nn.Parameter, Callable[[torch.Tensor], torch.Tensor]] = {}
    for key in family.position_keys(parameters):
        parameter, table = parameters[key], base.state[key].to(parameters[key].device)
        learned = parameter.detach().float() - moved(key, table, now)  # what the steps so far changed in it
        parameter.data = (moved(key, table, after) + moved(key, learned, step)).to(parameter.dtype)
        movers[parameter] = lambda tensor, key=key: moved(key, tensor, step)
    _adopt_sizes(core, fresh, {id(old): new for old, new in _configs(core.config, target)},
                 {id(parameter) for parameter in movers})
    return movers


def _configs(old: PretrainedConfig, new: PretrainedConfig):
    """The config and its sub-configs (CLIP's vision_config), paired with their copies at the new size."""
    yield old, new
    for key, value in vars(old).items():
        if isinstance(value, PretrainedConfig):
            yield value, getattr(new, key)


def _adopt_sizes(core: nn.Module, fresh: nn.Module, configs: dict[int, PretrainedConfig], moved: set[int]) -> None:
    """Each module of `core` takes from its twin in `fresh` what depends on the size: whole-number and tuple
    attributes, buffers (position ids, relative index tables) and the config; a parameter other than the moved ones
    whose shape would change means a layout this toolkit does not know, and is refused."""
    twins = dict(fresh.named_modules())
    for name, module in core.named_modules():
        twin = twins.get(name)
        if twin is None or type(twin) is not type(module):  # a module LoRA added or wrapped: no size of its own
            continue
        for key, value in list(vars(module).items()):
            if id(value) in configs:
                setattr(module, key, configs[id(value)])
            elif (not key.startswith("_") and key != "training" and isinstance(value, (int, tuple, list))
                  and key in vars(twin) and vars(twin)[key] != value):
                setattr(module, key, copy.deepcopy(vars(twin)[key]))
        for key, buffer in module._buffers.items():
            theirs = twin._buffers.get(key)
            if buffer is not None and theirs is not None and (buffer.shape != theirs.shape or not torch.equal(buffer, theirs)):
                module._buffers[key] = theirs.to(buffer.device)
        for key, parameter in module._parameters.items():
            theirs = twin._parameters.get(key)
            if parameter is not None and id(parameter) not in moved and theirs is not None and parameter.shape != theirs.shape:
                raise ModelError(f"{name}.{key} changes shape at a new size ({tuple(parameter.shape)} -> "
                                 f"{tuple(theirs.shape)}) and is no position tensor {family_of(core.config).name} "
                                 "records: this model cannot change size during training")


def keeps_base_head(settings: ModelSettings, labels: list[str]) -> bool:
    """Whether build_model keeps the base's trained head: a student cut (model.keep_blocks) from a classifier of
    exactly `labels` (student.same_labels). Read from the base's config alone."""
    return (settings.keep_blocks is not None and settings.pretrained
            and student.same_labels(load_base_config(settings), labels))


def has_distillation_token(model: PreTrainedModel) -> bool:
    """DeiT: a second prefix token, trained (in a distilled DeiT) to predict the teacher."""
    return family_of(model.config).distilled_class is not None


def with_distillation_head(model: PreTrainedModel) -> PreTrainedModel:
    """A DeiT classifier as DeiT's distilled class: the new head becomes the class token's head and a copy of it,
    as initialised, the distillation token's. Saved, it is what pipeline() loads and runs with both heads (their
    logits averaged)."""
    family = family_of(model.config)
    config = copy.deepcopy(model.config)
    config.architectures = [family.distilled_class]
    distilled = getattr(transformers, family.distilled_class)(config).float()
    state = {}
    for key, tensor in model.state_dict().items():
        if key.startswith(f"{family.head}."):
            for head in family.distilled_heads:
                state[key.replace(family.head, head, 1)] = tensor.clone()
        else:
            state[key] = tensor
    distilled.load_state_dict(state, strict=True)  # strict: every tensor but the copied head is the student's
    return distilled


def head_names(model: nn.Module) -> tuple[str, ...]:
    """The modules that are new classifier heads: trained at train.head_lr, saved whole beside a LoRA adapter."""
    family = family_of(model.config)
    if family.distilled_class and getattr(model.config, "architectures", None) == [family.distilled_class]:
        return family.distilled_heads
    return (family.head,)


def new_head_state(head: nn.Linear, init: str, name: str = "classifier") -> dict[str, torch.Tensor]:
    weight = torch.zeros_like(head.weight) if init == "zero" else head.weight.detach().clone()
    return {f"{name}.weight": weight, f"{name}.bias": torch.zeros_like(head.bias)}


def load_image_processor(settings: ModelSettings, image_size: int):
    """The base's image processor, PIL backend, resized to the target resolution (mean/std kept from the base)."""
    location = base_location(settings)
    try:
        processor = AutoImageProcessor.from_pretrained(location, revision=settings.revision,
                                                       trust_remote_code=settings.trust_remote_code,
                                                       backend=IMAGE_PROCESSOR_BACKEND)
    except OSError:  # the base has no preprocessor_config.json: its family's defaults (ViT: mean = std = 0.5)
        config = AutoConfig.from_pretrained(location, revision=settings.revision,
                                            trust_remote_code=settings.trust_remote_code)
        family = IMAGE_PROCESSOR_MAPPING_NAMES[config.model_type]
        processor = get_image_processor_class_from_name(family[IMAGE_PROCESSOR_BACKEND])()
    return processor_at_size(processor, image_size)


def processor_at_size(processor, image_size: int):
    """The image processor resizing (and centre-cropping, where it crops) to `image_size`; changed in place."""
    processor.size = {"height": image_size, "width": image_size}
    if getattr(processor, "crop_size", None):
        processor.crop_size = {"height": image_size, "width": image_size}
    return processor


class MetaBase(NamedTuple):
    """The backbone the run fine-tunes (model.keep_blocks' cut, if any), built from the base's config on the meta
    device, which allocates nothing, and its family: what the plan reads of the base before the real one is built."""

    model: PreTrainedModel
    family: Family


def base_on_meta(settings: ModelSettings) -> MetaBase:
    config = load_base_config(settings)
    family = family_of(config)
    if settings.keep_blocks is not None:
        config = student.with_depth(config, family, len(student.chosen_blocks(settings.keep_blocks)))
    with torch.device("meta"):
        return MetaBase(family.model_class()(config), family)


def base_parameter_count(base: MetaBase) -> int:
    """The parameters of the backbone, its classifier left out (a 21k-class head would dwarf a small ViT)."""
    return sum(p.numel() for name, p in base.model.named_parameters() if not name.startswith(f"{base.family.head}."))


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameters of the whole model, sharded or not."""
    # DeepSpeed ZeRO-3 leaves each process an empty placeholder per parameter, its whole size in ds_numel.
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return sum(size for size, trainable in sizes if trainable), sum(size for size, _trainable in sizes)


def describe(config: PretrainedConfig) -> str:
    family = family_of(config)
    size, patch = family.image_size(config), family.patch_size(config)
    grid = size // patch
    cut = student.config_in_words(config)
    return (f"{family.name} {family.vision_config(config).hidden_size}d x {family.num_blocks(config)} blocks"
            f"{f' ({cut})' if cut else ''}, patch {patch}, {size}px ({grid}x{grid} grid)")
