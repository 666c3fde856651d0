"""A study must never claim a speedup that noise made up, and must find one that is real.

The clock is simulated: each executed attention / MLP sublayer and each forward advances a
"true" time by a fixed cost, and every reading of the clock scales the time since the last
reading by multiplicative noise of +-50% and a slow drift, as a busy shared machine would.
"""

import math
import random
import time

import optuna
import pytest
import torch

from conftest import tiny_model
from skipsearch.decode.adapter import decoder_layers
from skipsearch.decode.config import ModelInfo
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet
from skipsearch.report.export import decide, export_trial
from skipsearch.search.records import study_summary
from skipsearch.search.study import Evaluator, SearchSpace, StudySettings, run_study

PROMPTS = [[5, 9, 14, 3], [7, 2, 30, 31, 8], [11, 4, 19]]
POLICY = DraftPolicy(max_draft_tokens=4, adaptive=False)


class SimulatedClock:
    """True time from the work the model does; readings distorted by noise and drift."""

    def __init__(self, model, sublayer_cost=1.0, rest_cost=0.1, verify_scales=True, noise=0.5, seed=0):
        self.true = self.last_true = self.reading = 0.0
        self.noise, self.rng = noise, random.Random(seed)

        def cost(base):
            def hook(module, args, kwargs):
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                tokens = kwargs["input_ids"].shape[1] if hidden is None else hidden.shape[1]
                # Compute-bound (cost grows with tokens, verification is not free) or memory-bound (flat).
                self.true += base * (tokens if verify_scales else 1)
            return hook

        self.handles = [model.register_forward_pre_hook(cost(rest_cost), with_kwargs=True)]
        for layer in decoder_layers(model):
            for sublayer in (layer.self_attn, layer.mlp):
                self.handles.append(sublayer.register_forward_pre_hook(cost(sublayer_cost), with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def __call__(self) -> float:
        elapsed, self.last_true = self.true - self.last_true, self.true
        drift = 1.0 + 0.5 * math.sin(self.true / 500.0)
        self.reading += elapsed * drift * (1.0 + self.rng.uniform(-self.noise, self.noise))
        return self.reading


def lossless_layers_model():
    """Layers 1 and 2 contribute nothing (zero output projections): skipping them is free of rejections."""
    model = tiny_model(dtype=torch.float64)
    with torch.no_grad():
        for i in (1, 2):
            decoder_layers(model)[i].self_attn.o_proj.weight.zero_()
            decoder_layers(model)[i].mlp.down_proj.weight.zero_()
    return model


def study(model, clock, seed, **kw):
    settings = dict(study_name=f"s{seed}", storage=optuna.storages.InMemoryStorage(), seed=seed, n_trials=5,
                    min_match=0.0, show_progress_bar=False, max_new_tokens=8, confirm_top=2, confirm_repeats=3)
    settings.update(kw)
    return run_study(model, ModelInfo.of(model, "tiny"), "float64", PROMPTS, StudySettings(**settings),
                     SearchSpace(num_layers=4, skip_prior=0.4), POLICY, None, clock=clock)


def test_noise_never_exports_a_skip_set_that_is_truly_slower(tmp_path):
    model = tiny_model(dtype=torch.float64)
    for seed in range(20):
        clock = SimulatedClock(model, verify_scales=True, seed=seed)
        result = study(model, clock, seed)
        config = export_trial(result, tmp_path / f"best{seed}.json")
        assert config.skip == SkipSet(), (seed, decide(result).text)
        assert "no skip set was confirmed faster" in config.metrics.verdict
        clock.remove()


def true_ratio(model, skip):
    """The speedup without noise: the clock's true time, paired prompt by prompt."""
    clock = SimulatedClock(model, verify_scales=False, noise=0.0)
    evaluator = Evaluator(model=model, prompts=PROMPTS, max_new_tokens=8, policy=POLICY, eos_token_id=None,
                          clock=lambda: clock.true)
    try:
        return evaluator.evaluate(skip).speedup.estimate
    finally:
        clock.remove()


def test_a_truly_faster_skip_set_is_exported_with_an_interval_that_contains_its_true_ratio(tmp_path):
    model = lossless_layers_model()
    clock = SimulatedClock(model, verify_scales=False, seed=1)
    # The lossless space holds 16 sets: the study sees all of them.
    result = study(model, clock, 1, n_trials=16, confirm_top=3, confirm_repeats=6)
    config = export_trial(result, tmp_path / "best.json")
    assert config.skip.size > 0, decide(result).text
    assert config.metrics.confirmed and config.metrics.acceptance_rate == 1.0
    clock.remove()
    truth = true_ratio(model, config.skip)
    assert truth > 1.0
    assert config.metrics.speedup_low <= truth <= config.metrics.speedup_high
    assert config.metrics.speedup_low > 1.0


def count_decodes(monkeypatch):
    calls = []
    original = Evaluator._decode

    def counted(self, prompt, skip, **options):
        calls.append(skip)
        return original(self, prompt, skip, **options)

    monkeypatch.setattr(Evaluator, "_decode", counted)
    return calls


def test_a_repeated_skip_set_is_answered_without_decoding_and_n_trials_counts_distinct_sets(monkeypatch):
    model = tiny_model()
    calls = count_decodes(monkeypatch)
    result = study(model, time.perf_counter, 0, n_trials=6, confirm_top=0)
    trials = result.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    distinct = [t for t in trials if "repeat_of" not in t.user_attrs]
    repeats = [t for t in trials if "repeat_of" in t.user_attrs]
    assert len(distinct) == 6
    assert len({(tuple(t.user_attrs["skip_attn"]), tuple(t.user_attrs["skip_mlp"])) for t in distinct}) == 6
    for trial in repeats:
        first = result.trials[trial.user_attrs["repeat_of"]]
        assert trial.values == first.values and trial.user_attrs["skip_attn"] == first.user_attrs["skip_attn"]
    # Reference decoding (one per prompt), then each distinct set: one plain + one skip decode per prompt; the
    # empty set (the first warm start) is plain decoding, scored by definition without decoding.
    [plain] = [t for t in distinct if "plain_decoding" in t.user_attrs]
    assert plain.number == 0 and plain.user_attrs["skip_attn"] == plain.user_attrs["skip_mlp"] == []
    assert len(calls) == len(PROMPTS) + 2 * len(PROMPTS) * (len(distinct) - 1)
    summary = study_summary(result)
    assert summary.startswith("6 distinct skip sets evaluated") and f"{len(repeats)} repeated proposals" in summary
    assert "trial 0, the empty set, is plain decoding: scored 1 by definition, not decoded" in summary


def test_an_exhausted_space_stops_the_study_and_says_so(capsys):
    model = tiny_model()
    space = SearchSpace(num_layers=4, skip_prior=0.4, max_skip_fraction=0.125)  # at most 1 of 4 sublayers: 5 sets
    assert space.size == 5
    result = run_study(model, ModelInfo.of(model, "tiny"), "float32", PROMPTS,
                       StudySettings(study_name="x", storage=optuna.storages.InMemoryStorage(), n_trials=12,
                                     min_match=0.0, show_progress_bar=False, max_new_tokens=4, confirm_top=1,
                                     confirm_repeats=1),
                       space, POLICY, None)
    assert "the search space is exhausted: all 5 skip sets in it were evaluated" in capsys.readouterr().out
    assert study_summary(result).startswith("5 distinct skip sets evaluated")


def test_a_screened_out_set_still_gives_the_sampler_a_value(monkeypatch):
    model = tiny_model()
    monkeypatch.setattr(Evaluator, "match_rate", lambda self, skip: 0.2)
    result = study(model, time.perf_counter, 0, n_trials=3, min_match=0.5, confirm_top=1)
    screened = [t for t in result.trials if "screened_out" in t.user_attrs]
    assert screened and all(t.state == optuna.trial.TrialState.COMPLETE for t in screened)
    assert all(t.values[0] == pytest.approx(0.5 * 0.2 * 0.2) for t in screened)
    assert "no skip set that drafts was decoded to be confirmed (the pre-screen stopped each" in decide(result).text


def test_plain_decoding_has_no_acceptance_rate():
    evaluator = Evaluator(model=tiny_model(), prompts=PROMPTS[:2], max_new_tokens=6, policy=POLICY, eos_token_id=None)
    plain = evaluator.evaluate(SkipSet())
    assert plain.acceptance_rate is None and plain.mean_accepted_tokens is None
    assert plain.score("speed_x_acceptance") == plain.speedup.estimate  # counted as 1, documented
    skipping = evaluator.evaluate(SkipSet.of([1], [2], 4))
    assert 0.0 <= skipping.acceptance_rate <= 1.0
    assert skipping.score("speed_x_acceptance") == pytest.approx(skipping.speedup.estimate * skipping.acceptance_rate)
