"""A study of several datasets: each trial decodes the prompts of all, keeps each dataset's figures, and the export
carries the best set per dataset, among which decoding then chooses per prompt."""

import json

import optuna
import pytest

from test_choice import CHAT, CODE, FITS_CHAT, FITS_CODE, MODEL, prompt_of
from test_export import candidate
from skipsearch.decode.config import ModelInfo, load_skip_config
from skipsearch.decode.cost_profile import ContextCosts, CostProfile
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet
from skipsearch.report.export import dataset_verdicts, decide, decided_config, export_trial, write_dv
from skipsearch.search.evaluation import Evaluator
from skipsearch.search.ranking import best_candidates, ranked
from skipsearch.search.records import CONFIRM_ATTR, ConfirmedCandidate, Figures, Ratio, TrialRecord, read_trials
from skipsearch.search.study import SearchSpace, StudySettings, run_study

DATASETS = ["code.jsonl", "chat.jsonl"]


def flat(speedup, low=None, acceptance=0.8):
    return {"speedup": speedup, "speedup_low": low, "speedup_high": None, "acceptance_rate": acceptance,
            "paired_runs": 8, "prompts": 2}


def fake_study(tmp_path, trials, confirmed=None):
    """A speedup study of two datasets; `trials`: (attn, overall speedup, {dataset: speedup}) each."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/fake.db", study_name="fake", direction="maximize")
    study.set_user_attr("skipsearch", {
        "model": {"name_or_path": "tiny", "architecture": "LlamaForCausalLM", "num_hidden_layers": 4,
                  "hidden_size": 32},
        "objective": "speedup", "dataset": DATASETS, "num_prompts": 4, "draft": vars(DraftPolicy())})
    for attn, speedup, per_dataset in trials:
        attrs = TrialRecord(skip=SkipSet.of(attn), skipped=len(attn), figures=Figures.from_dict(flat(speedup)),
                            datasets={d: Figures.from_dict(flat(s)) for d, s in per_dataset.items()}).attrs()
        study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=speedup, user_attrs=attrs))
    if confirmed is not None:
        study.set_user_attr(CONFIRM_ATTR, {"candidates": confirmed, "top": 1, "repeats": 2, "prompts": 4})
    return study


def confirmed(trial, attn, overall, per_dataset):
    """A confirmation record: (speedup, low) overall and per dataset."""
    record = candidate(trial, overall[0], overall[1], None, attn)
    record["dataset_figures"] = {d: flat(s, low) for d, (s, low) in per_dataset.items()}
    return record


def test_records_keep_each_datasets_figures():
    figures = {"code.jsonl": Figures(speedup=Ratio(1.3, 1.1, 1.5), prompts=2), "chat.jsonl": Figures(prompts=1)}
    record = TrialRecord(skip=SkipSet.of([1]), figures=Figures(prompts=3), datasets=figures)
    trial = optuna.trial.create_trial(params={}, distributions={}, value=1.0, user_attrs=record.attrs())
    assert TrialRecord.of(trial).datasets == figures and TrialRecord.of(trial).measurement().datasets == figures
    assert "dataset_figures" not in TrialRecord(skip=SkipSet.of([1])).attrs()  # a study of one dataset: as before
    confirmed_set = ConfirmedCandidate(1, SkipSet.of([1]), 1.2, 1, 0.125, Figures(prompts=3), figures)
    assert ConfirmedCandidate.from_attrs(confirmed_set.attrs()) == confirmed_set


def test_sets_are_ranked_per_dataset_and_each_datasets_best_is_confirmed(tmp_path):
    study = fake_study(tmp_path, [([1], 1.2, {"code.jsonl": 1.5, "chat.jsonl": 0.9}),
                                  ([2], 1.1, {"code.jsonl": 0.8, "chat.jsonl": 1.4}),
                                  ([3], 1.15, {"code.jsonl": 1.3, "chat.jsonl": 1.0}),
                                  ([0], 0.9, {"code.jsonl": 0.9})])  # stopped before any chat prompt
    assert [t.skip.attn for t in ranked(study)] == [(1,), (3,), (2,), (0,)]
    assert [t.skip.attn for t in ranked(study, "chat.jsonl")] == [(2,), (3,), (1,)]
    assert [t.skip.attn for t in best_candidates(study, 1)] == [(1,), (2,)]  # the overall best is code's
    assert [t.skip.attn for t in best_candidates(study, 2)] == [(1,), (3,), (2,)]


def test_the_export_carries_each_datasets_confirmed_set(tmp_path):
    study = fake_study(tmp_path, [([1], 1.2, {}), ([2], 1.1, {})], confirmed=[
        confirmed(1, [1], (1.2, 1.05), {"code.jsonl": (1.5, 1.3), "chat.jsonl": (0.9, 0.8)}),
        confirmed(2, [2], (1.1, 0.95), {"code.jsonl": (0.8, 0.7), "chat.jsonl": (1.4, 1.2)})])
    assert decide(study, "chat.jsonl").chosen.trial == 2 and decide(study).chosen.trial == 1
    verdicts = dataset_verdicts(study)
    assert verdicts[0].startswith("code.jsonl: skip set of trial 1") and "1.50x" in verdicts[0]
    assert verdicts[1].startswith("chat.jsonl: skip set of trial 2") and "1.40x" in verdicts[1]
    config = export_trial(study, tmp_path / "best.json")
    assert json.loads((tmp_path / "best.json").read_text())["version"] == 2
    assert load_skip_config(tmp_path / "best.json") == config
    assert [(e.skip, e.label) for e in config.entries] == [(SkipSet.of([1]), "code.jsonl"),
                                                           (SkipSet.of([2]), "chat.jsonl")]
    assert config.entries[1].metrics.speedup == 1.4 and config.entries[1].metrics.trial == 2
    assert config.entries[1].metrics.verdict == verdicts[1]
    with pytest.raises(ValueError, match="the Draft & Verify format holds one"):
        write_dv(config, tmp_path / "dv.json")


def test_verdict_and_plots_say_what_best_json_holds_where_each_dataset_pays_and_all_prompts_do_not(tmp_path):
    """No set pays over all prompts, each dataset's own does: best.json holds both, and the verdict line and the
    plots' highlight say so instead of "plain decoding is exported"."""
    from skipsearch.report.export import verdict
    from skipsearch.report.plots import _highlight

    study = fake_study(tmp_path, [([1], 1.05, {}), ([2], 1.0, {})], confirmed=[
        confirmed(1, [1], (1.05, 0.95), {"code.jsonl": (1.5, 1.3), "chat.jsonl": (0.7, 0.6)}),
        confirmed(2, [2], (1.0, 0.9), {"code.jsonl": (0.8, 0.7), "chat.jsonl": (1.4, 1.2)})])
    assert not decide(study).pays and len(decided_config(study).entries) == 2
    pays, text = verdict(study)
    assert pays and "plain decoding is exported" not in text
    assert "trial 1 (attn=[1] mlp=[]) for code.jsonl; trial 2 (attn=[2] mlp=[]) for chat.jsonl" in text, text
    shown, label = _highlight(study)
    assert shown.trial == 1 and "exported skip set for code.jsonl (1 of 2, one per dataset)" in label, label
    assert "trial 1: 1.50x" in label and "not exported" not in label  # its figure on code.jsonl's prompts


@pytest.mark.parametrize("chat, expected", [((1.2, 1.1), ([1], None)), ((0.9, 0.8), ([1], None))],
                         ids=["one set best on both", "nothing pays on chat"])
def test_one_confirmed_set_is_exported_as_a_study_of_one_dataset_would(tmp_path, chat, expected):
    study = fake_study(tmp_path, [([1], 1.2, {})], confirmed=[
        confirmed(1, [1], (1.2, 1.05), {"code.jsonl": (1.5, 1.3), "chat.jsonl": chat})])
    config = decided_config(study)
    assert (list(config.skip.attn), config.label) == expected and config.others == ()
    assert config.to_json()["version"] == 1


def cheap_mlp_profile():
    """A device on which the MLPs are nearly all a forward costs: a draft skipping one of four costs 3/4."""
    return CostProfile(device="cpu", dtype="float64", architecture="LlamaForCausalLM", num_hidden_layers=4,
                       contexts=(ContextCosts(context_tokens=16, attn_s=0.001, mlp_s=1.0, rest_s=0.01,
                                              verify_s=[4.0, 4.0, 4.0, 4.0, 4.0]),))


def test_evaluations_have_figures_per_dataset():
    prompts = [prompt_of((CODE,), 8, seed=1), prompt_of((CHAT,), 8, seed=1), prompt_of((CODE,), 8, seed=2)]
    evaluator = Evaluator(MODEL, prompts, 8, DraftPolicy(max_draft_tokens=3), None, timed=False,
                          datasets=["code.jsonl", "chat.jsonl", "code.jsonl"], profile=cheap_mlp_profile())
    evaluation = evaluator.evaluate(FITS_CODE)
    code, chat = evaluation.by_dataset["code.jsonl"], evaluation.by_dataset["chat.jsonl"]
    assert (code.prompts, chat.prompts, evaluation.prompts) == (2, 1, 3)
    assert code.acceptance_rate == 1.0 > evaluation.acceptance_rate > chat.acceptance_rate
    assert code.predicted_speedup.estimate > 1.0 > chat.predicted_speedup.estimate
    assert evaluation.dataset_figures()["chat.jsonl"] == chat.figures()
    assert Evaluator(MODEL, prompts, 8, DraftPolicy(), None, timed=False).evaluate(FITS_CODE).dataset_figures() is None


def test_a_study_of_two_datasets_exports_a_set_for_each_which_decoding_then_picks(tmp_path):
    """The whole path on the tiny model of two kinds of token: one study over code and chat prompts (the modeled
    objective, so that nothing depends on this machine's timing), a best.json of two sets, and each prompt
    decoded with the set of its kind."""
    prompts, datasets = [], []
    for seed in range(4):
        prompts += [prompt_of((CODE,), 10, seed), prompt_of((CHAT,), 10, seed)]
        datasets += DATASETS
    settings = StudySettings(study_name="two", storage=f"sqlite:///{tmp_path}/two.db", objective="modeled",
                             n_trials=3, min_match=0, dataset=DATASETS, num_prompts=len(prompts),
                             max_new_tokens=10, show_progress_bar=False, warm_starts=False, confirm_top=1,
                             first_trials=(("code", FITS_CODE), ("chat", FITS_CHAT)))
    study = run_study(MODEL, ModelInfo.of(MODEL, "two-kinds"), "float64", prompts, settings,
                      SearchSpace(num_layers=4, keep_first_last=False, skip_prior=0.3),
                      DraftPolicy(max_draft_tokens=3), None, profile=cheap_mlp_profile(), prompt_datasets=datasets)
    config = export_trial(study, tmp_path / "best.json")
    assert [(e.skip, e.label) for e in config.entries] == [(FITS_CODE, "code.jsonl"), (FITS_CHAT, "chat.jsonl")]
    loaded = load_skip_config(tmp_path / "best.json", MODEL)
    for kinds, chosen in (((CODE,), FITS_CODE), ((CHAT,), FITS_CHAT)):
        out = generate(MODEL, prompt_of(kinds, seed=9), skip=loaded.skip_sets, policy=loaded.draft, max_new_tokens=6)
        assert out.stats.choices[0].skip == chosen


def test_optimize_takes_several_datasets(capsys, tmp_path, tiny_model_dir):
    from skipsearch.cli import main

    for name, texts in (("code.jsonl", ["Write a loop in C.", "Sort a list in Python."]),
                        ("chat.jsonl", ["How are you today?", "Tell me about cats."])):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
    argv = ["optimize", "--model", str(tiny_model_dir), "--studies-dir", str(tmp_path / "studies"), "--study-name",
            "two", "--n-trials", "2", "--num-prompts", "1", "--max-new-tokens", "4", "--no-progress", "--no-plots",
            "--min-match", "0", "--confirm-top", "1", "--no-warm-starts",
            "--confirm-repeats", "1",  # a prompt of each dataset: 2 paired runs, which confirm
            "--dataset", str(tmp_path / "code.jsonl"), "--dataset", str(tmp_path / "chat.jsonl")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"\n{tmp_path / 'code.jsonl'}: " in out and f"\n{tmp_path / 'chat.jsonl'}: " in out
    study = optuna.load_study(study_name="two", storage=f"sqlite:///{tmp_path}/studies/two.db")
    assert study.user_attrs["skipsearch"]["dataset"] == [str(tmp_path / "code.jsonl"), str(tmp_path / "chat.jsonl")]
    assert study.user_attrs["skipsearch"]["num_prompts"] == 2
    decoded = [record for record in read_trials(study) if record.skip.drafts and record.figures]
    assert decoded and all(set(t.datasets) == {str(tmp_path / "code.jsonl"), str(tmp_path / "chat.jsonl")} for t in decoded)
    assert load_skip_config(tmp_path / "studies" / "two" / "best.json").search.dataset == \
        study.user_attrs["skipsearch"]["dataset"]
    assert main([*argv[:-2], "--dataset", str(tmp_path / "code.jsonl")]) == 2
    assert "is given twice" in capsys.readouterr().err
