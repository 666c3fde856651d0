import json

import pytest

from conftest import tiny_model
from skipsearch.config import FORMAT, ModelInfo, SkipConfig, load_skip_config, save_skip_config
from skipsearch.decoding import DraftPolicy
from skipsearch.skipping import SkipSet


def make_config(model, **overrides):
    fields = dict(
        model=ModelInfo.of(model, "tiny"), skip=SkipSet.of([0, 2], [3], 4),
        draft=DraftPolicy(max_draft_tokens=5, adaptive=False, confidence_threshold=0.4, stop_rule="cost", guard=False),
        metrics={"score": 0.5, "speedup": 1.1}, search={"study_name": "s"},
    )
    fields.update(overrides)
    return SkipConfig(**fields)


def test_round_trip(tmp_path):
    model = tiny_model()
    config = make_config(model)
    save_skip_config(config, tmp_path / "best.json")
    loaded = load_skip_config(tmp_path / "best.json", model)
    assert loaded == config
    data = json.loads((tmp_path / "best.json").read_text())
    assert data["format"] == FORMAT and data["version"] == 1
    assert data["model"] == {"name_or_path": "tiny", "architecture": "LlamaForCausalLM", "num_hidden_layers": 4,
                             "hidden_size": 32}
    assert [p.name for p in tmp_path.iterdir()] == ["best.json"]  # no temp file left behind


def test_configs_written_before_the_guard_load_with_it_on(tmp_path):
    """Version 1 files without "stop_rule" and "guard" (every earlier export) load with today's defaults."""
    model = tiny_model()
    data = make_config(model).to_json()
    del data["draft"]["stop_rule"], data["draft"]["guard"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    draft = load_skip_config(tmp_path / "old.json", model).draft
    assert (draft.stop_rule, draft.guard, draft.max_draft_tokens) == ("threshold", True, 5)


def test_other_model_is_refused(tmp_path):
    save_skip_config(make_config(tiny_model()), tmp_path / "best.json")
    with pytest.raises(ValueError, match="num_hidden_layers=4"):
        load_skip_config(tmp_path / "best.json", tiny_model(num_layers=6))
    with pytest.raises(ValueError, match="architecture"):
        load_skip_config(tmp_path / "best.json", tiny_model("qwen2"))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format="other"), "not a skipsearch skip config"),
        (lambda d: d.update(version=2), "unsupported version 2"),
        (lambda d: d["skip"].update(attn=[0, 4]), "out of range"),
        (lambda d: d["skip"].update(mlp=[1, 1]), "duplicates"),
        (lambda d: d["skip"].pop("attn"), "missing skip.'attn'"),
        (lambda d: d["model"].update(num_hidden_layers="4"), "wrong type"),
        (lambda d: d["draft"].update(confidence_threshold=2.0), r"confidence_threshold must be in \[0, 1\]"),
        (lambda d: d.update(draft=[1, 2]), r"'draft' has the wrong type \(list\)"),
        (lambda d: d["draft"].update(confidence_threshold=None), r"draft.'confidence_threshold' has the wrong type"),
        (lambda d: d["draft"].update(max_draft_tokens=2.5), r"draft.'max_draft_tokens' has the wrong type"),
        (lambda d: d["draft"].update(adaptive="yes"), r"draft.'adaptive' has the wrong type"),
        (lambda d: d.update(metrics=[]), r"'metrics' has the wrong type"),
        (lambda d: d["draft"].update(stop_rule="fast"), r"stop_rule must be one of threshold, cost, got 'fast'"),
        (lambda d: d["draft"].update(guard="on"), r"draft.'guard' has the wrong type"),
    ],
)
def test_bad_configs_are_clear_errors(tmp_path, mutate, message):
    data = make_config(tiny_model()).to_json()
    mutate(data)
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_skip_config(tmp_path / "c.json")


def test_unreadable_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_skip_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_skip_config(tmp_path / "bad.json")


def test_a_draft_and_verify_file_is_named_as_such():
    from skipsearch.config import parse_skip_config
    from skipsearch.skipping import SkipSet
    from skipsearch.warmstart import dv_json

    with pytest.raises(ValueError, match="Draft & Verify / SWIFT skip file .*optimize --warm-start"):
        parse_skip_config(dv_json("smollm2", SkipSet.of([3], [5], 30)))


def test_configs_models_and_plots_do_not_import_the_decode_loop():
    """They read the draft policy from policy.py and write files through files.py, not through decoding.py."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, skipsearch.config, skipsearch.models, skipsearch.plots; "
            "print(sorted(name for name in sys.modules if name in ('skipsearch.decoding', 'skipsearch.engine')))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr
