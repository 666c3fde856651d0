import json
import re

import pytest

from skipsearch.cli import main
from skipsearch.decode.policy import DraftPolicy


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_matches_autoregressive(capsys, tiny_model_dir):
    # float64: a random model over a 49k vocabulary has fp32 near-ties that batched verification may flip.
    common = ["generate", "--model", tiny_model_dir, "--prompt", "hello there", "--max-new-tokens", 12, "--json",
              "--dtype", "float64"]
    code, out, _ = run(capsys, *common, "--skip-attn", "1,2", "--skip-mlp", "0", "--fixed-draft")
    assert code == 0
    drafted = json.loads(out)
    code, out, _ = run(capsys, *common, "--autoregressive")
    plain = json.loads(out)
    assert drafted["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) >= 1
    assert drafted["skip"] == {"attn": [1, 2], "mlp": [0]} and drafted["stats"]["drafted"] > 0
    assert plain["stats"]["drafted"] == 0 and isinstance(plain["text"], str)
    assert plain["stats"]["compile_time_s"] == 0.0  # eager: the JSON says a slow first call was not a compile


def test_generate_summary_counts_rounds_only_where_it_drafted(capsys, tiny_model_dir):
    """Plain decoding runs steps, not rounds of drafts: its summary line names none (it read "31 rounds")."""
    common = ["generate", "--model", tiny_model_dir, "--prompt", "hello there", "--max-new-tokens", 6]
    code, out, err = run(capsys, *common, "--autoregressive")
    assert code == 0 and out.strip() and "rounds" not in err and "skip none (plain decoding)" in err
    code, _, err = run(capsys, *common, "--skip-attn", "1,2", "--fixed-draft")
    assert code == 0 and re.search(r"tok/s, \d+ rounds, acceptance [\d.]+ \(\d+/\d+\), skip ", err)


def test_generate_reads_a_config(capsys, tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from skipsearch.decode.config import ModelInfo, SkipConfig, save_skip_config
    from skipsearch.decode.skipset import SkipSet

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_skip_config(SkipConfig(model=ModelInfo.of(model, str(tiny_model_dir)), skip=SkipSet.of([3], [1], 4)),
                     tmp_path / "best.json")
    code, out, _ = run(capsys, "generate", "--model", tiny_model_dir, "--prompt", "hi", "--max-new-tokens", 5,
                       "--config", tmp_path / "best.json", "--json")
    assert code == 0 and json.loads(out)["skip"] == {"attn": [3], "mlp": [1]}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--skip-attn", "1,9"], "out of range"),
        (["--skip-attn", "a,b"], "comma-separated layer ids"),
        (["--max-new-tokens", "0"], "integer >= 1"),
        (["--top-p", "1.5"], r"number in \(0, 1\]"),
        (["--top-p", "0"], r"number in \(0, 1\]"),  # before the model loads, as every flag's range
        (["--config", "/nonexistent/best.json"], "does not exist"),
        (["--config", "x.json", "--skip-mlp", "1"], "either --config or --skip-attn"),
        (["--skip-attn", "1", "--max-draft-tokens", "0"], "drafts nothing, so the skip set would never be used"),
        (["--temperature", "0.7", "--top-k", "5"], r"error: --temperature, --top-k shape sampling: add --do-sample"),
        (["--seed", "3"], r"error: --seed shapes sampling: add --do-sample"),
        (["--do-sample", "--memory", "m.json"], "--do-sample plans its rounds without them .* give one or the other"),
    ],
)
def test_generate_bad_input_is_one_line_and_exit_2(capsys, tiny_model_dir, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        code = main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", *argv])
        raise SystemExit(code)
    _, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and re.search(message, err)


def test_generate_samples_the_same_text_from_one_seed_on_a_busy_clock(capsys, tiny_model_dir, monkeypatch):
    """Each draft draws random numbers, so rounds planned by the clock gave one --seed other tokens run to run."""
    import itertools
    import random

    from skipsearch.decode import loop as decoding

    def sampled(seed: int, noise: int) -> list[int]:
        draws, now = random.Random(noise), itertools.count()
        monkeypatch.setattr(decoding, "ROUND_CLOCK", lambda: next(now) * 1e-3 + draws.expovariate(20.0))
        code, out, _ = run(capsys, "generate", "--model", tiny_model_dir, "--prompt", "hello there", "--json",
                           "--max-new-tokens", 40, "--skip-attn", "1,2", "--do-sample", "--seed", seed)
        assert code == 0
        return json.loads(out)["token_ids"]

    assert sampled(3, noise=1) == sampled(3, noise=2) != sampled(4, noise=1)


def optimize_args(model_dir, studies, *extra, n_trials=4):
    return ["optimize", "--model", model_dir, "--studies-dir", studies, "--study-name", "cli", "--n-trials", n_trials,
            "--num-prompts", 2, "--max-new-tokens", 6, "--no-progress", "--min-match", 0, *extra]


def test_optimize_exports_plots_and_resumes(capsys, tmp_path, tiny_model_dir):
    from skipsearch.decode.config import load_skip_config

    code, out, _ = run(capsys, *optimize_args(tiny_model_dir, tmp_path))
    assert code == 0
    assert (tmp_path / "cli.db").is_file() and "exported" in out and "plain decoding" in out
    best = load_skip_config(tmp_path / "cli" / "best.json")
    assert best.search.study_name == "cli" and best.model.num_hidden_layers == 4
    assert {p.name for p in (tmp_path / "cli" / "plots").iterdir()} >= {"history.png", "skip_map.png"}
    code, out, _ = run(capsys, *optimize_args(tiny_model_dir, tmp_path, "--no-plots", n_trials=6))
    assert code == 0 and "study cli in " in out and ": 6 distinct skip sets evaluated" in out
    import optuna

    from skipsearch.search.study import distinct_trials

    study = optuna.load_study(study_name="cli", storage=f"sqlite:///{tmp_path}/cli.db")
    assert len(distinct_trials(study)) == 6

    code, out, _ = run(capsys, "export", "--studies-dir", tmp_path, "--study-name", "cli", "--trial", 1,
                       "--output", tmp_path / "t1.json")
    assert code == 0 and load_skip_config(tmp_path / "t1.json").search.trial_number == 1
    code, out, _ = run(capsys, "plot", "--studies-dir", tmp_path, "--study-name", "cli", "--output", tmp_path / "p")
    assert code == 0 and len(out.split()) == 4


def test_optimize_searches_the_draft_head_and_its_config_decodes_as_plain_greedy(capsys, tmp_path, tiny_model_dir):
    """--head-rows: the head's size is a parameter beside the sublayers, warm-started through each trimmed head; a
    trial's export carries its head (a bitmap of the study's top-ranked ids, EOS among them) and the tokenizer it was
    made for; generate --config decodes exactly as plain greedy; a config edited to another tokenizer, or a head that
    does not fit the model, is one line and exit 2."""
    import optuna

    from skipsearch.decode.config import load_skip_config
    from skipsearch.io.models import load_model
    from skipsearch.search.records import read_trials, read_vocabulary

    code, out, _ = run(capsys, *optimize_args(tiny_model_dir, tmp_path, "--head-rows", "64,128", "--no-plots"))
    assert code == 0
    study = optuna.load_study(study_name="cli", storage=f"sqlite:///{tmp_path}/cli.db")
    trials = read_trials(study)
    assert [t.skip.head_rows for t in trials[:3]] == [None, 128, 64]  # plain, then each head with nothing skipped
    ranking = read_vocabulary(study)
    loaded = load_model(str(tiny_model_dir), dtype="float64")
    assert len(ranking.ids) == 128 and ranking.ids[0] == loaded.tokenizer.eos_token_id
    code, _, _ = run(capsys, "export", "--studies-dir", tmp_path, "--study-name", "cli", "--trial", 1,
                     "--output", tmp_path / "t1.json")
    assert code == 0
    data = json.loads((tmp_path / "t1.json").read_text())
    assert data["skip"]["head"]["rows"] == 128 and data["model"]["vocab_size"] == len(loaded.tokenizer)
    config = load_skip_config(tmp_path / "t1.json", loaded.model, loaded.tokenizer)
    assert set(config.skip.head.ids) == set(ranking.ids)
    common = ["generate", "--model", tiny_model_dir, "--prompt", "hello there", "--max-new-tokens", 12, "--json",
              "--dtype", "float64"]
    code, out, _ = run(capsys, *common, "--config", tmp_path / "t1.json", "--fixed-draft", "--no-guard")
    drafted = json.loads(out)
    code, out, _ = run(capsys, *common, "--autoregressive")
    assert drafted["token_ids"] == json.loads(out)["token_ids"] and drafted["stats"]["drafted"] > 0
    assert drafted["skip"]["head_rows"] == 128
    for edit, message in ((lambda d: d["model"].update(tokenizer="0" * 64), "another tokenizer"),
                          (lambda d: d["skip"]["head"].update(rows=0), "integers >= 1"),
                          (lambda d: d["skip"]["head"].update(rows=3), "holds 128 ids, not the 3"),
                          (lambda d: d["skip"]["head"].update(bitmap="%%"), "not base64"),
                          (lambda d: d["model"].update(vocab_size=10**6), "vocab_size=1000000")):
        changed = json.loads(json.dumps(data))
        edit(changed)
        (tmp_path / "bad.json").write_text(json.dumps(changed))
        code, out, err = run(capsys, *common, "--config", tmp_path / "bad.json")
        assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), (message, err)
        assert out == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["export", "--study-name", "nope"], "no study database"),
        (["optimize", "--head-rows", "0,5"], "distinct sizes >= 1"),
        (["optimize", "--head-rows", "8,8"], "distinct sizes >= 1"),
        (["plot", "--study-name", "nope"], "no study database"),
        (["export", "--study-name", "../x"], "study names are"),
        (["optimize", "--sampler", "bayes"], "invalid choice"),
        (["optimize", "--skip-prior", "2"], r"number in \(0, 1\)"),
        (["optimize", "--skip-prior", "0"], r"number in \(0, 1\)"),
        (["optimize", "--n-trials", "-3"], "integer >= 1"),
        (["optimize", "--num-prompts", "1", "--confirm-repeats", "1"], "gives the confirmation one paired run"),
        (["optimize", "--objective", "modeled", "--num-prompts", "1"], "gives the confirmation one prediction"),
        (["optimize", "--dataset", "/nonexistent/prompts.jsonl"], "does not exist"),
    ],
)
def test_search_commands_bad_input(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main([*argv, "--studies-dir", str(tmp_path)]))
    _, err = capsys.readouterr()
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_every_command_has_help(capsys):
    for command in ["generate", "optimize", "export", "plot", "bench", "profile"]:
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert "--" in capsys.readouterr().out


def test_bench_measures_a_config_on_prompts_its_study_did_not_see(capsys, tmp_path, tiny_model_dir):
    """By default bench drew the prompts optimize had calibrated on (the same dataset, seed and draw): an in-sample
    figure. The config names its study's prompts by digest, and bench leaves them out unless asked to keep them."""
    from skipsearch.io.data import load_rows, prompt_digest

    code, _, _ = run(capsys, *optimize_args(tiny_model_dir, tmp_path, "--no-plots", n_trials=2))
    config = json.loads((tmp_path / "cli" / "best.json").read_text())
    # Its 2 calibration prompts, and the 16 its heads were ranked on: the next ones of the seeded order.
    calibration = load_rows(num_prompts=2, seed=0)
    ranked_on = [row for row in load_rows(num_prompts=None, seed=0) if row not in calibration][:16]
    assert code == 0 and config["search"]["seen_prompts"] == sorted(
        prompt_digest(row.turns) for row in calibration + ranked_on)
    bench = ["bench", "--model", tiny_model_dir, "--config", tmp_path / "cli" / "best.json", "--num-prompts", 2,
             "--max-new-tokens", 3, "--repeats", 1, "--prompt-lookup-tokens", 0, "--no-progress", "--output-dir",
             tmp_path / "bench"]
    settings = lambda: json.loads((tmp_path / "bench" / "bench.json").read_text())["settings"]  # noqa: E731
    code, _, err = run(capsys, *bench)
    assert code == 0 and "note: 18 prompts of dataset 'builtin' left out" in err and settings()["study_prompts"] == \
        "left out"
    code, _, err = run(capsys, *bench, "--include-study-prompts")
    assert code == 0 and "left out" not in err and settings()["study_prompts"] == "kept (--include-study-prompts)"
    # A study an older release made names no prompts in its label; resumed, it names the same prompts, and so does its
    # export.
    import optuna

    from skipsearch.search.records import STUDY_ATTR

    study = optuna.load_study(study_name="cli", storage=f"sqlite:///{tmp_path}/cli.db")
    study.set_user_attr(STUDY_ATTR, {k: v for k, v in study.user_attrs[STUDY_ATTR].items() if k != "seen_prompts"})
    code, _, _ = run(capsys, *optimize_args(tiny_model_dir, tmp_path, "--no-plots", n_trials=3))
    resumed = json.loads((tmp_path / "cli" / "best.json").read_text())["search"]["seen_prompts"]
    assert code == 0 and resumed == config["search"]["seen_prompts"]
    # A config exported before configs named their prompts: nothing to leave out, and bench says so.
    del config["search"]["seen_prompts"]
    (tmp_path / "old.json").write_text(json.dumps(config))
    bench[bench.index(tmp_path / "cli" / "best.json")] = tmp_path / "old.json"
    code, _, err = run(capsys, *bench)
    assert code == 0 and "does not name its study's prompts" in err and settings()["study_prompts"].startswith(
        "unknown")


def test_profile_then_bench_with_a_config(capsys, tmp_path, tiny_model_dir, virtual_profiles):
    from transformers import AutoModelForCausalLM

    from skipsearch.decode.config import ModelInfo, SkipConfig, save_skip_config
    from skipsearch.decode.skipset import SkipSet

    code, out, _ = run(capsys, "profile", "--model", tiny_model_dir, "--output", tmp_path / "p.json", "--repeats", 2,
                       "--contexts", "8,16", "--no-progress")
    assert code == 0 and (tmp_path / "p.json").is_file() and "per drafted token" in out
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_skip_config(SkipConfig(model=ModelInfo.of(model, "tiny"), skip=SkipSet.of([1], [2], 4)), tmp_path / "c.json")
    code, out, _ = run(capsys, "bench", "--model", tiny_model_dir, "--dtype", "float64", "--config", tmp_path / "c.json",
                       "--cost-profile", tmp_path / "p.json", "--num-prompts", 2, "--max-new-tokens", 6, "--repeats", 1,
                       "--output-dir", tmp_path / "bench", "--no-progress")
    assert code == 0 and out.splitlines()[0].startswith(f"the predicted speedup is priced by {tmp_path / 'p.json'} [cpu")
    assert out.splitlines()[1].startswith("method")
    assert "skipsearch attn=[1] mlp=[2]" in out and "NO" not in out
    rows = json.loads((tmp_path / "bench" / "bench.json").read_text())["rows"]
    assert rows[-1]["predicted_speedup"] > 0 and (tmp_path / "bench" / "bench.png").is_file()

    code, out, _ = run(capsys, *optimize_args(tiny_model_dir, tmp_path, "--objective", "modeled", "--cost-profile",
                                              tmp_path / "p.json", "--no-plots"))
    assert code == 0 and "predicted" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--early-exit-layer", "9"], r"must be in 1\.\.3"),
        (["bench", "--include-study-prompts"], "--include-study-prompts keeps a --config's study prompts"),
        (["bench", "--cost-profile", "/nonexistent.json", "--config", "/nonexistent/c.json"], "does not exist"),
        (["optimize", "--cost-profile", "/nonexistent.json"], "for --objective modeled"),
    ],
)
def test_bench_and_profile_bad_input(capsys, tmp_path, tiny_model_dir, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main([*argv, "--model", str(tiny_model_dir), *(
            ["--studies-dir", str(tmp_path)] if argv[0] == "optimize" else ["--output-dir", str(tmp_path / "b")])]))
    _, err = capsys.readouterr()
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err)
    assert list(tmp_path.iterdir()) == []


def test_bench_and_profile_write_under_the_studies_dir_unless_told_otherwise(capsys, tmp_path, tiny_model_dir,
                                                                             monkeypatch, virtual_profiles):
    monkeypatch.chdir(tmp_path)  # the old fixed defaults (studies/...) would land here
    studies = tmp_path / "elsewhere"
    code, out, _ = run(capsys, "profile", "--model", tiny_model_dir, "--studies-dir", studies, "--repeats", 1,
                       "--contexts", "8", "--no-progress")
    assert code == 0 and (studies / "cost-profile.json").is_file() and f"wrote {studies / 'cost-profile.json'}" in out
    bench = ["bench", "--model", tiny_model_dir, "--studies-dir", studies, "--num-prompts", 1, "--max-new-tokens", 2,
             "--repeats", 1, "--prompt-lookup-tokens", 0, "--no-progress"]
    code, out, _ = run(capsys, *bench)
    assert code == 0 and {p.name for p in (studies / "bench").iterdir()} == {"bench.json", "bench.png"}
    assert not (tmp_path / "studies").exists()
    # --output-dir / --output still win over the studies dir.
    code, _, _ = run(capsys, *bench, "--output-dir", tmp_path / "mine")
    assert code == 0 and (tmp_path / "mine" / "bench.json").is_file()
    code, _, _ = run(capsys, "profile", "--model", tiny_model_dir, "--studies-dir", studies, "--output",
                     tmp_path / "p.json", "--repeats", 1, "--contexts", "8", "--no-progress")
    assert code == 0 and (tmp_path / "p.json").is_file()
    assert not (tmp_path / "studies").exists()


def test_bench_without_categories_removes_an_earlier_runs_category_figure(capsys, tmp_path, tiny_model_dir):
    """An earlier run's bench_categories.png beside a bench.json without categories would pass for this run's."""
    stale = tmp_path / "bench" / "bench_categories.png"
    stale.parent.mkdir()
    stale.write_bytes(b"\x89PNG an earlier run's")
    code, _, _ = run(capsys, "bench", "--model", tiny_model_dir, "--output-dir", tmp_path / "bench", "--num-prompts",
                     1, "--max-new-tokens", 2, "--repeats", 1, "--prompt-lookup-tokens", 0, "--no-progress")
    assert code == 0 and "categories" not in json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert {p.name for p in (tmp_path / "bench").iterdir()} == {"bench.json", "bench.png"}


def test_optimize_takes_over_an_empty_unlabelled_study(capsys, tmp_path, tiny_model_dir):
    """A worker started beside another can find the study created but not yet labelled; it must not refuse it."""
    import optuna

    from skipsearch.search.records import STUDY_ATTR

    optuna.create_study(study_name="cli", storage=f"sqlite:///{tmp_path}/cli.db", direction="maximize")
    code, out, err = run(capsys, *optimize_args(tiny_model_dir, tmp_path, "--no-plots", n_trials=2))
    assert code == 0, err
    study = optuna.load_study(study_name="cli", storage=f"sqlite:///{tmp_path}/cli.db")
    assert STUDY_ATTR in study.user_attrs and "exported" in out


def test_generate_takes_the_guard_switch_and_warns_of_the_old_rules_flags(capsys, tiny_model_dir, monkeypatch):
    from skipsearch.api import generate as command

    seen = []
    real = command.generate

    def spy(*args, **kwargs):
        seen.append(kwargs["policy"])
        return real(*args, **kwargs)

    monkeypatch.setattr(command, "generate", spy)
    common = ["generate", "--model", tiny_model_dir, "--prompt", "hello there", "--max-new-tokens", 8, "--json",
              "--dtype", "float64", "--skip-attn", "1"]
    code, out, err = run(capsys, *common, "--stop-rule", "cost", "--confidence-threshold", "0.5", "--no-guard")
    assert code == 0 and seen[-1] == DraftPolicy(guard=False)
    assert json.loads(out)["stats"]["guard_plain_tokens"] == 0
    assert "warning: the flags --confidence-threshold, --stop-rule: no longer used" in err
    code, _, err = run(capsys, *common)
    assert code == 0 and seen[-1] == DraftPolicy() and "warning" not in err


@pytest.mark.guarded  # the guard on: what it learns is what the file keeps
def test_generate_keeps_what_the_guard_learned_in_a_memory_file(capsys, tmp_path, tiny_model_dir, monkeypatch):
    from skipsearch.api import generate as command
    from skipsearch.decode.controller import DraftMemory

    passed = []
    real = command.generate

    def spy(*args, **kwargs):
        passed.append(kwargs["memory"].as_dict())  # as handed to the call, before it learns
        return real(*args, **kwargs)

    monkeypatch.setattr(command, "generate", spy)
    memory = tmp_path / "memory.json"
    common = ["generate", "--model", tiny_model_dir, "--prompt", "hello there", "--max-new-tokens", 24, "--json",
              "--skip-attn", "1,2", "--memory", memory]
    code, _, _ = run(capsys, *common)
    assert code == 0 and passed[0] == DraftMemory().as_dict()  # no file yet: an empty memory
    stored = json.loads(memory.read_text())
    assert stored["format"] == "skipsearch-draft-memory" and stored["learned_by"].endswith("on cpu (torch.float32)")
    assert list(stored["backoffs"]) == ["eager attn=[1, 2] mlp=[]"]  # the guard keeps the set's back-off
    code, _, _ = run(capsys, *common)
    assert code == 0 and passed[1] == DraftMemory.from_dict(stored).as_dict()  # the second run starts from the first's

    learned = memory.read_text()
    code, out, err = run(capsys, *common, "--dtype", "float64")  # another model's speeds would misjudge its rounds
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and "was learned by" in err
    assert memory.read_text() == learned and len(passed) == 2  # refused before decoding, the file untouched
    altered = json.dumps({**stored, "plain_s": {"eager": -1.0}})
    memory.write_text(altered)
    code, _, err = run(capsys, *common)
    assert code == 2 and "positive and finite" in err and len(passed) == 2 and memory.read_text() == altered
    code, _, err = run(capsys, *common[:-1], tmp_path)  # a folder
    assert code == 2 and "is a folder" in err
    code, _, err = run(capsys, *common[:-1], "/dev/null")  # a stream: it could be written, not read back
    assert code == 2 and "not a regular file" in err and len(passed) == 2
    memory.write_text(learned)
    monkeypatch.chdir(tiny_model_dir.parent)  # the same model by a relative path is the same model
    code, _, _ = run(capsys, *common[:2], tiny_model_dir.name, *common[3:])
    assert code == 0 and len(passed) == 3
