"""The study scripts' own output: what they print must read as what happened, with no library noise that looks
like an error."""

from __future__ import annotations

import importlib.util
import sys

from tiny import REPO, make_tiny_family

sys.path.insert(0, str(REPO / "scripts"))  # transfer_study imports its sibling small_data_study
spec = importlib.util.spec_from_file_location("transfer_study", REPO / "scripts" / "transfer_study.py")
transfer_study = importlib.util.module_from_spec(spec)
sys.modules["transfer_study"] = transfer_study  # its dataclasses look their module up by name
spec.loader.exec_module(transfer_study)


def test_the_peer_arm_loads_its_new_head_without_transformers_error_like_report(tmp_path, capfd):
    """A bare DINOv2 backbone, as the real base is: transformers would print 'incompatible num_labels' and a load
    report listing the new head as MISSING."""
    base = make_tiny_family("dinov2", tmp_path / "dinov2")
    capfd.readouterr()
    model = transfer_study.peer_model(base, ["cat", "dog", "emu"])
    printed = capfd.readouterr()
    said = printed.out + printed.err
    assert model.config.id2label == {0: "cat", 1: "dog", 2: "emu"} and model.classifier.out_features == 3
    for noise in ("MISSING", "MISMATCH", "LOAD REPORT", "incompatible"):
        assert noise not in said, said
    assert "peer: a new head for 3 labels on dinov2" in printed.out
