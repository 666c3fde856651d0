"""Warm starts from files (skipsearch configs, Draft & Verify / SWIFT skip_layers.json), the published sets, and
`export --format dv`."""

import json
import re

import optuna
import pytest

from skipsearch.cli import main
from skipsearch.decode.config import ModelInfo, SkipConfig, save_skip_config
from skipsearch.decode.skipset import SkipSet
from skipsearch.search import published
from skipsearch.search.warmstart import dv_json, dv_name, parse_skip_sets, read_warm_starts

TINY = ModelInfo("tiny", "LlamaForCausalLM", 4, 32)  # the shape of conftest's tiny_model_dir


def optimize(tmp_path, model_dir, *extra, study="ws", n_trials=2):
    return main([str(a) for a in ["optimize", "--model", model_dir, "--studies-dir", tmp_path / "studies",
                                  "--study-name", study, "--n-trials", n_trials, "--num-prompts", 1,
                                  "--max-new-tokens", 4, "--no-progress", "--no-plots", "--min-match", 0, *extra]])


def first_skip_sets(tmp_path, study, n):
    trials = optuna.load_study(study_name=study, storage=f"sqlite:///{tmp_path}/studies/{study}.db").trials[:n]
    return [(t.user_attrs["warm_start"], t.user_attrs["skip_attn"], t.user_attrs["skip_mlp"]) for t in trials]


def test_read_both_formats_and_pick_one_entry(tmp_path):
    (tmp_path / "dv.json").write_text(json.dumps({"a": {"attention": [2, 1], "mlp": []}, "b": {"attention": [],
                                                                                                "mlp": [2]}}))
    save_skip_config(SkipConfig(model=TINY, skip=SkipSet.of([1], [2], 4)), tmp_path / "best.json")
    both = read_warm_starts(str(tmp_path / "dv.json"))
    assert [(s.name, s.attn, s.mlp, s.model) for s in both] == [("a", (1, 2), (), None), ("b", (), (2,), None)]
    [b] = read_warm_starts(f"{tmp_path / 'dv.json'}:b")
    assert b.origin.endswith("dv.json:b") and b.skip_set(4) == SkipSet.of([], [2])
    [config] = read_warm_starts(str(tmp_path / "best.json"))
    assert config.skip_set(4) == SkipSet.of([1], [2]) and config.matches(TINY)


@pytest.mark.parametrize("content, spec_suffix, message", [
    ({"a": {"attention": [1], "mlp": []}}, ":nope", "has no entry 'nope': it has a"),
    ({"a": {"attention": [1]}}, "", r"expected \{\"attention\""),
    ({"a": {"attention": [1, 1], "mlp": []}}, "", "duplicates"),
    ([1, 2], "", "expected a skipsearch skip config"),
    (None, "", "does not exist"),
])
def test_unreadable_warm_start_files(tmp_path, content, spec_suffix, message):
    path = tmp_path / "w.json"
    if content is not None:
        path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        read_warm_starts(f"{path}{spec_suffix}")


def test_optimize_enqueues_warm_starts_first(capsys, tmp_path, tiny_model_dir):
    (tmp_path / "dv.json").write_text(json.dumps({"a": {"attention": [1], "mlp": [2]}, "b": {"attention": [2],
                                                                                              "mlp": []}}))
    save_skip_config(SkipConfig(model=TINY, skip=SkipSet.of([], [1], 4)), tmp_path / "mine.json")
    code = optimize(tmp_path, tiny_model_dir, "--warm-start", f"{tmp_path / 'dv.json'}:a",
                    "--warm-start", tmp_path / "mine.json", n_trials=3)
    out = capsys.readouterr().out
    assert code == 0 and "warm starts: " in out
    assert first_skip_sets(tmp_path, "ws", 3) == [
        (f"{tmp_path / 'dv.json'}:a", [1], [2]), (str(tmp_path / "mine.json"), [], [1]), (True, [], [])]


@pytest.mark.parametrize("entry, message", [
    ({"attention": [1, 7], "mlp": []}, r"attn skip id 7 is out of range: layer ids are 0\.\.3"),
    ({"attention": [0], "mlp": []}, "outside the search space.*--allow-first-last"),
    ({"attention": [1, 2], "mlp": [1, 2], "model": {"architecture": "LlamaForCausalLM", "num_hidden_layers": 40,
                                                    "hidden_size": 5120}}, "made for another model"),
])
def test_bad_warm_start_is_one_line_exit_2_nothing_written(capsys, tmp_path, tiny_model_dir, entry, message):
    (tmp_path / "dv.json").write_text(json.dumps({"x": entry}))
    code = optimize(tmp_path, tiny_model_dir, "--warm-start", tmp_path / "dv.json")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err)
    assert not (tmp_path / "studies").exists()


def test_a_configs_trimmed_head_warm_starts_the_studys_head_of_its_size(capsys, tmp_path, tiny_model_dir):
    from skipsearch.decode.skipset import DraftHead

    head = DraftHead(tuple(range(0, 2048, 4)))  # 512 rows of the tiny model's vocabulary (the default model's)
    save_skip_config(SkipConfig(model=TINY, skip=SkipSet.of([1], [], 4, head)), tmp_path / "best.json")
    assert parse_skip_sets(json.loads((tmp_path / "best.json").read_text()), "best.json")[0].skip_set(4).head == head
    code = optimize(tmp_path, tiny_model_dir, "--warm-start", tmp_path / "best.json", "--head-rows", "none")
    err = capsys.readouterr().err
    assert code == 2 and "a head of 512 rows, a size the search does not try (the full head only)" in err
    assert not (tmp_path / "studies").exists()
    code = optimize(tmp_path, tiny_model_dir, "--warm-start", tmp_path / "best.json", "--head-rows", "512,1024",
                    "--no-warm-starts", n_trials=1)
    assert code == 0, capsys.readouterr().err
    [trial] = optuna.load_study(study_name="ws", storage=f"sqlite:///{tmp_path}/studies/ws.db").trials[:1]
    assert trial.params["head_rows"] == 512 and trial.user_attrs["skip_head_rows"] == 512
    assert trial.user_attrs["skip_attn"] == [1] and trial.user_attrs["warm_start"] == str(tmp_path / "best.json")


def test_unknown_name_and_missing_file_exit_2_before_loading(capsys, tmp_path):
    (tmp_path / "dv.json").write_text(json.dumps({"a": {"attention": [1], "mlp": []}}))
    for spec, message in ((f"{tmp_path / 'dv.json'}:b", "has no entry 'b'"), (tmp_path / "no.json", "does not exist")):
        code = optimize(tmp_path, "/nonexistent/model", "--warm-start", spec)
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "studies").exists()


def test_export_dv_round_trips_into_a_warm_start(capsys, tmp_path, tiny_model_dir):
    (tmp_path / "dv.json").write_text(json.dumps({"a": {"attention": [1, 2], "mlp": [2]}}))
    assert optimize(tmp_path, tiny_model_dir, "--warm-start", tmp_path / "dv.json", "--no-warm-starts") == 0
    out_file = tmp_path / "skip_layers.json"
    code = main(["export", "--studies-dir", str(tmp_path / "studies"), "--study-name", "ws", "--trial", "0",
                 "--format", "dv", "--output", str(out_file)])
    assert code == 0
    data = json.loads(out_file.read_text())
    assert data == {dv_name(ModelInfo(str(tiny_model_dir), "LlamaForCausalLM", 4, 32)):
                    {"attention": [1, 2], "mlp": [2]}}
    capsys.readouterr()
    assert optimize(tmp_path, tiny_model_dir, "--warm-start", out_file, "--no-warm-starts", study="again") == 0
    assert first_skip_sets(tmp_path, "again", 1)[0][1:] == ([1, 2], [2])


def test_a_trimmed_head_is_refused_by_the_dv_format(tmp_path):
    from skipsearch.decode.skipset import DraftHead
    from skipsearch.report.export import write_dv

    config = SkipConfig(model=TINY, skip=SkipSet.of([1], [], 4, DraftHead((2, 3, 5))))
    with pytest.raises(ValueError, match="trimmed head of 3 rows, which the Draft & Verify format cannot hold"):
        write_dv(config, tmp_path / "skip_layers.json")
    assert not (tmp_path / "skip_layers.json").exists()


def test_dv_name_and_json():
    assert dv_name(ModelInfo("meta-llama/Llama-2-13b-hf", "LlamaForCausalLM", 40, 5120)) == "llama-2-13b-hf"
    assert dv_json("m", SkipSet.of([3], [1, 2])) == {"m": {"attention": [3], "mlp": [1, 2]}}
    [entry] = parse_skip_sets(dv_json("m", SkipSet.of([3], [1, 2])), "x.json")
    assert (entry.name, entry.attn, entry.mlp) == ("m", (3,), (1, 2))


def test_published_sets_are_valid_and_sourced():
    sets = published.published_skip_sets()
    names = {s.name for s in sets}
    assert {"llama-2-13b", "llama-2-70b", "codellama-13b", "codellama-34b_humaneval"} <= names
    for entry in sets:
        assert entry.model is not None and entry.skip_set(entry.model["num_hidden_layers"]).size > 0
    raw = [e for p in published.PUBLISHED_DIR.glob("*.json") for e in json.loads(p.read_text()).values()]
    assert raw and all(e["source"]["repo"].startswith("https://github.com/") and e["source"]["commit"] for e in raw)


def test_published_sets_match_by_architecture_layers_and_hidden_size():
    llama13 = published.matching_skip_sets(ModelInfo("any/13b", "LlamaForCausalLM", 40, 5120))
    assert {s.name for s in llama13} >= {"llama-2-13b", "llama-2-13b-chat", "codellama-13b", "llama-2-13b_cnndm"}
    assert all(s.model["num_hidden_layers"] == 40 for s in llama13)
    assert {s.name for s in published.matching_skip_sets(ModelInfo("m", "LlamaForCausalLM", 80, 8192))} == {
        "llama-2-70b", "llama-2-70b_cnndm"}
    assert published.matching_skip_sets(ModelInfo("m", "MistralForCausalLM", 40, 5120)) == []
    assert published.matching_skip_sets(ModelInfo("m", "LlamaForCausalLM", 40, 4096)) == []


def test_matching_published_sets_become_first_trials(capsys, tmp_path, tiny_model_dir, monkeypatch):
    shape = {"architecture": "LlamaForCausalLM", "num_hidden_layers": 4, "hidden_size": 32}
    folder = tmp_path / "published"
    folder.mkdir()
    (folder / "paper.json").write_text(json.dumps({
        "fits": {"attention": [2], "mlp": [1], "model": shape},
        "keeps-last": {"attention": [3], "mlp": [], "model": shape},
        "other-model": {"attention": [1], "mlp": [], "model": {**shape, "hidden_size": 64}},
    }))
    monkeypatch.setattr(published, "PUBLISHED_DIR", folder)
    assert optimize(tmp_path, tiny_model_dir) == 0
    out = capsys.readouterr().out
    assert "published skip set published/paper.json:keeps-last left out" in out and "other-model" not in out
    assert first_skip_sets(tmp_path, "ws", 1) == [("published/paper.json:fits", [2], [1])]


def test_a_config_of_several_sets_warm_starts_each(tmp_path):
    from skipsearch.decode.config import SkipEntry
    from skipsearch.decode.policy import DraftPolicy

    entries = [SkipEntry(SkipSet.of([1], [], 4), "code.jsonl"), SkipEntry(SkipSet.of([], [2], 4), None)]
    save_skip_config(SkipConfig.of_entries(TINY, entries, DraftPolicy()), tmp_path / "best.json")
    sets = read_warm_starts(str(tmp_path / "best.json"))
    assert [(s.name, s.skip_set(4), s.origin.rsplit(":", 1)[-1]) for s in sets] == [
        ("code.jsonl", entries[0].skip, "code.jsonl"), ("best[1]", entries[1].skip, "best[1]")]
    assert all(s.matches(TINY) for s in sets)
    [chosen] = read_warm_starts(f"{tmp_path / 'best.json'}:best[1]")
    assert chosen.skip_set(4) == entries[1].skip
