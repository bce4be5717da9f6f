"""The study scripts' own output: what they print must read as what happened, with no library noise that looks
like an error."""

from __future__ import annotations

import importlib.util

from tiny import REPO, make_tiny_family

spec = importlib.util.spec_from_file_location("peer_example", REPO / "scripts" / "peer_example.py")
peer_example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer_example)


def test_the_peer_arm_loads_its_new_head_without_transformers_error_like_report(tmp_path, capfd):
    """A bare DINOv2 backbone, as the real base is: transformers would print 'incompatible num_labels' and a load
    report listing the new head as MISSING."""
    base = make_tiny_family("dinov2", tmp_path / "dinov2")
    capfd.readouterr()
    model = peer_example.peer_model(base, ["cat", "dog", "emu"])
    printed = capfd.readouterr()
    said = printed.out + printed.err
    assert model.config.id2label == {0: "cat", 1: "dog", 2: "emu"} and model.classifier.out_features == 3
    for noise in ("MISSING", "MISMATCH", "LOAD REPORT", "incompatible"):
        assert noise not in said, said
    assert "peer: a new head for 3 labels on dinov2" in printed.out
