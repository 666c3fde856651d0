import json

import optuna
import pytest

from skipsearch.decoding import DraftPolicy
from skipsearch.export import export_trial, verdict
from skipsearch.skipping import SkipSet


def fake_study(tmp_path, speedups):
    """A study whose trials carry the given measured speedups (first one: no skip)."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/fake.db", study_name="fake", direction="maximize")
    study.set_user_attr("skipsearch", {
        "model": {"name_or_path": "tiny", "architecture": "LlamaForCausalLM", "num_hidden_layers": 4,
                  "hidden_size": 32},
        "objective": "speedup", "sampler": "tpe", "dataset": "builtin", "num_prompts": 2, "max_new_tokens": 8,
        "seed": 0, "device": "cpu", "dtype": "float32", "draft": vars(DraftPolicy()),
    })
    for i, speedup in enumerate(speedups):
        attn = [] if i == 0 else [i % 4]
        study.add_trial(optuna.trial.create_trial(
            params={}, distributions={}, value=speedup,
            user_attrs={"skip_attn": attn, "skip_mlp": [], "skipped": len(attn), "speedup": speedup,
                        "acceptance_rate": 0.8, "tokens_per_second": 10 * speedup, "baseline_tokens_per_second": 10.0,
                        "mean_accepted_tokens": 1.0},
        ))
    return study


def test_verdict_says_when_nothing_pays_and_the_export_decodes_plainly(tmp_path):
    study = fake_study(tmp_path, [1.01, 0.97, 0.9])
    pays, text = verdict(study)
    assert not pays and text == "no skip set beats plain decoding on this model and device: best 0.97x (measured, trial 1)"
    config = export_trial(study, tmp_path / "best.json")
    assert config.skip == SkipSet() and config.metrics["speedup"] == 1.0
    assert config.metrics["best_skipping_speedup"] == 0.97
    assert json.loads((tmp_path / "best.json").read_text())["metrics"]["verdict"] == text


def test_verdict_exports_a_skip_set_that_pays(tmp_path):
    study = fake_study(tmp_path, [1.0, 1.3, 0.9])
    pays, text = verdict(study)
    assert pays and "1.30x" in text
    config = export_trial(study, tmp_path / "best.json")
    assert config.skip == SkipSet.of([1], [], 4) and config.metrics["speedup"] == 1.3
    assert export_trial(study, tmp_path / "t2.json", trial_number=2).skip == SkipSet.of([2], [], 4)
    with pytest.raises(ValueError, match="no trial 7"):
        export_trial(study, tmp_path / "t7.json", trial_number=7)
