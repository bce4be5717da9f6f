"""The schema of a recipe: its sections as pydantic models that refuse keys they do not know, each field with its
type, its default, its one-line meaning (what `--keys` prints) and the checks of its own value. The field types are
fields.py's; the train section, the largest, is train_section.py's.

Checks between keys live in checks.py; each section's validator below hands its keys over to it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictInt, field_validator, model_validator

from vit_finetune.core.errors import excerpt
from vit_finetune.core.layout import REPO_ID_PATTERN
from vit_finetune.recipe.checks import check_data_section, check_recipe, fold_older_spellings
from vit_finetune.recipe.fields import Bounded, Float, HomePath, PositiveFloat, Strict, check_colour, survives_float32
from vit_finetune.recipe.train_section import TrainSettings


class LoraSettings(Strict):
    r: Bounded("model.lora.r") = Field(16, gt=0, description="LoRA rank: higher = more capacity, more memory")
    alpha: PositiveFloat = Field(16, gt=0, description="LoRA scale: the update is multiplied by alpha / r")
    dropout: Float = Field(0.1, ge=0, lt=1, description="dropout on the LoRA branch's input")
    # Roles, not module names: they are mapped onto the loaded model's own names (transformers 4.x or 5.x).
    target_modules: list[Literal["query", "key", "value", "attention_output", "mlp_in", "mlp_out"]] = Field(
        ["query", "value"], description="layers that get LoRA, by role: query, key, value, attention_output, mlp_in, mlp_out")


class ModelSettings(Strict):
    base: HomePath = Field("google/vit-base-patch16-224", description=(
        "the pretrained ViT-family model (see docs/families.md): a Hub id, a local folder with config.json, or builtin:NAME for a model shipped in "
        "vit_finetune/model/assets (builtin:tiny-vit-32, the offline demo's)"))
    image_size: Bounded("model.image_size") = Field(384, gt=0, description="training and saved resolution in px; a multiple of the patch size")
    lora: LoraSettings | None = Field(None,
        description="null = full fine-tuning; {r, alpha, dropout, target_modules} = LoRA")
    head_init: Literal["zero", "random"] = Field(
        "zero", description="new classifier head: zero (big_vision's choice: start from uniform predictions) or random")
    pretrained: bool = Field(
        True, description="false = the same architecture from random weights, a baseline to compare against")
    revision: str | None = Field(None, description="Hub branch, tag or commit of model.base; null = main")
    trust_remote_code: bool = Field(False,
        description="run the base's own Python code from the Hub; off unless you trust it")
    compile: bool | Literal["auto", "regional"] = Field("auto", description=(
        "torch.compile the model, its attention kept out of the compiled graph on the fused kernels (compiling.py): "
        "true = the whole model, regional = each repeated block on its own (a shorter compile); auto: "
        "compiling.auto_compile, on only where compiling was measured faster and the run long enough to pay for it "
        "(so far: one CUDA process, the whole model, from about 286,000 training images of a ViT-B/16 at 384 px, "
        "attention kept out), printed and saved resolved in the output's recipe.yaml"))
    window_size: Bounded("model.window_size", StrictInt | None) = Field(None, gt=0, description=(
        "Swin/Swinv2 attention window; null = keep the checkpoint's (a new one resizes Swin's bias tables)"))
    drop_path_rate: Float | None = Field(None, ge=0, lt=1, description=(
        "stochastic depth, e.g. 0.1; null = the base config's. Only families whose config has a drop-path rate "
        "(BEiT, DINOv2, Swin, Data2Vec), not ViT"))
    keep_blocks: StrictInt | list[StrictInt] | None = Field(None, description=(
        "a shallower model cut from model.base's own blocks, e.g. a student of a fine-tuned teacher (model.base="
        "the teacher's output_dir): N keeps the first N blocks (measured better than every other one), a list "
        "keeps those blocks (0-based), e.g. [0, 2, 4, 7, 9, 11]. Embeddings, position table, final norm and, when its "
        "labels are the dataset's, the head come with them; null = every block"))

    @field_validator("compile", mode="before")
    @classmethod
    def _null_is_auto(cls, value: Any) -> Any:
        """Earlier versions spelled auto as null: their recipes and checkpoints still read the same."""
        return "auto" if value is None else value

    @field_validator("keep_blocks", mode="before")
    @classmethod
    def _blocks_to_keep(cls, value: Any) -> Any:
        """One clear problem for a count or list of blocks, not one per member of the union."""
        if value is None:
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise ValueError(f"must keep at least 1 block, got {value}; e.g. 6 (of 12)")
            return value
        if not isinstance(value, list) or not value or not all(
                isinstance(block, int) and not isinstance(block, bool) for block in value):
            raise ValueError(f"must be a number of blocks or a list of block indices, got {excerpt(value)}; e.g. 6 "
                             "or [0, 2, 4, 7, 9, 11]")
        if any(block < 0 for block in value) or value != sorted(set(value)):
            raise ValueError(f"a list of blocks must hold distinct 0-based indices in increasing order, got "
                             f"{excerpt(value)}; e.g. [0, 2, 4, 7, 9, 11]")
        return value


class DataSettings(Strict):
    dataset: HomePath = Field("ethz/food101", description=(
        "a Hub dataset id, a folder of class sub-folders (optionally under train/ and validation/), a folder "
        "written by save_to_disk, a label file (.csv or .jsonl naming each image's relative path and its label or "
        "labels, or a folder holding metadata.csv / metadata.jsonl), or builtin:shapes (the demo's generated shapes)"))
    train_split: str = Field("train", description="split to train on")
    eval_split: str | None = Field("validation", description=(
        "split to evaluate on; null or missing from the dataset: data.eval_fraction of train is held out "
        "(a dataset with only train/test uses test)"))
    test_split: str | None = Field(None, description=(
        "a split scored once, after training, by the weights the run keeps, and read by none of its choices (the "
        "eval split makes those): its metrics go to metrics.json's \"test\" and the card. Scored whole "
        "(data.max_eval_samples limits the eval split only); null: none"))
    eval_fraction: Float = Field(0.1, gt=0, lt=1,
        description="share of train held out (stratified, seeded) when there is no eval split")
    image_column: str | None = Field(None, description="column holding the images; null = detect")
    label_column: str | None = Field(None, description="column holding the labels; null = detect")
    max_train_samples: StrictInt | None = Field(None, gt=0,
        description="train on a seeded random subset of this size; null = all")
    max_eval_samples: StrictInt | None = Field(None, gt=0,
        description="evaluate on a seeded random subset of this size; null = all")
    crop_scale: tuple[Float, Float] | Literal["auto"] = Field("auto", description=(
        "random-resized-crop area range [low, high] as shares of the image ([0.05, 1.0]: the original ViT recipe); "
        "auto: the toolkit's measured choice for the training images the run will see (data.auto_crop_scale: no "
        "crop, measured up to 7,040 images seen and, with eval images from another source, up to 16,000; kept "
        "beyond; where the run's own eval images likely come from another source and a mirror image is the same "
        "thing to the base, crops of 8-100 % of the area up to 4,800: data.auto_crop_scale_under_shift), printed "
        "with its reason and saved resolved in the output's recipe.yaml"))
    horizontal_flip: bool | Literal["auto"] = Field(False, description=(
        "flip training crops left-right with probability 0.5: right for photos, wrong for digits, text and anything a "
        "mirror changes; auto: on where mirroring the held-out training images changes the linear probe's answers no "
        "more often than it answers wrongly (probe_checks.mirror_test), printed with its reason. Off by default: on "
        "small sets, with and without a shift, the flip that auto chose cost accuracy as often as it gained, and on "
        "one source up to 16,000 images seen it cost ELPV's cells 0.05 at 4,800 (docs/studies/shift.md)"))
    skip_bad_images: bool = Field(False, description="skip and count undecodable images instead of stopping the run")
    alpha_background: Literal["auto"] | Annotated[str, AfterValidator(check_colour)] | None = Field("auto", description=(
        "lay images with transparency on this colour (white, black or #rrggbb) before their alpha channel is "
        "dropped, in training, evaluation, predict, explain, export and the page (saved with the model, named in its "
        "card); null = drop alpha as pipeline() does (a drawing kept only in the alpha channel is lost); auto: white "
        "where dropping alpha would lose the drawings (colours other than one flat colour stored under the "
        "transparent pixels, or a drawing kept in the alpha channel alone: probe_checks.transparency), else null; "
        "printed with its reason"))
    allow_flat_images: bool = Field(False, description=(
        "train even when most of the training images checked decode to one flat colour (the run refuses otherwise, "
        "naming the fix)"))
    min_image_side: StrictInt = Field(2, gt=0, description="images with a smaller side (px) are treated as corrupt")
    max_image_pixels: StrictInt = Field(89_478_485, gt=0,
        description="larger images are refused (PIL's decompression-bomb limit)")
    num_workers: Bounded("data.num_workers", StrictInt | None) = Field(None, ge=0,
        description="DataLoader decode processes; null = chosen from the CPU count and the device")
    class_balance: Literal["weights", "sampler"] | None = Field(None, description=(
        "skewed label counts: weights = each image's loss weighted by N / (classes x its class's count); "
        "sampler = each epoch drawn with replacement so classes come up equally often; null = off"))
    streaming: bool = Field(False, description=(
        "read data.dataset as a stream of parquet or WebDataset .tar shards (a Hub dataset id or a local folder) "
        "instead of downloading it whole: for datasets larger than the disk. Needs a ClassLabel label column, or a "
        "list of ClassLabel for multi-label (or data.label_names), and an eval split;"
        " each process reads its own shards (docs/data.md, 'Streaming')"))
    label_names: list[str] | None = Field(None, description=(
        "data.streaming with plain integer labels (WebDataset's .cls files): the class names in index order; "
        "null = the label column's ClassLabel names"))
    multi_label: bool | None = Field(None, description=(
        "each image has a set of labels, which may be empty (sigmoid scores, binary cross-entropy, per-class "
        "thresholds); null = detect: a label file whose cells hold lists, or a dataset whose label column is a list of "
        "ClassLabel (the run says which)"))
    task: Literal["auto", "single_label", "multi_label", "regression"] = Field("auto", description=(
        "what the model learns: auto = classification, multi-label when the labels are sets (data.multi_label) and "
        "refusing a label column of fractional numbers; regression = a number per image (the label column), or "
        "several (data.target_columns)"))
    target_columns: list[str] | None = Field(None, description=(
        "data.task=regression with several targets: the columns holding them (null = data.label_column alone)"))
    label_separator: str = Field(";", description=(
        "label files: the character joining several labels in one cell, e.g. 'cat;dog'; '' = never split"))
    shuffle_buffer: Bounded("data.shuffle_buffer") = Field(1000, gt=0, description=(
        "data.streaming: rows each process holds to shuffle its stream (shard order is shuffled too, per pass); "
        "more = better mixed, more memory (rows x encoded image size)"))

    @field_validator("crop_scale")
    @classmethod
    def _crop_scale_ordered(cls, value: tuple[float, float] | str) -> tuple[float, float] | str:
        if value == "auto":
            return value
        low, high = value
        if not 0 < low <= high <= 1:
            raise ValueError(f"must satisfy 0 < low <= high <= 1, got {list(value)}; e.g. [0.05, 1.0]")
        survives_float32(low)
        return value

    @model_validator(mode="before")
    @classmethod
    def _multi_label_is_a_task(cls, values: Any) -> Any:
        """data.multi_label, the older spelling, is read as data.task: nothing after reads it."""
        return fold_older_spellings(values) if isinstance(values, dict) else values

    @model_validator(mode="after")
    def _keys_agree(self) -> DataSettings:
        check_data_section(self)
        return self


class AugmentSettings(Strict):
    """DeiT's batch augmentations, run on the device on whole batches (vit_finetune.data.augment); all off by default."""

    policy: Literal["none", "randaugment", "trivialaugment"] = Field("none", description="kornia's automatic augmentation policies")
    randaugment_ops: Bounded("augment.randaugment_ops") = Field(2, gt=0, description=(
        "RandAugment: operations per image, 1-15 (distinct ones, drawn from kornia's 15)"))
    # kornia refuses 0 and 30, and only when the augmenter is built, after data and model load
    randaugment_magnitude: Bounded("augment.randaugment_magnitude") = Field(9, gt=0, description=(
        "RandAugment: strength of every operation, 1-29"))
    erasing_prob: Float = Field(0.0, ge=0, le=1, description="random erasing: chance per image that a rectangle is blanked")
    mixup: bool = Field(False, description="blend pairs of images and their labels (soft-target loss)")
    cutmix: bool = Field(False, description="paste a box of another image; its label weighs the pasted area")
    mix_prob: Float = Field(1.0, ge=0, le=1, description="chance that a batch is mixed at all, with mixup or cutmix on")
    mix_switch_prob: Float = Field(0.5, ge=0, le=1, description="both on: chance that a mixed batch uses CutMix, not Mixup")
    mix_off_epochs: Bounded("augment.mix_off_epochs") = Field(0, ge=0, description="no mixing in the last N epochs (train on clean images at the end)")


class HubSettings(Strict):
    push: bool = Field(False,
        description="upload the finished output folder to the Hub (needs a token and hub.repo_id)")
    repo_id: str | None = Field(None, description="namespace/name of the Hub model repo to push to")
    private: bool = Field(False, description="create the Hub repo as private")

    @field_validator("repo_id")
    @classmethod
    def _repo_id_is_valid(cls, value: str | None) -> str | None:
        """huggingface_hub's own rules (no '--' or '..', no '.git' ending...), then the Hub's (the name starts with a
        letter or digit): an id either refuses fails only at the push, after training."""
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        if value is None:
            return value
        try:
            validate_repo_id(value)
        except HFValidationError as error:
            reason = str(error).replace(f": {value!r}", "").rstrip(".")
        else:
            reason = None if REPO_ID_PATTERN.match(value) else "a name must start with a letter or digit"
        if reason:
            raise ValueError(f"{excerpt(value)} is not a valid Hub repo id ({reason}); use 'name' or 'namespace/name' with letters, digits, "
                             "'-', '_' and '.', e.g. your-name/vit-food101-384")
        return value


class Recipe(Strict):
    model: ModelSettings = ModelSettings()
    data: DataSettings = DataSettings()
    augment: AugmentSettings = AugmentSettings()
    train: TrainSettings = TrainSettings()
    hub: HubSettings = HubSettings()
    output_dir: HomePath = Field("outputs/run", description="folder for the model, metrics, pictures and checkpoints")
    overwrite: bool = Field(False, description="replace a finished run (or checkpoints) already in output_dir")
    pictures: bool = Field(True, description="draw the PNG pictures (training curves, confusion matrix, misclassified "
                           "images, position embeddings) into output_dir; false saves their time in sweeps")

    @model_validator(mode="after")
    def _keys_agree(self) -> Recipe:
        check_recipe(self)
        return self
