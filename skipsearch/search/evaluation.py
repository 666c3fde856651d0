"""Scoring one skip set: real self-speculative decoding of the calibration prompts, each run paired with plain
decoding, or (the modeled objective) measured acceptance priced by a cost profile."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..decode.controller import DraftMemory
from ..decode.cost_profile import CostProfile
from ..decode.loop import cuts_rounds, generate
from ..decode.policy import DraftPolicy
from ..decode.skipping import draft_mode
from ..decode.skipset import SkipSet
from ..decode.stats import DecodeStats, GenerationOutput
from .measure import Interval, paired_runs, ratio_interval
from .ranking import objective_value
from .records import Figures, Ratio


@dataclass
class Evaluation:
    """What decoding the calibration prompts with one skip set showed, each speed paired with plain decoding."""

    skip: SkipSet
    speedup: Interval | None  # measured, paired; None where not timed (the modeled objective)
    acceptance_rate: float | None  # None when nothing was drafted: plain decoding has no acceptance rate
    tokens_per_second: float | None
    baseline_tokens_per_second: float | None
    mean_accepted_tokens: float | None
    identical: bool
    skipped_fraction: float
    prompts: int  # prompts the figures cover: fewer than the evaluator's when the pruner stopped the trial early
    predicted_speedup: Interval | None = None  # from a cost profile, one prediction per prompt
    # In a study of several datasets: the same figures over each dataset's prompts alone.
    by_dataset: dict[str, Evaluation] = field(default_factory=dict)

    def figures(self) -> Figures:
        """The figures a study keeps of this evaluation."""
        return Figures(speedup=Ratio.of(self.speedup), paired_runs=self.speedup.pairs if self.speedup else 0,
                       predicted_speedup=Ratio.of(self.predicted_speedup), acceptance_rate=self.acceptance_rate,
                       tokens_per_second=self.tokens_per_second,
                       baseline_tokens_per_second=self.baseline_tokens_per_second,
                       mean_accepted_tokens=self.mean_accepted_tokens, identical=self.identical, prompts=self.prompts)

    def dataset_figures(self) -> dict[str, Figures] | None:
        """The figures a study keeps of each dataset's prompts (None: the prompts are of one dataset)."""
        return {name: evaluation.figures() for name, evaluation in self.by_dataset.items()} or None

    def score(self, objective: str) -> float | tuple[float, float]:
        """The objective's value (see ranking.py). Speed x acceptance counts plain decoding's acceptance as 1."""
        return objective_value(self.figures(), objective)


@dataclass
class _PromptRuns:
    """What decoding one prompt with a skip set showed: each paired run's speed ratio and rates, its statistics."""

    ratios: list[float]
    plain_rates: list[float]
    skip_rates: list[float]
    stats: DecodeStats
    identical: bool  # every output equalled plain greedy decoding's
    prediction: float | None  # the cost profile's speedup for these statistics

    def share(self, skip: SkipSet) -> Figures:
        """This prompt's figures: the pruner compares its share of the objective with the best trial's, prompt by
        prompt."""
        return Figures(speedup=Ratio(ratio_interval(self.ratios).estimate) if self.ratios else None,
                       predicted_speedup=None if self.prediction is None else Ratio(self.prediction),
                       acceptance_rate=self.stats.acceptance_rate if skip.drafts else None)


def _summary(skip: SkipSet, runs: list[_PromptRuns], num_layers: int) -> Evaluation:
    """The evaluation of `skip` over the prompts of `runs`."""
    total = DecodeStats()
    for run in runs:
        total.add(run.stats)
    ratios = [r for run in runs for r in run.ratios]
    plain_rates = [r for run in runs for r in run.plain_rates]
    skip_rates = [r for run in runs for r in run.skip_rates]
    predictions = [run.prediction for run in runs if run.prediction is not None]
    return Evaluation(
        skip=skip, speedup=ratio_interval(ratios) if ratios else None,
        acceptance_rate=total.acceptance_rate if skip.drafts else None,
        tokens_per_second=statistics.fmean(skip_rates) if skip_rates else None,
        baseline_tokens_per_second=statistics.fmean(plain_rates) if plain_rates else None,
        mean_accepted_tokens=total.mean_accepted_tokens if skip.drafts else None,
        identical=all(run.identical for run in runs), skipped_fraction=skip.skipped_fraction(num_layers),
        prompts=len(runs), predicted_speedup=ratio_interval(predictions) if predictions else None,
    )


@dataclass
class Evaluator:
    """Runs real self-speculative decoding of calibration prompts, each run paired with plain decoding.

    Per prompt and repeat, plain decoding and the skip set decode the same prompt back to back, in
    alternating order; a speedup is the geometric mean of those paired ratios with its interval.
    With `timed=False` (the modeled objective) nothing is timed: decoding reads no clock (its rounds are planned from
    the cost profile's prices and the acceptance seen, `generate`'s `timed`), only acceptance is measured, and the
    cost profile predicts the speedup, which makes the score deterministic.
    """

    model: torch.nn.Module
    prompts: list[list[int]]
    max_new_tokens: int
    policy: DraftPolicy
    eos_token_id: int | list[int] | None
    profile: CostProfile | None = None
    repeats: int = 1  # paired runs per prompt in a trial
    timed: bool = True
    clock: Callable[[], float] = time.perf_counter
    show_progress: bool = False  # a bar while decoding the reference, which takes a while on big models
    compile: bool = False  # compiled draft and verify steps, reused by trials that share a skip set
    # The dataset of each prompt, in a study of several: the evaluation then has figures per dataset too.
    datasets: list[str] | None = None
    _reference: list[list[int]] | None = field(default=None, repr=False)

    def _decode(self, prompt: list[int], skip: SkipSet | None, max_new_tokens: int | None = None,
                memory: DraftMemory | None = None) -> GenerationOutput:
        # Regional steps: a new skip set compiles nothing (on CUDA it is captured as CUDA graphs in milliseconds),
        # and on CUDA they are what generate/bench --compile run. Frozen CPU steps (generate's CPU default) would
        # compile each set for minutes and keep a copy of the model per set.
        # The run-time guard off: a trial measures the skip set itself, not plain decoding standing in for it.
        # `memory`: what the trial's earlier prompts taught the controller, as bench's and a server's calls share it.
        return generate(self.model, prompt, skip=skip, max_new_tokens=max_new_tokens or self.max_new_tokens,
                        policy=dataclasses.replace(self.policy, guard=False), eos_token_id=self.eos_token_id,
                        compile=self.compile, compile_mode="regional", memory=memory,
                        cost_profile=None if self.timed else self.profile, timed=self.timed)

    def reference_tokens(self) -> list[list[int]]:
        """Plain greedy decoding of every prompt (untimed; it also warms the process up)."""
        if self._reference is None:
            from tqdm.auto import tqdm

            prompts = tqdm(self.prompts, desc="reference: plain decoding", unit="prompt", leave=False,
                           disable=not self.show_progress)
            self._reference = [self._decode(p, None).tokens for p in prompts]
        return self._reference

    @torch.inference_mode()
    def match_rate(self, skip: SkipSet) -> float:
        """Share of positions where the draft's argmax equals the full model's greedy token, teacher-forced:
        one parallel forward per prompt (SWIFT's "matchness")."""
        matched = total = 0
        reference = self.reference_tokens()  # decoded by the full model: before draft mode, never inside it
        with draft_mode(self.model, skip):
            for prompt, continuation in zip(self.prompts, reference):
                ids = torch.tensor([prompt + continuation], device=self.model.device)
                guesses = self.model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
                matched += int((guesses == ids[0, len(prompt) :]).sum())
                total += len(continuation)
        return matched / total

    def evaluate(self, skip: SkipSet, report: Callable[[int, float], bool] | None = None,
                 objective: str = "speed_x_acceptance", repeats: int | None = None) -> Evaluation:
        """Decode every prompt with `skip`, paired with plain decoding.

        After each prompt, `report(prompt_index, that_prompt's_score)` is called; when it returns
        True the evaluation stops there (the pruner's call) and covers the prompts done so far.
        """
        reference = self.reference_tokens()
        repeats = repeats or self.repeats
        if self.timed and (self.compile or skip.head is not None):
            # Setting up a new skip set's steps (compiling, for the first; gathering a trimmed head's rows) must not
            # land in a timed run; one round with a draft is enough to set everything up.
            self._decode(self.prompts[0], skip, max_new_tokens=min(self.max_new_tokens, 3))
        runs, memory = [], DraftMemory()
        for index, prompt in enumerate(self.prompts):
            runs.append(self._runs(index, prompt, skip, repeats, reference[index], memory))
            if report is not None and report(index, objective_value(runs[-1].share(skip), objective)):
                break
        num_layers = self.model.config.num_hidden_layers
        evaluation = _summary(skip, runs, num_layers)
        for name in dict.fromkeys(self.datasets or ()):
            own = [run for run, dataset in zip(runs, self.datasets) if dataset == name]
            if own:  # a trial stopped early may not have reached every dataset
                evaluation.by_dataset[name] = _summary(skip, own, num_layers)
        return evaluation

    def _runs(self, index: int, prompt: list[int], skip: SkipSet, repeats: int, reference: list[int],
              memory: DraftMemory) -> _PromptRuns:
        """Decode `prompt` with `skip`, `repeats` times paired with plain decoding (once, untimed, when not timed)."""
        stats, ratios, plain_rates, skip_rates = DecodeStats(), [], [], []
        if self.timed:
            pairs = paired_runs(lambda: self._decode(prompt, None), lambda: self._decode(prompt, skip, memory=memory),
                                repeats, first_index=index, clock=self.clock)
            outputs = [out for _, (out, _) in pairs]
            for (plain, plain_s), (out, out_s) in pairs:
                plain_rates.append(len(plain.tokens) / plain_s)
                skip_rates.append(len(out.tokens) / out_s)
                ratios.append(skip_rates[-1] / plain_rates[-1])
        else:
            outputs = [self._decode(prompt, skip, memory=memory)]
        for out in outputs:
            stats.add(out.stats)
        return _PromptRuns(ratios, plain_rates, skip_rates, stats, all(out.tokens == reference for out in outputs),
                           self._predict(skip, stats))

    def plain_decoding(self, report: Callable[[int, float], bool] | None = None) -> Evaluation:
        """The empty skip set's evaluation, without decoding anything.

        Skipping nothing is plain decoding: its speedup over plain decoding is 1 and its acceptance counts as 1
        by definition, so every objective's value is exactly plain decoding's (1, or (1, 1) for pareto) and a
        measurement would only add noise. `report` gets that value for every prompt, so that the pruner can
        compare later trials prompt by prompt with plain decoding when plain decoding is the best trial.
        (`evaluate(SkipSet())` still measures plain decoding against itself, for noise studies.)
        """
        exact = Interval(1.0, 1.0, 1.0, 0)
        if report is not None:
            for index in range(len(self.prompts)):
                report(index, 1.0)  # nothing to stop early: the value is exact
        return Evaluation(
            skip=SkipSet(), speedup=exact if self.timed else None, acceptance_rate=None, tokens_per_second=None,
            baseline_tokens_per_second=None, mean_accepted_tokens=None, identical=True, skipped_fraction=0.0,
            prompts=len(self.prompts), predicted_speedup=exact if self.profile is not None else None,
        )

    def _predict(self, skip: SkipSet, stats: DecodeStats) -> float | None:
        if self.profile is None:
            return None
        # Timed: this run's rounds as they ran here. Untimed (modeled): as the profile's device runs them, uncut.
        cut = self.timed and cuts_rounds(self.policy.adaptive, self.model.device)
        compiled = self.compile if self.timed else self.profile.compiled_steps
        return self.profile.predict_speedup(skip, stats, adaptive=cut, max_draft_tokens=self.policy.max_draft_tokens,
                                            compiled=compiled)
