"""Students cut from a model's own blocks (model.keep_blocks): a shallower model that starts from what the base knows.

DistilBERT initialises its student from every other layer of its teacher, and depth-pruned ViTs keep the patch
embedding, the position table and a subset of blocks. Here the cut keeps the base's embeddings and position table,
the chosen blocks (renumbered 0..n-1, each with its own weights), the final norm and, when the base is a classifier
of the dataset's labels (a fine-tuned teacher), its head. The result is an ordinary model of the family whose config
says its depth (num_hidden_layers) and which blocks of how many it kept (STUDENT_KEY); the model module then moves
its position table to model.image_size as for any base.

A count keeps the first blocks: the top ones are dropped, as in Sajjad et al.'s "top-layer dropping" for BERT. On a
fine-tuned DINOv2-S/14, students of its first 6 (or 4) of 12 blocks, trained with the teacher's own recipe, scored
0.06-0.09 (6) and 0.06-0.11 (4) above students of every other block (DistilBERT's 0,2,4,7,9,11; 0,4,7,11) on
Fashion-MNIST and digits, every seed paired (docs/training.md, "A student cut from the teacher"). A list keeps any
other blocks.
"""

from __future__ import annotations

import copy
from pathlib import Path

from transformers import PretrainedConfig, PreTrainedModel

from vit_finetune.core.errors import EXIT_USAGE, VitFinetuneError
from vit_finetune.model.families import FAMILIES, Family, SEQUENTIAL_BLOCK
from vit_finetune.recipe import ModelSettings

STUDENT_KEY = "student_of"  # config.json: {"blocks": kept block indices, "of": the base's depth, "head": kept?}
# Keys of a backbone config derived from its depth (stage names, the stages a backbone returns): rebuilt for the new one.
DEPTH_DERIVED_KEYS = ("stage_names", "out_features", "out_indices", "_out_features", "_out_indices")


class StudentError(VitFinetuneError):
    """A cut that this base cannot take; the message names the value and the fix."""

    exit_code = EXIT_USAGE


def chosen_blocks(keep: int | list[int]) -> list[int]:
    """The blocks model.keep_blocks keeps: a list as given, a count the first ones (see above)."""
    return list(keep) if isinstance(keep, list) else list(range(keep))


def check(settings: ModelSettings, config: PretrainedConfig, family: Family) -> None:
    """Refuse, from the base's config alone, a cut its family cannot take or blocks it does not have."""
    keep = settings.keep_blocks
    if keep is None:
        return
    if not family.one_block_stack:
        cuttable = ", ".join(f.name for f in FAMILIES.values() if f.one_block_stack)
        raise StudentError(
            f"model.keep_blocks={keep}: model.base={settings.base!r} is a {family.name} model, whose blocks sit in "
            f"stages of different widths and resolutions, so no subset of them forms a model. Families that can be "
            f"cut: {cuttable}. Set model.keep_blocks=null")
    depth = family.num_blocks(config)
    count = keep if isinstance(keep, int) else len(keep)
    beyond = [block for block in keep if block >= depth] if isinstance(keep, list) else []
    if count > depth or beyond:
        asked = f"blocks {beyond}" if beyond else f"{keep} blocks"
        raise StudentError(f"model.keep_blocks={keep}: model.base={settings.base!r} has {depth} blocks (0 to "
                           f"{depth - 1}), so it cannot give {asked}. Keep at most {depth}, e.g. "
                           f"model.keep_blocks={max(1, depth // 2)}")


def with_depth(config: PretrainedConfig, family: Family, depth: int) -> PretrainedConfig:
    """A copy of `config` with `depth` blocks; what a backbone config derives from the depth is derived again."""
    values = copy.deepcopy(config.to_dict())
    vision = values[family.vision_config_key] if family.vision_config_key else values
    vision["num_hidden_layers"] = depth
    for key in DEPTH_DERIVED_KEYS:
        vision.pop(key, None)
    return type(config).from_dict(values)


def same_labels(config: PretrainedConfig, labels: list[str]) -> bool:
    """Whether `config` is its family's classifier of exactly `labels`, in order: its head then means what the
    dataset's classes mean."""
    family = FAMILIES[config.model_type]
    id2label = {int(index): name for index, name in (config.id2label or {}).items()}
    return (getattr(config, "architectures", None) == [family.classification_class]
            and [id2label.get(index) for index in range(len(id2label))] == list(labels))


def cut(model: PreTrainedModel, keep: int | list[int], labels: list[str]) -> PreTrainedModel:
    """The shallower model: `model`'s embeddings, position table, the kept blocks (renumbered), final norm and head,
    every weight copied. Its config records the blocks and whether the head is a trained one for `labels`."""
    family = FAMILIES[model.config.model_type]
    depth = family.num_blocks(model.config)
    blocks = chosen_blocks(keep)
    config = with_depth(model.config, family, len(blocks))
    setattr(config, STUDENT_KEY, {"blocks": blocks, "of": depth, "head": same_labels(model.config, labels)})
    student = type(model)(config)
    student.load_state_dict(kept_blocks(model.state_dict(), blocks), strict=True)  # strict: nothing left fresh
    return student.float()


def kept_blocks(state: dict, blocks: list[int]) -> dict:
    """`state` with only the weights of `blocks`, renumbered in their order; everything outside the blocks kept."""
    position = {block: new for new, block in enumerate(blocks)}
    kept = {}
    for key, tensor in state.items():
        match = SEQUENTIAL_BLOCK.search(key)
        if match is None:
            kept[key] = tensor
        elif int(match.group(1)) in position:
            kept[f"{key[:match.start(1)]}{position[int(match.group(1))]}{key[match.end(1):]}"] = tensor
    return kept


def forget_cut(config: PretrainedConfig) -> None:
    """Drop the record of a cut from `config`: a base cut by an earlier run, trained on without a cut of its own, is a
    model of that depth like any other (its head replaced, its blocks not this run's choice)."""
    if hasattr(config, STUDENT_KEY):
        delattr(config, STUDENT_KEY)


def kept_head(config: PretrainedConfig) -> bool:
    """Whether the model was cut with its trained head (the base classified the dataset's labels)."""
    return bool((getattr(config, STUDENT_KEY, None) or {}).get("head"))


def facts(settings: ModelSettings, config: PretrainedConfig, teacher: str | None = None) -> dict:
    """What a run's model is and where it came from (the distillation report's `student`): its depth and either the
    blocks it kept of model.base, with whether model.base is the teacher itself, or the base it was fine-tuned from."""
    family = FAMILIES[config.model_type]
    known = {"blocks": family.num_blocks(config), "from": settings.base}
    if not settings.pretrained:
        return {**known, "random_weights": True}
    record = getattr(config, STUDENT_KEY, None)
    if record:
        known.update(kept_blocks=record["blocks"], of=record["of"], head_kept=record["head"],
                     from_teacher=teacher is not None and same_place(settings.base, teacher))
    return known


def same_place(first: str, second: str) -> bool:
    """Whether two model locations name the same folder (or the same Hub id)."""
    def place(location: str) -> str:
        path = Path(location).expanduser()
        return str(path.resolve()) if path.exists() else location
    return place(first) == place(second)


def cut_in_words(blocks: list[int], of: int, head_kept: bool, whose: str = "the base's") -> str:
    """`blocks 0, 2, 4, 7, 9, 11 of the base's 12; its head kept`: which blocks a cut kept, and its head."""
    kept = ", ".join(str(block) for block in blocks)
    return f"blocks {kept} of {whose} {of}; {'its head kept' if head_kept else 'a new head'}"


def config_in_words(config: PretrainedConfig) -> str:
    """A cut model's blocks in words (cut_in_words), from its config; '' for a model that was not cut."""
    record = getattr(config, STUDENT_KEY, None)
    return cut_in_words(record["blocks"], record["of"], record["head"]) if record else ""


def describe(facts: dict) -> str:
    """The student in words (from facts): its depth and where its weights came from."""
    depth = f"{facts['blocks']} block{'s' * (facts['blocks'] != 1)}"
    if facts.get("random_weights"):
        return f"{depth}, from random weights ({facts['from']}'s architecture)"
    if "kept_blocks" not in facts:
        return f"{depth}, fine-tuned from {facts['from']}"
    source = "the teacher itself" if facts["from_teacher"] else facts["from"]
    return f"{depth} cut from {source} ({cut_in_words(facts['kept_blocks'], facts['of'], facts['head_kept'], 'its')})"
