import json
from types import SimpleNamespace

import optuna
import pytest
import torch
from optuna.trial import FixedTrial, TrialState

from conftest import tiny_model
from skipsearch.decode.config import ModelInfo, load_skip_config
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import DraftHead, SkipSet
from skipsearch.search.vocabulary import VocabularyRanking
from skipsearch.report.export import decide, export_trial
from skipsearch.report.plots import write_plots
from skipsearch.search.records import study_summary
from skipsearch.search.study import Evaluator, SearchSpace, StudySettings, distinct_trials, make_sampler, run_study

PROMPTS = [[5, 9, 14, 3], [7, 2, 30, 31, 8]]


def test_space_skips_draws_below_the_prior_within_the_cap():
    space = SearchSpace(num_layers=6, keep_first_last=True, max_skip_fraction=0.35, skip_prior=0.2)  # cap: 4
    assert [name for name in (space.param_name(k, i) for k, i in space.sublayers())][:2] == ["attn_001", "mlp_001"]
    params = {space.param_name(k, i): 0.9 for k, i in space.sublayers()}
    params.update(attn_002=0.05, mlp_003=0.1, attn_004=0.01, mlp_001=0.19)
    assert space.suggest(FixedTrial(params)) == SkipSet.of([2, 4], [1, 3], 6)
    params.update(attn_003=0.0)  # 5 below the prior, cap is 4: the lowest draws win
    assert space.suggest(FixedTrial(params)) == SkipSet.of([2, 3, 4], [3], 6)


def test_space_round_trips_warm_starts():
    space = SearchSpace(num_layers=8)
    starts = space.warm_starts()
    assert starts[0] == SkipSet() and len(set(starts)) == len(starts)
    for skip in starts:
        assert 0 not in skip.attn + skip.mlp and 7 not in skip.attn + skip.mlp
        assert space.from_params(space.params_for(skip)) == skip


def test_space_validates_settings():
    with pytest.raises(ValueError, match="max_skip_fraction"):
        SearchSpace(num_layers=4, max_skip_fraction=1.5)
    with pytest.raises(ValueError, match="skip_prior"):
        SearchSpace(num_layers=4, skip_prior=0.0)


def make_evaluator(model=None):
    return Evaluator(model=model or tiny_model(), prompts=PROMPTS, max_new_tokens=8,
                     policy=DraftPolicy(max_draft_tokens=3), eos_token_id=None)


def test_evaluator_pairs_every_skip_run_with_plain_decoding_and_reports_each_prompt():
    evaluator = make_evaluator()
    assert [len(t) for t in evaluator.reference_tokens()] == [8, 8]
    steps = []
    result = evaluator.evaluate(SkipSet.of([1], [2], 4), report=lambda step, value: steps.append((step, value)) or False,
                                repeats=2)
    assert [step for step, _ in steps] == [0, 1] and all(value > 0 for _, value in steps)
    assert result.identical and result.prompts == 2 and 0 <= result.acceptance_rate <= 1
    assert result.speedup.pairs == 4 and result.speedup.low <= result.speedup.estimate <= result.speedup.high
    assert result.tokens_per_second > 0 and result.baseline_tokens_per_second > 0
    assert result.score("speed_x_acceptance") == pytest.approx(result.speedup.estimate * result.acceptance_rate)
    assert result.score("pareto") == (result.speedup.estimate, result.acceptance_rate)


def test_each_prompts_report_is_that_prompts_share_of_the_objective():
    evaluator = make_evaluator()
    evaluator.prompts = PROMPTS[:1]  # one prompt, one pair: the prompt's ratio is the trial's speedup
    skip = SkipSet.of([1], [2], 4)
    for objective in ("speedup", "speed_x_acceptance"):
        steps = []
        result = evaluator.evaluate(skip, report=lambda step, value: steps.append(value) or False, objective=objective)
        assert result.acceptance_rate < 1.0  # else the two objectives could not be told apart
        assert steps == [pytest.approx(result.score(objective))]


def test_evaluation_stops_when_the_pruner_says_so():
    evaluator = make_evaluator()
    result = evaluator.evaluate(SkipSet.of([1], [], 4), report=lambda step, value: True)
    assert result.prompts == 1 and result.speedup.pairs == 1


def test_modeled_evaluation_times_nothing():
    from skipsearch.decode.cost_profile import CostProfile

    profile = CostProfile.from_dict(dict(device="cpu", dtype="float32", architecture="LlamaForCausalLM",
                                         num_hidden_layers=4, context_tokens=8, attn_s=1.0, mlp_s=1.0, rest_s=1.0,
                                         verify_s=[9.0, 9.2, 9.4, 9.6]))
    evaluator = make_evaluator()
    evaluator.profile, evaluator.timed = profile, False
    result = evaluator.evaluate(SkipSet.of([1], [2], 4), objective="modeled")
    assert result.speedup is None and result.predicted_speedup.pairs == 2
    assert result.score("modeled") == result.predicted_speedup.estimate


def test_a_modeled_prediction_over_one_prompt_bounds_nothing_and_prices_no_cut(monkeypatch):
    """One prompt's prediction says nothing of other prompts' (as one paired run's ratio); untimed rounds are never
    cut, so none pays the confidence read, while a timed CPU run's adaptive rounds do (a CUDA run's do not)."""
    from skipsearch.decode import loop as decoding
    from skipsearch.decode.cost_profile import CostProfile

    profile = CostProfile.from_dict(dict(device="cpu", dtype="float32", architecture="LlamaForCausalLM",
                                         num_hidden_layers=4, context_tokens=8, attn_s=1.0, mlp_s=1.0, rest_s=1.0,
                                         verify_s=[9.0, 9.2, 9.4, 9.6]))
    charged = []
    real = CostProfile.predict_speedup
    monkeypatch.setattr(CostProfile, "predict_speedup", lambda self, skip, stats, adaptive=False, **kw:
                        charged.append(adaptive) or real(self, skip, stats, **kw))
    evaluator = make_evaluator()
    evaluator.profile, evaluator.timed, evaluator.prompts = profile, False, PROMPTS[:1]
    evaluator.policy = DraftPolicy(max_draft_tokens=3, adaptive=True)
    result = evaluator.evaluate(SkipSet.of([1], [2], 4), objective="modeled")
    assert result.predicted_speedup.low == 0.0 and result.predicted_speedup.high == float("inf")
    evaluator.timed = True
    evaluator.evaluate(SkipSet.of([1], [2], 4))
    monkeypatch.setattr(decoding, "host_reads_stall", lambda device: True)  # as on CUDA
    evaluator.evaluate(SkipSet.of([1], [2], 4))
    assert charged == [False, True, False]


def test_cuts_rounds_where_reads_are_free_and_rounds_adapt():
    from skipsearch.decode.loop import cuts_rounds

    assert cuts_rounds(True, "cpu") and cuts_rounds(True, torch.device("cpu"))
    assert not cuts_rounds(True, "cuda:0") and not cuts_rounds(False, "cpu")


def test_match_rate_is_one_without_skipping_and_lower_with_it():
    evaluator = make_evaluator()
    assert evaluator.match_rate(SkipSet()) == 1.0
    assert evaluator.match_rate(SkipSet.of(range(4), range(4), 4)) < 1.0


def settings(tmp_path, **kw):
    base = dict(study_name="s", storage=f"sqlite:///{tmp_path}/s.db", n_trials=6, num_prompts=2, max_new_tokens=8,
                min_match=0.0, show_progress_bar=False)
    base.update(kw)
    return StudySettings(**base)


def run(model, tmp_path, **kw):
    return run_study(model, ModelInfo.of(model, "tiny"), "float32", PROMPTS, settings(tmp_path, **kw),
                     SearchSpace(num_layers=4, skip_prior=0.4), DraftPolicy(max_draft_tokens=3), None)


def test_study_runs_resumes_exports_and_plots(tmp_path):
    model = tiny_model()
    study = run(model, tmp_path, n_trials=6)
    first = [(t.number, t.params) for t in study.trials]
    assert len(distinct_trials(study)) == 6 and study.trials[0].user_attrs.get("warm_start")
    resumed = run(model, tmp_path, n_trials=9)
    assert [(t.number, t.params) for t in resumed.trials][: len(first)] == first
    assert len(distinct_trials(resumed)) == 9
    for trial in resumed.get_trials(states=(TrialState.COMPLETE,)):
        assert {"speedup", "speedup_low", "speedup_high", "acceptance_rate", "tokens_per_second",
                "mean_accepted_tokens", "skipped"} <= set(trial.user_attrs)
    assert "skipsearch_confirmation" in resumed.user_attrs
    config = export_trial(resumed, tmp_path / "best.json")
    assert load_skip_config(tmp_path / "best.json", model) == config
    assert config.metrics.verdict
    written = write_plots(resumed, tmp_path / "plots")
    assert {p.name for p in written} == {"history.png", "importances.png", "skip_map.png", "speedup_vs_skipped.png"}
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_resuming_with_another_model_or_other_measurement_settings_is_refused(tmp_path):
    model = tiny_model()
    run(model, tmp_path, n_trials=1)
    with pytest.raises(ValueError, match="another model"):
        run(tiny_model(num_layers=6), tmp_path, n_trials=2)
    with pytest.raises(ValueError, match="another --max-new-tokens"):
        run(model, tmp_path, n_trials=2, max_new_tokens=6)
    with pytest.raises(ValueError, match="another --num-prompts"):
        run(model, tmp_path, n_trials=2, num_prompts=3)


def test_a_failing_trial_is_recorded_and_the_study_goes_on(tmp_path, monkeypatch):
    calls = {"n": 0}
    original = Evaluator.evaluate

    def sometimes_fails(self, skip, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated failure of one skip set")  # not a resource: those end the study (hostile)
        return original(self, skip, **kwargs)

    monkeypatch.setattr(Evaluator, "evaluate", sometimes_fails)
    study = run(tiny_model(), tmp_path, n_trials=4)
    failed = study.get_trials(states=(TrialState.FAIL,))
    assert len(failed) == 1 and "simulated failure" in failed[0].user_attrs["fail_reason"]
    assert len(distinct_trials(study)) == 4


def test_an_error_after_the_decoding_is_recorded_as_the_trials_reason_too(tmp_path, monkeypatch):
    """A trial fails wherever its error comes: in the release of memory after the decoding (where a second Ctrl-C once
    came, CI of 2026-11-28) its reason is kept as well as in the decoding."""
    from skipsearch.search import study as study_module

    calls = {"n": 0}
    original = study_module._free_memory

    def fails_once(model):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated failure after the decoding")
        original(model)

    monkeypatch.setattr(study_module, "_free_memory", fails_once)
    study = run(tiny_model(), tmp_path, n_trials=4)
    failed = study.get_trials(states=(TrialState.FAIL,))
    assert len(failed) == 1 and failed[0].user_attrs["fail_reason"] == (
        "RuntimeError: simulated failure after the decoding")


def test_pareto_study_optimizes_two_objectives_exports_and_plots_the_front(tmp_path):
    """A Pareto study end to end; which set it exports is test_export's (the best speedup x acceptance of those
    confirmed faster)."""
    study = run(tiny_model(), tmp_path, n_trials=5, objective="pareto", sampler="nsga2")
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(study.directions) == 2 and complete and all(len(t.values) == 2 for t in complete)
    config = export_trial(study, tmp_path / "best.json")
    assert json.loads((tmp_path / "best.json").read_text())["skip"]["attn"] == list(config.skip.attn)
    assert "pareto.png" in {p.name for p in write_plots(study, tmp_path / "plots")}


@pytest.mark.parametrize("sampler", ["tpe", "gp", "cmaes", "random", "nsga2"])
def test_every_sampler_is_available(sampler):
    assert isinstance(make_sampler(sampler, 0, multi_objective=False), optuna.samplers.BaseSampler)


def test_bad_sampler_choices_are_clear_errors():
    with pytest.raises(ValueError, match="unknown sampler"):
        make_sampler("bayes", 0, False)
    with pytest.raises(ValueError, match="one objective"):
        make_sampler("cmaes", 0, True)


def test_modeled_objective_scores_by_the_cost_profile_and_keeps_it(tmp_path):
    from skipsearch.decode.cost_profile import CostProfile

    model = tiny_model()
    profile = CostProfile.from_dict(dict(device="cpu", dtype="float32", architecture="LlamaForCausalLM",
                                         num_hidden_layers=4, context_tokens=8, attn_s=1.0, mlp_s=1.0, rest_s=1.0,
                                         verify_s=[9.0, 9.2, 9.4, 9.6]))
    study = run_study(model, ModelInfo.of(model, "tiny"), "float32", PROMPTS, settings(tmp_path, objective="modeled"),
                      SearchSpace(num_layers=4, skip_prior=0.4), DraftPolicy(max_draft_tokens=3), None,
                      profile=profile)
    assert CostProfile.from_dict(study.user_attrs["skipsearch"]["cost_profile"]) == profile
    for trial in study.get_trials(states=(TrialState.COMPLETE,)):
        assert trial.values[0] == trial.user_attrs["predicted_speedup"]
    # Deterministic: the same skip set gets the same score in a second study.
    again = run_study(model, ModelInfo.of(model, "tiny"), "float32", PROMPTS,
                      settings(tmp_path, objective="modeled", study_name="again"),
                      SearchSpace(num_layers=4, skip_prior=0.4), DraftPolicy(max_draft_tokens=3), None,
                      profile=profile)
    first = {t.params.__repr__(): t.values for t in study.get_trials(states=(TrialState.COMPLETE,))}
    second = {t.params.__repr__(): t.values for t in again.get_trials(states=(TrialState.COMPLETE,))}
    shared = set(first) & set(second)
    assert shared and all(first[k] == second[k] for k in shared)


def test_random_unevaluated_draws_a_set_not_yet_evaluated_or_none():
    import random

    space = SearchSpace(num_layers=4, skip_prior=0.5, max_skip_fraction=0.125)  # 5 sets: none, or one sublayer
    sets = [SkipSet(), *[SkipSet.of(a, m, 4) for a, m in [([1], []), ([2], []), ([], [1]), ([], [2])]]]
    every = {space.key(s) for s in sets}
    assert len(every) == space.size == 5
    left = SkipSet.of([], [2], 4)
    drawn = space.random_unevaluated(every - {space.key(left)}, random.Random(0))
    assert drawn == left
    assert space.random_unevaluated(every, random.Random(0)) is None
    # With two head sizes, each set comes with the full head or either trimmed one: three times the sets.
    ranking = VocabularyRanking(tuple(range(10)))
    headed = SearchSpace(num_layers=4, skip_prior=0.5, max_skip_fraction=0.125, head_rows=(4, 2), ranking=ranking)
    assert headed.head_rows == (2, 4) and headed.size == 15
    with_heads = {headed.key(SkipSet(s.attn, s.mlp, headed.head(rows))) for s in sets for rows in (0, 2, 4)}
    left = SkipSet.of([1], [], 4, ranking.head(4))
    assert headed.random_unevaluated(with_heads - {headed.key(left)}, random.Random(0)) == left
    assert headed.random_unevaluated(with_heads, random.Random(0)) is None


def test_the_head_size_is_a_parameter_beside_the_sublayers():
    """A trial's parameters name its head; warm starts draft with each trimmed head, nothing skipped, after plain
    decoding; a head outside the space, or one asked before the study has ranked its vocabulary, is refused."""
    ranking = VocabularyRanking((7, 3, 9, 1, 0, 2))
    space = SearchSpace(num_layers=6, head_rows=(2, 4), ranking=ranking)
    skip = SkipSet.of([2], [3], 6, DraftHead((7, 3, 9, 1)))
    assert space.params_for(skip)["head_rows"] == 4 and space.from_params(space.params_for(skip)) == skip
    assert space.from_params(space.params_for(SkipSet.of([2], [], 6))).head is None
    assert space.warm_starts()[:3] == [SkipSet(), SkipSet(head=DraftHead((7, 3, 9, 1))), SkipSet(head=DraftHead((7, 3)))]
    with pytest.raises(ValueError, match="not in this search space"):
        space.head(3)
    with pytest.raises(ValueError, match="no ranking yet"):
        SearchSpace(num_layers=6, head_rows=(2,)).head(2)
    with pytest.raises(ValueError, match="distinct whole numbers"):
        SearchSpace(num_layers=6, head_rows=(2, 2))
    assert "ranking" not in space.as_dict() and SearchSpace(**space.as_dict()) == space


def tiny_profile():
    from skipsearch.decode.cost_profile import CostProfile

    return CostProfile.from_dict(dict(device="cpu", dtype="float32", architecture="LlamaForCausalLM",
                                      num_hidden_layers=4, context_tokens=8, attn_s=1.0, mlp_s=1.0, rest_s=1.0,
                                      verify_s=[9.0, 9.2, 9.4, 9.6]))


@pytest.mark.parametrize("objective, sampler", [("speed_x_acceptance", "tpe"), ("speedup", "tpe"),
                                                ("modeled", "tpe"), ("pareto", "nsga2")])
def test_the_empty_set_is_plain_decoding_by_definition_and_never_exported(tmp_path, monkeypatch, objective, sampler):
    decoded = []
    original = Evaluator._decode
    monkeypatch.setattr(Evaluator, "_decode", lambda self, prompt, skip, **options: (
        decoded.append(skip), original(self, prompt, skip, **options))[1])
    model = tiny_model()
    study = run_study(model, ModelInfo.of(model, "tiny"), "float32", PROMPTS,
                      settings(tmp_path, n_trials=3, objective=objective, sampler=sampler, confirm_top=5),
                      SearchSpace(num_layers=4, skip_prior=0.4), DraftPolicy(max_draft_tokens=3), None,
                      profile=tiny_profile() if objective == "modeled" else None)
    plain = study.trials[0]  # the first warm start skips nothing
    assert plain.user_attrs["skip_attn"] == plain.user_attrs["skip_mlp"] == [] and plain.state == TrialState.COMPLETE
    assert "plain decoding" in plain.user_attrs["plain_decoding"] and "not decoded" in plain.user_attrs["plain_decoding"]
    # Exactly plain decoding's value, for every objective: speedup 1, acceptance counted as 1.
    assert plain.values == ([1.0, 1.0] if objective == "pareto" else [1.0])
    key = "predicted_speedup" if objective == "modeled" else "speedup"
    assert plain.user_attrs[key] == plain.user_attrs[key + "_low"] == plain.user_attrs[key + "_high"] == 1.0
    assert plain.user_attrs["acceptance_rate"] is None and plain.user_attrs["paired_runs"] == 0
    assert "stopped_early" not in plain.user_attrs and "match" not in plain.user_attrs
    # The pruner gets plain decoding's value prompt by prompt (Optuna prunes single-objective studies only).
    assert plain.intermediate_values == ({} if objective == "pareto" else {0: 1.0, 1: 1.0})
    # Nothing decoded the empty set: plain decoding runs only as the reference and as the other half of each pair.
    assert not [skip for skip in decoded if skip is not None and not skip.size]
    # Confirmation and export only ever consider sets that skip something.
    record = study.user_attrs["skipsearch_confirmation"]
    assert record["candidates"] and all(c["skip_attn"] or c["skip_mlp"] for c in record["candidates"])
    decision = decide(study)
    config = export_trial(study, tmp_path / "best.json")
    if decision.chosen is None:
        assert config.skip == SkipSet() and config.search.trial_number is None
    else:
        assert config.skip.size and decision.chosen.trial != plain.number
    assert "trial 0, the empty set, is plain decoding: scored 1 by definition, not decoded" in study_summary(study)


def test_a_compiled_study_runs_regional_steps(monkeypatch):
    """A study's compiled trials run regional steps (a new skip set compiles nothing; on CUDA they are what
    generate --compile runs), never frozen ones, which would keep a model copy per compiled skip set."""
    import skipsearch.search.evaluation as evaluation

    calls = []
    real_generate = evaluation.generate
    monkeypatch.setattr(evaluation, "generate", lambda *a, **k: calls.append((k["compile"], k["compile_mode"])) or
                        real_generate(*a, **dict(k, compile_backend="aot_eager")))
    compiled = make_evaluator()
    compiled.compile = True
    evaluation = compiled.evaluate(SkipSet.of([1], [], 4))
    assert evaluation.speedup.estimate > 0 and calls and set(calls) == {(True, "regional")}
    calls.clear()
    make_evaluator().evaluate(SkipSet.of([1], [], 4))
    assert calls and {compile for compile, _ in calls} == {False}


def test_the_pre_screen_first_decodes_the_reference_with_the_full_model():
    """The first trial may be pre-screened before any evaluation: its reference is the full model's output, not the
    draft's (it was once decoded inside draft mode)."""
    model = tiny_model()
    expected = make_evaluator(model).reference_tokens()
    evaluator = make_evaluator(model)
    assert 0.0 <= evaluator.match_rate(SkipSet.of([1, 2], [1], 4)) <= 1.0
    assert evaluator.reference_tokens() == expected


def test_the_summary_says_when_warm_starts_left_the_sampler_no_trial():
    from optuna.distributions import FloatDistribution

    from skipsearch.search.records import STUDY_ATTR

    space = SearchSpace(num_layers=4)
    study = optuna.create_study(study_name="warm")
    study.set_user_attr(STUDY_ATTR, {"model": {"name_or_path": "tiny", "architecture": "LlamaForCausalLM",
                                               "num_hidden_layers": 4, "hidden_size": 32},
                                     "objective": "speed_x_acceptance"})

    def add(skip, **attrs):
        params = space.params_for(skip)
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={name: FloatDistribution(0, 1) for name in params}, values=[1.0],
            user_attrs={"skip_attn": list(skip.attn), "skip_mlp": list(skip.mlp), "skipped": skip.size, **attrs}))

    add(SkipSet.of([1], [], 4), warm_start=True)
    add(SkipSet.of([2], [], 4), warm_start=True)
    assert study_summary(study).endswith("; every trial was a warm start: the sampler has proposed no set yet")
    assert study_summary(study, n_trials=2).endswith("; every trial was a warm start: the sampler has proposed no set "
                                                     "yet (--n-trials 2 leaves it none: give more than 2)")
    # Given room, it was stopped (a timeout, a signal) before the sampler's turn: no advice to raise --n-trials.
    assert study_summary(study, n_trials=20).endswith("the sampler has proposed no set yet")
    add(SkipSet.of([1], [2], 4))  # the sampler's
    assert "every trial was a warm start" not in study_summary(study)


def labelled_study(name):
    from skipsearch.search.records import STUDY_ATTR

    study = optuna.create_study(study_name=name)
    study.set_user_attr(STUDY_ATTR, {"model": {"name_or_path": "tiny", "architecture": "LlamaForCausalLM",
                                               "num_hidden_layers": 4, "hidden_size": 32},
                                     "objective": "speed_x_acceptance"})
    return study


def add_measured(study, skip, speedup):
    from optuna.distributions import FloatDistribution

    params = SearchSpace(num_layers=4).params_for(skip)
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions={name: FloatDistribution(0, 1) for name in params}, values=[speedup],
        user_attrs={"skip_attn": list(skip.attn), "skip_mlp": list(skip.mlp), "skipped": skip.size,
                    "speedup": speedup, "acceptance_rate": 1.0}))


def test_a_set_two_workers_decoded_at_once_is_confirmed_once_as_its_first_trial():
    from skipsearch.search.ranking import best_candidates

    study = labelled_study("twice")
    add_measured(study, SkipSet.of([1], [], 4), 1.1)
    add_measured(study, SkipSet.of([2], [], 4), 1.2)
    add_measured(study, SkipSet.of([1], [], 4), 1.3)  # the same set, decoded by a second worker at the same time
    add_measured(study, SkipSet.of([1], [2], 4), 1.0)
    candidates = best_candidates(study, 3)
    assert [t.number for t in candidates] == [1, 0, 3]


def add_interval(study, skip, speedup, low, high):
    """A decoded trial whose speedup carries its 95% interval (acceptance 1: the score is the speedup)."""
    from skipsearch.search.records import Figures, Ratio, TrialRecord

    figures = Figures(speedup=Ratio(speedup, low, high), paired_runs=4, acceptance_rate=1.0)
    attrs = TrialRecord(skip=skip, skipped=skip.size, figures=figures).attrs()
    study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=speedup, user_attrs=attrs))


def test_assured_score_is_the_score_at_the_interval_low_end_and_the_estimate_without_one():
    from skipsearch.search.records import Figures, Ratio
    from skipsearch.search.ranking import assured_score

    figures = Figures(speedup=Ratio(1.5, 0.6, 3.0), acceptance_rate=0.8)
    assert assured_score(figures, "speed_x_acceptance") == pytest.approx(0.6 * 0.8)
    assert assured_score(figures, "speedup") == pytest.approx(0.6)
    assert assured_score(figures, "pareto") == pytest.approx(0.6 * 0.8)
    assert assured_score(Figures(speedup=Ratio(1.5), acceptance_rate=0.8), "speed_x_acceptance") == pytest.approx(1.2)
    modeled = Figures(predicted_speedup=Ratio(1.4, 1.1, 1.6), acceptance_rate=0.5)
    assert assured_score(modeled, "modeled") == pytest.approx(1.1)


def test_a_precisely_measured_set_is_confirmed_beside_sets_that_noise_ranked_above_it():
    """The thirty-second session's study under load: noise-inflated sets with wide intervals filled all three
    confirmation places, and the set that pays (1.2x, narrow) was never measured again."""
    from skipsearch.search.ranking import best_candidates

    study = labelled_study("noisy")
    add_interval(study, SkipSet.of([1], [], 4), 1.78, 0.26, 7.2)
    add_interval(study, SkipSet.of([2], [], 4), 1.6, 0.4, 6.0)
    add_interval(study, SkipSet.of([3], [], 4), 1.49, 0.5, 4.4)
    add_interval(study, SkipSet.of([], [1], 4), 1.21, 1.12, 1.31)  # the precise one: fourth by its estimate
    add_interval(study, SkipSet.of([], [2], 4), 1.1, 0.9, 1.3)
    assert [t.number for t in best_candidates(study, 3)] == [0, 3, 1]  # by score, by assurance, by score
    assert [t.number for t in best_candidates(study, 1)] == [0]  # the best by score keeps the first place
    assert [t.number for t in best_candidates(study, 5)] == [0, 3, 1, 4, 2]


def test_workers_of_a_shared_study_seed_their_samplers_apart_and_one_process_by_seed_alone(tmp_path, monkeypatch):
    from skipsearch.search import study as study_module

    assert study_module.sampler_seed(7, f"sqlite:///{tmp_path}/s.db") == 7
    assert study_module.sampler_seed(7, optuna.storages.InMemoryStorage()) == 7
    journal = f"journal:{tmp_path}/s.log"
    seeds = []
    for tag in ("host:101", "host:102"):
        monkeypatch.setattr(study_module, "worker_tag", lambda tag=tag: tag)
        seeds.append(study_module.sampler_seed(0, journal))
    assert seeds[0] != seeds[1]
    # Two random samplers of one shared study, seeded so, propose different first sets.
    storage = optuna.storages.InMemoryStorage()
    space = SearchSpace(num_layers=6, skip_prior=0.4)
    proposals = []
    for seed in seeds:
        study = optuna.create_study(study_name="shared", storage=storage, load_if_exists=True,
                                    sampler=make_sampler("random", seed, False))
        proposals.append(space.suggest(study.ask()))
    assert proposals[0] != proposals[1]


def other_profile():
    from skipsearch.decode.cost_profile import CostProfile

    return CostProfile.from_dict(dict(device="cpu", dtype="float32", architecture="LlamaForCausalLM",
                                      num_hidden_layers=4, context_tokens=8, attn_s=2.0, mlp_s=1.0, rest_s=1.0,
                                      verify_s=[9.0, 9.2, 9.4, 9.6], provenance={"created_at": "2026-11-29T00:00:00"}))


def run_modeled(model, tmp_path, profile, **kw):
    return run_study(model, ModelInfo.of(model, "tiny"), "float32", PROMPTS,
                     settings(tmp_path, objective="modeled", **kw), SearchSpace(num_layers=4, skip_prior=0.4),
                     DraftPolicy(max_draft_tokens=3), None, profile=profile)


def test_resuming_with_another_cost_profile_or_compile_setting_is_refused(tmp_path):
    model = tiny_model()
    run_modeled(model, tmp_path, tiny_profile(), n_trials=1)
    run_modeled(model, tmp_path, tiny_profile(), n_trials=2)  # the same profile again: resumed
    run_modeled(model, tmp_path, None, n_trials=2)  # none given: the stored one
    with pytest.raises(ValueError, match=r"another --cost-profile \(cpu, float32\); use a new --study-name for cpu, "
                                         r"float32, measured 2026-11-29"):
        run_modeled(model, tmp_path, other_profile(), n_trials=3)
    run(model, tmp_path, n_trials=1, study_name="eager", compile=False)
    with pytest.raises(ValueError, match=r"study 'eager' was made with another --compile \(False\)"):
        run(model, tmp_path, n_trials=2, study_name="eager", compile=True)


def test_a_worker_that_profiled_beside_another_adopts_the_profile_the_study_stored(tmp_path, monkeypatch):
    from dataclasses import replace

    from skipsearch.search import records
    from skipsearch.search import study as study_module

    first = tiny_profile()

    def profiled_while_another_worker_stored_its_own(model, **kw):
        shared = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/s.db")
        records.write_label(shared, replace(records.read_label(shared), cost_profile=first))
        return other_profile()

    monkeypatch.setattr(study_module, "profile_costs", profiled_while_another_worker_stored_its_own)
    study = run_modeled(tiny_model(), tmp_path, None, n_trials=1)
    assert records.read_label(study).cost_profile == first


def test_warm_starts_are_queued_by_the_rerun_of_a_study_stopped_after_its_label(tmp_path, monkeypatch):
    from skipsearch.search import study as study_module

    def noisy(model, **kw):
        raise ValueError("the machine is too noisy to profile")

    monkeypatch.setattr(study_module, "profile_costs", noisy)
    with pytest.raises(ValueError, match="too noisy"):
        run_modeled(tiny_model(), tmp_path, None, n_trials=3)
    assert optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/s.db").user_attrs["skipsearch"]
    study = run_modeled(tiny_model(), tmp_path, tiny_profile(), n_trials=3)
    assert study.trials[0].user_attrs.get("warm_start") and study.trials[0].user_attrs.get("plain_decoding")


def test_a_rerun_with_more_confirm_repeats_confirms_again(tmp_path):
    from skipsearch.search.records import read_confirmation

    model = tiny_model()
    study = run(model, tmp_path, n_trials=4, confirm_repeats=1)
    assert read_confirmation(study).repeats == 1
    assert read_confirmation(run(model, tmp_path, n_trials=4, confirm_repeats=3)).repeats == 3


def test_a_worker_that_ranked_the_vocabulary_beside_another_drafts_with_the_stored_ranking(monkeypatch):
    from skipsearch.search import heads
    from skipsearch.search.records import read_vocabulary, write_vocabulary

    study = optuna.create_study(study_name="ranked")
    first = VocabularyRanking(tuple(range(10)))

    def ranked_while_another_worker_stored_its_own(model, prompts, continuations, **kw):
        write_vocabulary(study, first)
        return VocabularyRanking(tuple(reversed(range(10))))

    monkeypatch.setattr(heads, "rank_vocabulary", ranked_while_another_worker_stored_its_own)
    space = heads.with_ranking(study, SearchSpace(num_layers=4, head_rows=(4,)), make_evaluator(), (), [PROMPTS[0]])
    assert space.ranking == first and read_vocabulary(study) == first


def test_the_summary_counts_trials_not_run_for_a_spent_budget_apart_from_failures():
    from skipsearch.search.records import surplus_reason

    study = labelled_study("surplus")
    add_measured(study, SkipSet.of([1], [], 4), 1.1)
    for reason in (surplus_reason(1), surplus_reason(1), "RuntimeError: boom"):
        study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, user_attrs={"fail_reason": reason}))
    summary = study_summary(study)
    assert "; 1 failed; 2 not run, the study already had its trials (no failure)" in summary


def test_a_workers_confirmation_does_not_overwrite_a_newer_one_stored_while_it_measured(monkeypatch):
    """On a shared storage, a worker that stopped later may confirm from more trials and store first: the slower
    worker's confirmation, chosen from fewer trials, is returned to it but not written over the newer one."""
    from skipsearch.search import study as study_module
    from skipsearch.search.records import (Confirmation, ConfirmedCandidate, Figures, read_confirmation,
                                           write_confirmation)

    study = labelled_study("raced")
    add_measured(study, SkipSet.of([1], [], 4), 1.1)
    add_measured(study, SkipSet.of([2], [], 4), 1.2)
    newer = Confirmation((), top=2, repeats=3, prompts=2, distinct_trials=3)

    def measured_while_another_worker_confirmed(trial, evaluator, objective, repeats):
        if read_confirmation(study) is None:
            add_measured(study, SkipSet.of([3], [], 4), 1.3)
            write_confirmation(study, newer)
        return ConfirmedCandidate(trial.number, trial.skip, 1.0, 1, 0.125, Figures(prompts=2))

    monkeypatch.setattr(study_module, "_confirm", measured_while_another_worker_confirmed)
    evaluator = SimpleNamespace(timed=True, prompts=[[5], [6]])
    mine = study_module.confirm_candidates(study, evaluator, "speed_x_acceptance", 2, 3, show_progress=False)
    assert mine.distinct_trials == 2 and len(mine.candidates) == 2
    assert read_confirmation(study) == newer
    again = study_module.confirm_candidates(study, evaluator, "speed_x_acceptance", 2, 3, show_progress=False)
    stored = read_confirmation(study)  # from as many trials: it stands
    assert again.distinct_trials == stored.distinct_trials == 3 and stored.candidates == again.candidates
