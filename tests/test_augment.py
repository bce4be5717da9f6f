"""DeiT's batch augmentations (vit_finetune.data.augment): each does what it says, on the real kornia modules.

Images are random, so every pixel of two images differs and a mixed pixel reveals where it came from; labels are
distinct per image, so a soft target reveals the partner image and its weight.
"""

from __future__ import annotations

import pytest
import torch

from runs import STEPS_PER_EPOCH, train
from vit_finetune.data import augment
from vit_finetune.data.augment import BatchAugmenter
from vit_finetune.recipe import AugmentSettings
from vit_finetune.tasks import SingleLabel, single_label

BATCH, SIZE = 8, 16


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.rand(BATCH, 3, SIZE, SIZE, generator=generator), torch.arange(BATCH)


def augmenter(total_epochs: int = 3, label_smoothing: float = 0.0, **options) -> BatchAugmenter:
    return BatchAugmenter(AugmentSettings(**options), BATCH, seed=7, total_epochs=total_epochs,
                          label_smoothing=label_smoothing, mix_targets=SingleLabel().mixed_targets)


def partners(targets: torch.Tensor) -> list[tuple[int, float]]:
    """(partner image, partner weight) per row, read from targets over distinct labels (own label = row)."""
    found = []
    for row, target in enumerate(targets):
        others = [(int(j), float(target[j])) for j in torch.nonzero(target).flatten() if j != row]
        found.append(others[0] if others else (row, 0.0))
    return found


def test_mixup_targets_are_convex_combinations_and_pixels_follow_the_formula():
    pixels, labels = batch()
    mixed, targets = augmenter(mixup=True)(pixels, labels, epoch=0, batch=0)
    assert targets.shape == (BATCH, BATCH)
    assert (targets >= 0).all() and torch.allclose(targets.sum(dim=1), torch.ones(BATCH))
    for row, (partner, weight) in enumerate(partners(targets)):
        assert torch.allclose(targets[row, row] + weight, torch.tensor(1.0))  # only own and partner's labels
        expected = (1 - weight) * pixels[row] + weight * pixels[partner]
        assert torch.allclose(mixed[row], expected, atol=1e-6)
    assert any(0 < w < 1 for _, w in partners(targets))  # it really mixed


def test_cutmix_pastes_one_box_of_the_partner_and_its_label_weight_is_the_pasted_area():
    pixels, labels = batch()
    mixed, targets = augmenter(cutmix=True)(pixels, labels, epoch=0, batch=0)
    assert torch.allclose(targets.sum(dim=1), torch.ones(BATCH))
    pasted_any = False
    for row, (partner, weight) in enumerate(partners(targets)):
        changed = (mixed[row] != pixels[row]).any(dim=0)  # (H, W)
        area = changed.float().mean().item()
        assert weight == pytest.approx(area, abs=1e-6)
        if changed.any():
            pasted_any = True
            rows, cols = torch.nonzero(changed, as_tuple=True)
            box = changed[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
            assert box.all()  # one rectangle
            assert torch.equal(mixed[row][:, changed], pixels[partner][:, changed])
            assert torch.equal(mixed[row][:, ~changed], pixels[row][:, ~changed])
    assert pasted_any


@pytest.mark.parametrize("mix", ["mixup", "cutmix"])
def test_kornia_draws_the_same_whatever_labels_it_mixes_so_positions_stand_in_for_the_class_ids(mix):
    """The augmenter hands kornia the images' positions and the task looks their labels up. From the same random
    state kornia handed the class ids themselves draws the same pixels and pairs: the targets are, to the bit, the
    soft targets of its (label, partner's label, lambda) rows of the class ids."""
    pixels = batch()[0]
    labels = torch.tensor([3, 0, -1, 5, 3, 1, 7, 3])  # repeated classes and a skipped image
    mixer = augmenter(label_smoothing=0.1, **{mix: True})
    kornia_mix, by_class_ids = mixer.mixes[mix], {}

    def both_ways(pixels: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        state = torch.get_rng_state()
        by_class_ids["pixels"], by_class_ids["rows"] = kornia_mix(pixels, labels)
        torch.set_rng_state(state)
        return kornia_mix(pixels, positions)

    mixer.mixes[mix] = both_ways
    for position in range(4):
        mixed, targets = mixer(pixels, labels, epoch=0, batch=position)
        rows = by_class_ids["rows"].view(-1, 3)
        expected = single_label.soft_targets(rows[:, 0].long(), rows[:, 1].long(),
                                             augment.MIXES[mix].partner_weight(rows[:, 2]).float(), BATCH, 0.1)
        assert torch.equal(mixed, by_class_ids["pixels"]) and torch.equal(targets, expected)
        assert (rows[:, 2] > 0).any()  # it mixed


def test_label_smoothing_composes_with_mixed_targets():
    pixels, labels = batch()
    _, plain = augmenter(mixup=True)(pixels, labels, epoch=0, batch=0)
    _, smoothed = augmenter(mixup=True, label_smoothing=0.1)(pixels, labels, epoch=0, batch=0)
    assert torch.allclose(smoothed, plain * 0.9 + 0.1 / BATCH)
    assert torch.allclose(smoothed.sum(dim=1), torch.ones(BATCH))


def test_bad_image_rows_train_nothing_and_a_blank_partner_leaves_the_own_label_whole():
    labels = torch.tensor([0, -1, 1, 2])  # image 1 was skipped as bad
    own, partner = torch.tensor([0, 1, 2]), torch.tensor([1, 0, 3])  # image 0 blended with the blank, 1 with 0
    targets = SingleLabel().mixed_targets(labels, own, partner, torch.tensor([0.3, 0.7, 0.25]), BATCH, 0.0)
    assert torch.allclose(targets[:, :3], torch.tensor([[1.0, 0, 0], [0, 0, 0], [0, 0.75, 0.25]]))
    logits = torch.randn(3, BATCH)
    expected = -(torch.log_softmax(logits, -1)[0, 0] + 0.75 * torch.log_softmax(logits, -1)[2, 1]
                 + 0.25 * torch.log_softmax(logits, -1)[2, 2]) / 2  # the mean over the two rows with a target
    assert single_label.soft_target_loss(logits, targets) == pytest.approx(expected.item(), rel=1e-6)


def test_class_weights_apply_to_mixed_targets_and_equal_weighted_cross_entropy_on_one_hot_rows():
    logits, labels = torch.randn(5, 3), torch.tensor([0, 2, 2, 1, 0])
    weights = torch.tensor([0.5, 2.0, 1.25])
    one_hot = torch.nn.functional.one_hot(labels, 3).float()
    expected = torch.nn.functional.cross_entropy(logits, labels, weight=weights)
    assert single_label.soft_target_loss(logits, one_hot, weights).item() == pytest.approx(expected.item(), rel=1e-6)
    one_hot[1] = 0  # a bad image's row holds no target and weighs nothing
    kept = torch.tensor([0, 2, 3, 4])
    expected = torch.nn.functional.cross_entropy(logits[kept], labels[kept], weight=weights)
    assert single_label.soft_target_loss(logits, one_hot, weights).item() == pytest.approx(expected.item(), rel=1e-6)
    mixed = torch.tensor([[0.7, 0.3, 0.0]])  # a mixed pair weighs 0.7 w_0 + 0.3 w_1
    log_p = torch.log_softmax(logits[:1], -1)[0]
    by_hand = -(0.7 * 0.5 * log_p[0] + 0.3 * 2.0 * log_p[1]) / (0.7 * 0.5 + 0.3 * 2.0)
    assert single_label.soft_target_loss(logits[:1], mixed, weights).item() == pytest.approx(by_hand.item(), rel=1e-6)
    assert single_label.soft_target_loss(logits, torch.zeros(5, 3), weights).item() == 0.0  # all rows skipped


def test_mixing_is_off_in_the_last_epochs_and_on_before():
    pixels, labels = batch()
    mix = augmenter(total_epochs=3, mixup=True, cutmix=True, mix_off_epochs=1)
    for position in range(4):
        _, targets = mix(pixels, labels, epoch=1, batch=position)
        assert targets is not None
        untouched, none = mix(pixels, labels, epoch=2, batch=position)
        assert none is None and torch.equal(untouched, pixels)


def test_switch_probability_chooses_cutmix_or_mixup():
    pixels, labels = batch()
    for switch, kind in ((0.0, "blended"), (1.0, "pasted")):
        mix = augmenter(mixup=True, cutmix=True, mix_switch_prob=switch)
        for position in range(3):
            mixed, targets = mix(pixels, labels, epoch=0, batch=position)
            for row, (partner, weight) in enumerate(partners(targets)):
                if 0 < weight < 1:  # pasted: every pixel is its own or its partner's, at the same place
                    pasted = ((mixed[row] == pixels[row]) | (mixed[row] == pixels[partner])).all()
                    assert bool(pasted) == (kind == "pasted")


@pytest.mark.parametrize("options", [{"policy": "randaugment"}, {"policy": "trivialaugment"},
                                     {"erasing_prob": 1.0}, {"mixup": True}, {"cutmix": True}])
def test_each_option_is_a_pure_function_of_seed_epoch_and_batch(options):
    pixels, labels = batch()
    global_state = torch.get_rng_state()
    first, _ = augmenter(**options)(pixels, labels, epoch=1, batch=2)
    again, _ = augmenter(**options)(pixels, labels, epoch=1, batch=2)
    other, _ = augmenter(**options)(pixels, labels, epoch=1, batch=3)
    assert not torch.equal(first, pixels)  # it changed the training pixels
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert torch.equal(torch.get_rng_state(), global_state)  # dropout draws the same with the option on or off


def test_random_erasing_blanks_one_rectangle_per_image():
    pixels, _ = batch()
    erased, targets = augmenter(erasing_prob=1.0)(pixels, torch.arange(BATCH), epoch=0, batch=0)
    assert targets is None
    for row in range(BATCH):
        changed = (erased[row] != pixels[row]).any(dim=0)
        rows, cols = torch.nonzero(changed, as_tuple=True)
        assert changed[rows.min():rows.max() + 1, cols.min():cols.max() + 1].all()
        assert (erased[row][:, changed] == 0).all()


def test_options_off_leave_the_batch_alone():
    pixels, labels = batch()
    same, targets = augmenter()(pixels, labels, epoch=0, batch=0)
    assert same is pixels and targets is None


def test_a_run_augments_every_training_batch_and_no_evaluation_batch(args, tmp_path):
    """Through the real CLI, observed with the callback hook: the run's augmenter sees exactly its training batches
    (2 epochs of 6 batches of 4, each epoch evaluated on a batch of 9)."""
    from vit_finetune.artifacts.callbacks import Callback

    seen = []

    class ObserveAugmenter(Callback):
        def on_train_start(self, run):
            augmenter = run.parts.augment

            def observed(pixels, labels, epoch, batch):
                seen.append((epoch, batch, len(labels)))
                return augmenter(pixels, labels, epoch, batch)

            run.parts.augment = observed

    options = ["augment.mixup=true", "augment.cutmix=true", "augment.policy=trivialaugment",
               "augment.erasing_prob=0.5", "augment.mix_off_epochs=1", "train.label_smoothing=0.1"]
    assert train([*args, *options, f"output_dir={tmp_path / 'out'}"], callbacks=[ObserveAugmenter()]) == 0
    assert seen == [(epoch, batch, 4) for epoch in range(2) for batch in range(STEPS_PER_EPOCH)]
