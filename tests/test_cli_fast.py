"""`--help` answers without the heavy imports, and the parser's literal choices and defaults are the real ones."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skipsearch import constants

ROOT = Path(__file__).parent.parent
HEAVY = ("torch", "transformers", "optuna", "datasets", "matplotlib")


@pytest.mark.parametrize("argv", [["--help"], ["optimize", "--help"], ["generate", "--help"], ["bench", "--help"],
                                  ["profile", "--help"], ["export", "--help"], ["plot", "--help"],
                                  ["check-family", "--help"]])
def test_help_imports_nothing_heavy(argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "skipsearch", *argv],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0 and "usage:" in result.stdout
    # -X importtime writes one line per imported module: "import time: self | cumulative | name".
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "skipsearch.cli" in imported
    assert not {name for name in imported if name.split(".")[0] in HEAVY}


def test_each_default_appears_once_in_help():
    from skipsearch.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        text = sub.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, name
        for paragraph in text.split("\n  -"):
            assert paragraph.count("(default:") <= 1, (name, paragraph)
    assert "(default: 20)" in commands["optimize"].format_help()  # --n-trials still shows its default


def test_help_lists_each_flag_under_what_it_sets():
    from skipsearch.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices

    def group_of(command: str, flag: str) -> str:
        return next(group.title for group in commands[command]._action_groups
                    if any(flag in action.option_strings for action in group._group_actions))

    assert {name: group_of(name, "--compile") for name in ("optimize", "bench", "generate", "profile")} == dict.fromkeys(
        ("optimize", "bench", "generate", "profile"), "model")
    assert group_of("optimize", "--per-category") == "prompts"


def test_every_dtype_objective_and_sampler_the_flags_offer_is_handled():
    """The flags offer constants.py's names (it imports no torch or Optuna); each must mean something of its own
    where it is used: a name added there and forgotten there would fall through to another's meaning."""
    from skipsearch.io import models
    from skipsearch.search.ranking import objective_value
    from skipsearch.search.records import Figures, Ratio
    from skipsearch.search.study import make_sampler

    assert set(models.DTYPES) == set(constants.DTYPE_NAMES)
    figures = Figures(speedup=Ratio(1.5, 1.2, 1.8), predicted_speedup=Ratio(1.25), acceptance_rate=0.5)
    assert {name: objective_value(figures, name) for name in constants.OBJECTIVES} == {
        "speed_x_acceptance": 0.75, "speedup": 1.5, "pareto": (1.5, 0.5), "modeled": 1.25}
    samplers = {type(make_sampler(name, 0, name == "nsga2")).__name__ for name in constants.SAMPLERS}
    assert len(samplers) == len(constants.SAMPLERS)


def test_drafting_help_shows_the_draft_policys_own_defaults():
    from skipsearch.cli import build_parser
    from skipsearch.decode.policy import DraftPolicy

    policy = DraftPolicy()  # the decode loop's, which is policy.py's: one class, one set of defaults
    commands = build_parser()._subparsers._group_actions[0].choices
    for name in ("generate", "optimize"):
        flags = {action.dest: action.help for action in commands[name]._actions}
        assert flags["max_draft_tokens"].endswith(f"(default: {policy.max_draft_tokens})"), (name, flags)
        for key in ("confidence_threshold", "target_acceptance", "threshold_step", "stop_rule"):
            assert flags[key] == argparse.SUPPRESS  # the old rules' flags: deprecated, hidden (issue 27)


def test_package_names_resolve_lazily():
    import skipsearch

    assert set(skipsearch.__all__) <= set(dir(skipsearch))
    for name in skipsearch.__all__:
        assert getattr(skipsearch, name) is not None
    with pytest.raises(AttributeError):
        skipsearch.no_such_name


@pytest.mark.parametrize("command", ["optimize", "bench", "profile", "export"])
def test_an_unknown_flag_is_refused_in_the_commands_name(command, capsys):
    from skipsearch.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([command, "--bogus", "1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"python -m skipsearch {command}: error: unrecognized arguments: --bogus 1\n"
