"""One pre-flight: each wing's problems with a recipe found before any download or output, and said together.

A problem found alone keeps its message and exit code byte for byte; several are listed in one error, the first's exit
code kept. The first pass (the launch, the output folder, the trackers, the token) needs nothing loaded; the second
(the base, the data, the teacher) reads configs alone.
"""

from __future__ import annotations

import importlib.util

import pytest

import vit_finetune
from vit_finetune.core.errors import EXIT_USAGE, Problems, RunError, VitFinetuneError, problems_of, raise_together


class UsageProblem(VitFinetuneError):
    exit_code = EXIT_USAGE


def refuse(error: VitFinetuneError):
    def check():
        raise error
    return check


def test_one_problem_is_raised_as_it_is_and_several_together_in_order():
    first, second = UsageProblem("first: fix it so"), RunError("second:\nits detail")
    assert problems_of(lambda: None, refuse(first), lambda: 1) == [first]  # a passing check adds nothing
    with pytest.raises(UsageProblem) as alone:
        raise_together([first])
    assert alone.value is first  # the same error, its message and exit code untouched
    raise_together([])  # nothing found: the run goes on
    with pytest.raises(Problems) as several:
        raise_together(problems_of(refuse(first), refuse(second)))
    assert str(several.value) == "2 problems before the run started:\n  - first: fix it so\n  - second:\n    its detail"
    assert several.value.exit_code == EXIT_USAGE and several.value.problems == [first, second]
    with pytest.raises(ValueError):  # a bug is no user's problem: it is not gathered
        problems_of(refuse(first), lambda: int("x"))


def missing_tracker() -> str:
    for name in ("wandb", "mlflow", "trackio"):
        if importlib.util.find_spec(name) is None:
            return name
    pytest.skip("every tracker this test could name is installed here")


def refusal(recipe) -> VitFinetuneError:
    with pytest.raises(VitFinetuneError) as refused:
        vit_finetune.train(recipe)
    return refused.value


def test_the_first_pass_says_every_problem_at_once_each_as_it_reads_alone(tmp_path):
    """No token for a push (the tests' Hub token is never in the environment) and a tracker not installed: both said
    in one run, before anything loads, each in the words it has when it is the only problem."""
    tracker = missing_tracker()
    push = {"hub.push": True, "hub.repo_id": "someone/demo"}
    common = {"output_dir": str(tmp_path / "out")}
    token_alone = refusal(vit_finetune.load_recipe("demo", **common, **push))
    tracker_alone = refusal(vit_finetune.load_recipe("demo", **common, **{"train.report_to": [tracker]}))
    both = refusal(vit_finetune.load_recipe("demo", **common, **push, **{"train.report_to": [tracker]}))
    assert "no Hugging Face token was found" in str(token_alone) and tracker in str(tracker_alone)
    assert str(both) == f"2 problems before the run started:\n  - {tracker_alone}\n  - {token_alone}"
    assert isinstance(both, Problems) and both.exit_code == tracker_alone.exit_code
    assert not (tmp_path / "out").exists()  # refused before the output folder was touched


def test_the_second_pass_says_the_base_and_the_teacher_together_from_python(tmp_path):
    recipe = vit_finetune.load_recipe("demo", **{"model.base": str(tmp_path / "no_base"), "output_dir": str(
        tmp_path / "out"), "train.distill": {"teacher": str(tmp_path / "no_teacher")}})
    with pytest.raises(Problems) as refused:
        vit_finetune.train(recipe)
    lines = str(refused.value).splitlines()
    assert lines[0] == "2 problems before the run started:"
    assert lines[1].startswith(f"  - model.base={str(tmp_path / 'no_base')!r}: there is no folder or file")
    assert lines[2].startswith(f"  - train.distill.teacher={str(tmp_path / 'no_teacher')!r}: folder not found")
    assert not (tmp_path / "out").exists()
