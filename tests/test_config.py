import json
from dataclasses import replace

import pytest

from conftest import tiny_model
from skipsearch.decode.config import (FORMAT, ModelInfo, SkipConfig, SkipEntry, combine_skip_configs, load_skip_config,
                                      parse_skip_config, save_skip_config)
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.provenance import BestSkipping, ConfigMetrics, ConfigSearch
from skipsearch.decode.skipset import SkipSet


def make_config(model, **overrides):
    fields = dict(
        model=ModelInfo.of(model, "tiny"), skip=SkipSet.of([0, 2], [3], 4),
        draft=DraftPolicy(max_draft_tokens=5, adaptive=False),
        metrics=ConfigMetrics(score=0.5, speedup=1.1), search=ConfigSearch(study_name="s"),
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
                             "hidden_size": 32, "vocab_size": 96}
    assert [p.name for p in tmp_path.iterdir()] == ["best.json"]  # no temp file left behind


def test_the_guard_is_written_where_it_differs_and_the_old_rules_fields_load_with_a_warning(tmp_path):
    """Earlier exports have no "guard": they load with the guard on, and a config with it on is written as before;
    their old rules' fields ("stop_rule", "confidence_threshold", ...) load, ignored, with a one-line warning."""
    model = tiny_model()
    data = make_config(model).to_json()
    assert data["draft"] == {"max_draft_tokens": 5, "adaptive": False}
    old = {**data["draft"], "confidence_threshold": 0.4, "target_acceptance": 0.7, "threshold_step": 0.05,
           "stop_rule": "cost"}
    (tmp_path / "old.json").write_text(json.dumps({**data, "draft": old}))
    with pytest.warns(FutureWarning, match=r"draft.confidence_threshold, .*draft.stop_rule: no longer used") as seen:
        draft = load_skip_config(tmp_path / "old.json", model).draft
    assert len(seen) == 1 and len(str(seen[0].message).splitlines()) == 1
    assert draft == DraftPolicy(max_draft_tokens=5, adaptive=False, guard=True)
    chosen = make_config(model, draft=DraftPolicy(guard=False))
    save_skip_config(chosen, tmp_path / "unguarded.json")
    assert json.loads((tmp_path / "unguarded.json").read_text())["draft"]["guard"] is False
    assert load_skip_config(tmp_path / "unguarded.json", model) == chosen


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
        (lambda d: d.update(version=3), r"unsupported version 3 \(this skipsearch reads versions 1 and 2\)"),
        (lambda d: d.update(version=True), "unsupported version True"),
        (lambda d: d["skip"].update(attn=[0, 4]), "out of range"),
        (lambda d: d["skip"].update(mlp=[1, 1]), "duplicates"),
        (lambda d: d["skip"].pop("attn"), "missing skip.'attn'"),
        (lambda d: d["model"].update(num_hidden_layers="4"), "wrong type"),
        (lambda d: d.update(draft=[1, 2]), r"'draft' has the wrong type \(list\)"),
        (lambda d: d["draft"].update(max_draft_tokens=2.5), r"draft.'max_draft_tokens' has the wrong type"),
        (lambda d: d["draft"].update(adaptive="yes"), r"draft.'adaptive' has the wrong type"),
        (lambda d: d.update(metrics=[]), r"'metrics' has the wrong type \(list\), expected an object"),
        (lambda d: d["metrics"].update(speedup="fast"), r"metrics.'speedup' has the wrong type \(str\), expected a number$"),
        (lambda d: d["metrics"].update(confirmed=1), r"metrics.'confirmed' has the wrong type \(int\)"),
        (lambda d: d["metrics"].update(paired_runs=True), r"metrics.'paired_runs' has the wrong type \(bool\)"),
        (lambda d: d["metrics"].update(best_skipping={"trial": 1}), "metrics.'best_skipping' is not a trial with a"),
        (lambda d: d["metrics"].update(best_skipping=[1]), "metrics.'best_skipping' is not a trial with a"),
        (lambda d: d["metrics"].update(best_skipping={"trial": 1, "skip": {"head_rows": "x"}}),
         r"metrics.best_skipping.skip.'head_rows' has the wrong type"),
        (lambda d: d["metrics"].update(best_skipping={"trial": 1, "skip": {}, "speedup": "x"}),
         r"metrics.best_skipping.'speedup' has the wrong type"),
        (lambda d: d["metrics"].update(best_skipping={"trial": 1, "skip": {"attn": ["0"]}}),
         r"metrics.best_skipping.skip has the wrong type"),
        (lambda d: d.update(search="s"), r"'search' has the wrong type \(str\), expected an object"),
        (lambda d: d["search"].update(dataset=[1]), r"search.'dataset' has the wrong type \(list\)"),
        (lambda d: d["search"].update(category_studies={"qa": 3}), r"search.'category_studies' has the wrong type"),
        (lambda d: d["draft"].update(guard="on"), r"draft.'guard' has the wrong type"),
    ],
)
def test_bad_configs_are_clear_errors(tmp_path, mutate, message):
    data = make_config(tiny_model()).to_json()
    mutate(data)
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_skip_config(tmp_path / "c.json")


def test_a_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_skip_config(tmp_path / "missing.json")


@pytest.mark.parametrize("text, message", [
    ("{not json", r"not valid JSON \(Expecting property name enclosed in double quotes at column 2\)"),
    ('{\n  "attn": [1,\n    2 3]}\n', r"not valid JSON \(Expecting ',' delimiter at line 3 column 7\)"),
    # Cut short after its first line: the error is on line 2, column 1, which for a one-line text read "column 1",
    # the start of the file.
    ('{"version": 1, "attn": [\n', r"not valid JSON \(Expecting value at its end: cut short\?\)"),
    ('{"version": 1, "model": {"name_or_path": "Hugg', r"not valid JSON \(Unterminated string at its end: cut short"),
    (" \n", r"bad.json': empty, not JSON$"),
])
def test_a_damaged_config_says_what_is_wrong_and_where(tmp_path, text, message):
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_skip_config(tmp_path / "bad.json")


def test_a_draft_and_verify_file_is_named_as_such():
    from skipsearch.decode.config import parse_skip_config
    from skipsearch.decode.skipset import SkipSet
    from skipsearch.search.warmstart import dv_json

    with pytest.raises(ValueError, match="Draft & Verify / SWIFT skip file .*optimize --warm-start"):
        parse_skip_config(dv_json("smollm2", SkipSet.of([3], [5], 30)))


def test_configs_models_and_plots_do_not_import_the_decode_loop():
    """They read the draft policy from policy.py and write files through files.py, not through the decode loop."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, skipsearch.decode.config, skipsearch.io.models, skipsearch.report.plots; "
            "print(sorted(name for name in sys.modules if name in ('skipsearch.decode.loop', 'skipsearch.decode.engine')))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


def several(model):
    return SkipConfig.of_entries(
        ModelInfo.of(model, "tiny"), [SkipEntry(SkipSet.of([1], [], 4), "code.jsonl", ConfigMetrics(speedup=1.2)),
                                      SkipEntry(SkipSet.of([], [2], 4), "chat.jsonl", ConfigMetrics(speedup=1.1))],
        DraftPolicy(max_draft_tokens=5, adaptive=False),
        ConfigSearch(study_name="s", dataset=["code.jsonl", "chat.jsonl"]))


def test_several_sets_round_trip_as_version_2(tmp_path):
    model = tiny_model()
    config = several(model)
    assert config.skip_sets == (SkipSet.of([1], [], 4), SkipSet.of([], [2], 4)) and config.label == "code.jsonl"
    save_skip_config(config, tmp_path / "best.json")
    data = json.loads((tmp_path / "best.json").read_text())
    assert data["version"] == 2 and "skip" not in data and "metrics" not in data
    assert data["skips"] == [{"label": "code.jsonl", "skip": {"attn": [1], "mlp": []}, "metrics": {"speedup": 1.2}},
                             {"label": "chat.jsonl", "skip": {"attn": [], "mlp": [2]}, "metrics": {"speedup": 1.1}}]
    assert load_skip_config(tmp_path / "best.json", model) == config
    single = SkipConfig.of_entries(config.model, config.entries[:1], config.draft, ConfigSearch())
    assert single.to_json()["skips"][0]["label"] == "code.jsonl"  # a label is kept: version 2 with one set
    assert make_config(model).to_json()["version"] == 1  # one unlabelled set: version 1, which every release reads


def test_a_version_1_file_still_loads(tmp_path):
    data = {"format": FORMAT, "version": 1, "skip": {"attn": [2], "mlp": []},
            "model": {"name_or_path": "x", "architecture": "LlamaForCausalLM", "num_hidden_layers": 4,
                      "hidden_size": 32}}
    config = parse_skip_config(data)
    assert config.skip_sets == (SkipSet.of([2], [], 4),) and config.others == () and config.label is None
    assert config.metrics == ConfigMetrics() and config.search == ConfigSearch() and config.draft == DraftPolicy()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("skips"), "missing 'skips'"),
    (lambda d: d.update(skips=[]), "'skips' is empty"),
    (lambda d: d.update(skips={"a": 1}), r"'skips' has the wrong type \(dict\)"),
    (lambda d: d["skips"].append(3), r"skips\[2\] has the wrong type \(int\), expected an object"),
    (lambda d: d["skips"][1].pop("skip"), r"missing skips\[1\].'skip'"),
    (lambda d: d["skips"][1]["skip"].pop("mlp"), r"missing skips\[1\].skip.'mlp'"),
    (lambda d: d["skips"][1]["skip"].update(attn=[9]), "attn skip id 9 is out of range"),
    (lambda d: d["skips"][1].update(label=7), r"skips\[1\].'label' has the wrong type \(int\)"),
    (lambda d: d["skips"][1].update(metrics=[]), r"skips\[1\].'metrics' has the wrong type \(list\)"),
    (lambda d: d["skips"][1].update(skip=d["skips"][0]["skip"]), r"skips\[1\] repeats an earlier skip set"),
])
def test_bad_version_2_configs_are_one_line_errors(tmp_path, mutate, message):
    data = several(tiny_model()).to_json()
    mutate(data)
    (tmp_path / "c.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as raised:
        load_skip_config(tmp_path / "c.json")
    assert str(raised.value).startswith(str(tmp_path / "c.json")) and len(str(raised.value).splitlines()) == 1


def test_configs_combine_into_one_of_several_sets():
    model = tiny_model()
    first, second = make_config(model), several(model)
    combined = combine_skip_configs([first, second, first], ["a.json", "b.json", "a.json"])
    assert combined.skip_sets == (first.skip, *second.skip_sets)  # the repeated set kept once
    assert [entry.label for entry in combined.entries] == ["a.json", "code.jsonl", "chat.jsonl"]
    assert combined.entries[1].metrics == ConfigMetrics(speedup=1.2) and combined.model == first.model
    assert combine_skip_configs([first]).label is None  # no sources: no labels made up


def test_combined_configs_keep_every_configs_vocabulary_and_tokenizer_checks():
    """A config from before trimmed heads knows neither (None); combined first with one that does, the checks of the
    second still apply to the whole."""
    from skipsearch.decode.skipset import DraftHead

    model = tiny_model()
    old = make_config(model)
    old = replace(old, model=replace(old.model, vocab_size=None, tokenizer=None))
    headed = make_config(model, skip=SkipSet.of([1], [], 4, DraftHead(tuple(range(8)))))
    headed = replace(headed, model=replace(headed.model, tokenizer="a" * 64))
    combined = combine_skip_configs([old, headed])
    assert (combined.model.vocab_size, combined.model.tokenizer) == (96, "a" * 64)
    other = type("Tokenizer", (), {"get_vocab": lambda self: {"x": 0}})()
    with pytest.raises(ValueError, match="made for another tokenizer"):
        combined.check_tokenizer(other)
    with pytest.raises(ValueError, match="are for different models \\(tokenizer="):
        combine_skip_configs([headed, replace(headed, model=replace(headed.model, tokenizer="b" * 64))])
    with pytest.raises(ValueError, match="are for different models \\(vocab_size=96 and 128\\)"):
        combine_skip_configs([headed, replace(headed, model=replace(headed.model, vocab_size=128))])


def test_metrics_and_search_round_trip_typed_and_read_older_files():
    """Every figure and setting survives a save and a load; an older file's nulls read as unknown, and a field this
    release does not know is ignored."""
    model = tiny_model()
    best = BestSkipping(4, (1,), (), 64, ConfigMetrics(speedup=0.93, speedup_low=0.9, speedup_high=0.97, paired_runs=6))
    metrics = ConfigMetrics(objective="speed_x_acceptance", score=1.0, speedup=1.0, tokens_per_second=50.5,
                            baseline_tokens_per_second=50.5, confirmed=True, verdict="none pays", best_skipping=best)
    search = ConfigSearch(study_name="s", trial_number=None, sampler="tpe", dataset=["a.jsonl", "b.jsonl"],
                          num_prompts=8, max_new_tokens=64, device="cpu", dtype="float32", confirm_repeats=3,
                          created_at="2026-11-28T00:00:00+00:00", categories=["qa"], category_studies={"qa": None})
    data = make_config(model, metrics=metrics, search=search).to_json()
    assert data["metrics"]["best_skipping"] == {"trial": 4, "skip": {"attn": [1], "mlp": [], "head_rows": 64},
                                                "speedup": 0.93, "speedup_low": 0.9, "speedup_high": 0.97,
                                                "paired_runs": 6}
    assert "trial_number" not in data["search"] and "acceptance_rate" not in data["metrics"]  # unknown: left out
    data["search"]["categories"].append("rag")  # the JSON is a copy: the config is not changed through it
    assert search.categories == ["qa"]
    data["search"]["categories"].pop()
    loaded = parse_skip_config(json.loads(json.dumps(data)))
    assert loaded.metrics == metrics and loaded.search == search
    data["metrics"].update(acceptance_rate=None, best_skipping=None, figure_of_a_later_release=3)
    data["search"].update(trial_number=None, seed=0)
    older = parse_skip_config(data)
    assert older.metrics == replace(metrics, best_skipping=None) and older.search == search


def test_null_reads_as_absent_wherever_a_field_is_optional(tmp_path):
    """A hand-edited or another tool's config may write null for what it does not know: it loads as if absent. How
    to draft is no such field: a null there is refused (tests/test_bad_input.py), not decoded with defaults."""
    model = tiny_model()
    data = make_config(model).to_json()
    data.update(metrics=None, search=None)
    data["model"].update(vocab_size=None, tokenizer=None)
    config = parse_skip_config(data)
    assert (config.metrics, config.search, config.model.vocab_size, config.model.tokenizer) == (
        ConfigMetrics(), ConfigSearch(), None, None)
    version_2 = several(model).to_json()
    version_2["skips"][0]["metrics"] = None
    assert parse_skip_config(version_2).entries[0].metrics == ConfigMetrics()
    with pytest.raises(ValueError, match=r"missing 'version' \(this skipsearch reads versions 1 and 2\)"):
        parse_skip_config({**data, "version": None})
