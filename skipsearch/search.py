"""The Optuna study: propose skip sets, score them by real self-speculative decoding, export the best.

Search space. Every sublayer that may be skipped gets one parameter u in [0, 1], and is
skipped when u < `skip_prior`. A sampler drawing u uniformly therefore skips about
`skip_prior` of the sublayers (15% by default) instead of half of them, which small and
mid-size models never accept. `skip_prior=0.5` is the plain 2L-switch space of Draft & Verify.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import math
import os
import random
import socket
import signal
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from .config import ModelInfo
from .constants import OBJECTIVES, SAMPLERS  # kept there so the CLI reads them without importing optuna
from .costs import CostProfile, contexts_for, device_name, profile_costs
from .decoding import DecodeStats, DraftPolicy, GenerationOutput, generate
from .measure import Interval, paired_runs, ratio_interval
from .storage import (WORKER_ATTR, Heartbeat, disk_full, explain_stale_trials, heartbeat_enabled, make_storage,
                      recover_dead_workers_trials)
from .skipping import SkipSet, draft_mode

STUDY_ATTR = "skipsearch"
CONFIRM_ATTR = "skipsearch_confirmation"
# Trial attributes about how a trial came about, not what it measured: a repeated proposal does not copy them.
_BOOKKEEPING_ATTRS = frozenset({"warm_start", "worker", "retry_of", "explored", "fail_reason"})


@dataclass(frozen=True)
class SearchSpace:
    num_layers: int
    keep_first_last: bool = True
    max_skip_fraction: float = 0.5
    skip_prior: float = 0.15

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_skip_fraction <= 1.0:
            raise ValueError(f"max_skip_fraction must be in [0, 1], got {self.max_skip_fraction}")
        if not 0.0 < self.skip_prior < 1.0:
            raise ValueError(f"skip_prior must be in (0, 1), got {self.skip_prior}")
        if self.keep_first_last and self.num_layers < 3:
            raise ValueError("keep_first_last needs a model with at least 3 layers")

    def sublayers(self) -> list[tuple[str, int]]:
        first = 1 if self.keep_first_last else 0
        last = self.num_layers - 1 if self.keep_first_last else self.num_layers
        return [(kind, i) for i in range(first, last) for kind in ("attn", "mlp")]

    @staticmethod
    def param_name(kind: str, layer: int) -> str:
        return f"{kind}_{layer:03d}"

    @property
    def max_skipped(self) -> int:
        return math.floor(self.max_skip_fraction * 2 * self.num_layers)

    @property
    def size(self) -> int:
        """How many distinct skip sets the space holds (the empty set included)."""
        n = len(self.sublayers())
        return sum(math.comb(n, k) for k in range(min(n, self.max_skipped) + 1))

    def random_unevaluated(self, evaluated: set, rng: random.Random, draws: int = 1000) -> SkipSet | None:
        """A skip set drawn like a uniform sampler would (the prior included) whose key is not in `evaluated`."""
        for _ in range(draws):
            skip = self.skip_set({sublayer: rng.random() for sublayer in self.sublayers()})
            if (skip.attn, skip.mlp) not in evaluated:
                return skip
        return None

    def suggest(self, trial: optuna.Trial) -> SkipSet:
        draws = {(kind, i): trial.suggest_float(self.param_name(kind, i), 0.0, 1.0) for kind, i in self.sublayers()}
        return self.skip_set(draws)

    def skip_set(self, draws: dict[tuple[str, int], float]) -> SkipSet:
        # Over the cap, keep the sublayers whose draws are furthest below the prior.
        chosen = sorted((u, kind, i) for (kind, i), u in draws.items() if u < self.skip_prior)[: self.max_skipped]
        return SkipSet.of(
            [i for _, kind, i in chosen if kind == "attn"], [i for _, kind, i in chosen if kind == "mlp"], self.num_layers
        )

    def from_params(self, params: dict[str, float]) -> SkipSet:
        return self.skip_set({(kind, i): params[self.param_name(kind, i)] for kind, i in self.sublayers()})

    def params_for(self, skip: SkipSet) -> dict[str, float]:
        """Parameters that make `suggest` return `skip` (for enqueued warm starts)."""
        skipped = {("attn", i) for i in skip.attn} | {("mlp", i) for i in skip.mlp}
        return {self.param_name(kind, i): 0.0 if (kind, i) in skipped else 1.0 for kind, i in self.sublayers()}

    def warm_starts(self) -> list[SkipSet]:
        """No skip, then structured sets that tend to be cheap to draft and often accepted."""
        allowed = set(self.sublayers())
        n, half = self.num_layers, self.num_layers // 2

        def keep(kind: str, ids: Sequence[int]) -> list[int]:
            return [i for i in ids if (kind, i) in allowed]

        upper_attn = keep("attn", range(half, n, 2))
        # From sparse to dense: small models accept only a few skipped sublayers, large ones many.
        candidates = [
            SkipSet(),
            SkipSet.of(keep("attn", range(n - 3, n - 1)), (), n),
            SkipSet.of(keep("attn", range(half, n, 4)), (), n),
            SkipSet.of(upper_attn, (), n),
            SkipSet.of(upper_attn, keep("mlp", range(half + 1, n, 4)), n),
        ]
        unique = []
        for skip in candidates:
            if skip not in unique and skip.size <= self.max_skipped:
                unique.append(skip)
        return unique


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

    def score(self, objective: str) -> float | tuple[float, float]:
        """The objective's value. Speed x acceptance counts plain decoding's acceptance as 1: nothing is rejected."""
        if objective == "modeled":
            if self.predicted_speedup is None:
                raise ValueError("the modeled objective needs a cost profile")
            return self.predicted_speedup.estimate
        acceptance = 1.0 if self.acceptance_rate is None else self.acceptance_rate
        if objective == "speedup":
            return self.speedup.estimate
        if objective == "pareto":
            return self.speedup.estimate, acceptance
        return self.speedup.estimate * acceptance

    def user_attrs(self) -> dict[str, Any]:
        """JSON-friendly trial attributes (Optuna stores them as JSON)."""
        attrs: dict[str, Any] = {
            "acceptance_rate": self.acceptance_rate, "tokens_per_second": self.tokens_per_second,
            "baseline_tokens_per_second": self.baseline_tokens_per_second,
            "mean_accepted_tokens": self.mean_accepted_tokens, "identical": self.identical,
            "skipped_fraction": self.skipped_fraction, "skipped": self.skip.size, "prompts": self.prompts,
        }
        for key, interval in (("speedup", self.speedup), ("predicted_speedup", self.predicted_speedup)):
            attrs[key] = interval.estimate if interval else None
            attrs[f"{key}_low"] = interval.low if interval else None
            # JSON has no infinity: one paired run bounds nothing above, stored as null.
            attrs[f"{key}_high"] = interval.high if interval and math.isfinite(interval.high) else None
        attrs["paired_runs"] = self.speedup.pairs if self.speedup else 0
        return attrs


@dataclass
class Evaluator:
    """Runs real self-speculative decoding of calibration prompts, each run paired with plain decoding.

    Per prompt and repeat, plain decoding and the skip set decode the same prompt back to back, in
    alternating order; a speedup is the geometric mean of those paired ratios with its interval.
    With `timed=False` (the modeled objective) nothing is timed: only acceptance is measured and the
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
    _reference: list[list[int]] | None = field(default=None, repr=False)

    def _decode(self, prompt: list[int], skip: SkipSet | None) -> GenerationOutput:
        # On a CPU a study compiles in inductor's default mode: frozen weights (generate's CPU default) keep a copy of
        # the model per compiled skip set for the life of the process and take minutes each to compile.
        mode = "default" if self.compile and self.model.device.type == "cpu" else None
        return generate(self.model, prompt, skip=skip, max_new_tokens=self.max_new_tokens, policy=self.policy,
                        eos_token_id=self.eos_token_id, compile=self.compile, compile_mode=mode)

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
        with draft_mode(self.model, skip):
            for prompt, continuation in zip(self.prompts, self.reference_tokens()):
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
        if self.compile and self.timed:
            self._decode(self.prompts[0], skip)  # compiling a new skip set's steps must not land in a timed run
        total, ratios, plain_rates, skip_rates, predictions = DecodeStats(), [], [], [], []
        identical, done = True, 0
        for index, prompt in enumerate(self.prompts):
            prompt_stats = DecodeStats()
            if self.timed:
                pairs = paired_runs(lambda: self._decode(prompt, None), lambda: self._decode(prompt, skip),
                                    repeats, first_index=index, clock=self.clock)
                outputs = [out for _, (out, _) in pairs]
                for (plain, plain_s), (out, out_s) in pairs:
                    plain_rates.append(len(plain.tokens) / plain_s)
                    skip_rates.append(len(out.tokens) / out_s)
                    ratios.append(skip_rates[-1] / plain_rates[-1])
                prompt_ratio = ratio_interval(ratios[-repeats:]).estimate
            else:
                outputs, prompt_ratio = [self._decode(prompt, skip)], None
            for out in outputs:
                identical &= out.tokens == reference[index]
                prompt_stats.add(out.stats)
            total.add(prompt_stats)
            done = index + 1
            prediction = self._predict(skip, prompt_stats)
            if prediction is not None:
                predictions.append(prediction)
            if report is not None:
                # This prompt's share of the objective: the pruner compares it with the best trial's, prompt by prompt.
                acceptance = prompt_stats.acceptance_rate if skip.size and objective == "speed_x_acceptance" else None
                value = prediction if objective == "modeled" else prompt_ratio * (1.0 if acceptance is None else acceptance)
                if report(index, value):
                    break
        return Evaluation(
            skip=skip, speedup=ratio_interval(ratios) if ratios else None,
            acceptance_rate=total.acceptance_rate if skip.size else None,
            tokens_per_second=statistics.fmean(skip_rates) if skip_rates else None,
            baseline_tokens_per_second=statistics.fmean(plain_rates) if plain_rates else None,
            mean_accepted_tokens=total.mean_accepted_tokens if skip.size else None, identical=identical,
            skipped_fraction=skip.skipped_fraction(self.model.config.num_hidden_layers), prompts=done,
            predicted_speedup=_spread(predictions) if predictions else None,
        )

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
        return self.profile.predict_speedup(skip, stats, adaptive=self.policy.adaptive)


def _spread(values: list[float]) -> Interval:
    """Deterministic per-prompt predictions summarised like measured ratios (their spread is over prompts)."""
    return ratio_interval(values) if len(set(values)) > 1 else Interval(values[0], values[0], values[0], len(values))


def make_sampler(name: str, seed: int | None, multi_objective: bool) -> optuna.samplers.BaseSampler:
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}: choose one of {', '.join(SAMPLERS)}")
    if name == "cmaes" and multi_objective:
        raise ValueError("the cmaes sampler handles one objective: use tpe, gp, nsga2 or random with --objective pareto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":
            # constant_liar keeps parallel workers from proposing the same point.
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True, n_startup_trials=8)
        if name == "gp":
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=8)
        if name == "cmaes":
            return optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=8)
        if name == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed)
        return optuna.samplers.RandomSampler(seed=seed)


def open_study(
    study_name: str, storage: optuna.storages.BaseStorage, objective: str,
    sampler: optuna.samplers.BaseSampler | None = None, pruner: optuna.pruners.BasePruner | None = None,
) -> optuna.Study:
    """Create the study or load it to resume; an existing study must have been made for this objective."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}: choose one of {', '.join(OBJECTIVES)}")
    directions = ["maximize", "maximize"] if objective == "pareto" else ["maximize"]
    try:
        return optuna.create_study(
            study_name=study_name, storage=storage, sampler=sampler, pruner=pruner, directions=directions,
            load_if_exists=True,
        )
    except ValueError as error:  # e.g. an existing study with other directions
        raise ValueError(f"study {study_name!r} cannot be resumed with --objective {objective}: {error}") from None


def finished_trials(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))


def distinct_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Finished trials that evaluated a skip set for the first time: what `n_trials` counts."""
    return [t for t in finished_trials(study) if "repeat_of" not in t.user_attrs]


def skip_key(attrs: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if "skip_attn" not in attrs or "skip_mlp" not in attrs:
        return None
    return tuple(attrs["skip_attn"]), tuple(attrs["skip_mlp"])


def screened_score(match: float, objective: str) -> float | tuple[float, float]:
    """The value a set stopped by the teacher-forced pre-screen gives the sampler, so that GP and TPE learn
    from it: an estimate below any set worth decoding, still rising with the match rate (acceptance
    follows match, and a set accepted this rarely runs at most at about half speed)."""
    if objective == "pareto":
        return 0.5 * match, match
    return 0.5 * match * match if objective == "speed_x_acceptance" else 0.5 * match


class SurplusTrial(Exception):
    """Raised at the start of a trial that would take the study past its trial budget."""


def make_objective(
    space: SearchSpace, evaluator: Evaluator, objective: str, min_match: float, n_trials: int | None = None
) -> Callable[[optuna.Trial], float | tuple[float, float]]:
    def run_trial(trial: optuna.Trial) -> float | tuple[float, float]:
        skip = space.suggest(trial)
        # Journal recovery reads it; set once the trial's point is whole, so a retry re-runs the same point.
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        trial.set_user_attr("skip_attn", list(skip.attn))
        trial.set_user_attr("skip_mlp", list(skip.mlp))
        key = skip_key({"skip_attn": list(skip.attn), "skip_mlp": list(skip.mlp)})
        earlier = {skip_key(t.user_attrs): t for t in reversed(distinct_trials(trial.study))}
        if key in earlier and earlier[key].state == TrialState.COMPLETE:
            # Decoding the same set again would only add noise: the sampler gets the value it already had.
            first = earlier[key]
            for name, value in first.user_attrs.items():
                if name not in _BOOKKEEPING_ATTRS:  # measurements only: how the first trial came about is its own
                    trial.set_user_attr(name, value)
            trial.set_user_attr("repeat_of", first.number)
            return tuple(first.values) if len(first.values) > 1 else first.values[0]
        if n_trials is not None:
            # Two workers may start a trial at once when one is left; the lower number wins.
            ahead = [t for t in trial.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                     if t.number < trial.number]
            if len(distinct_trials(trial.study)) + len(ahead) >= n_trials:
                trial.set_user_attr("fail_reason", f"not run: the study already had {n_trials} trials")
                raise SurplusTrial(f"the study already had {n_trials} finished or running trials")
        trial.set_user_attr("skipped", skip.size)
        trial.set_user_attr("skipped_fraction", skip.skipped_fraction(space.num_layers))

        def report(step: int, value: float) -> bool:
            if objective == "pareto":
                return False  # Optuna prunes single-objective studies only
            trial.report(value, step)  # the step is the prompt's index: the pruner pairs prompts across trials
            return trial.should_prune()

        if not skip.size:
            trial.set_user_attr("plain_decoding", "skips nothing: plain decoding, whose speedup is 1 and acceptance "
                                                  "counts as 1 by definition; not decoded")
            evaluation = evaluator.plain_decoding(report=report)
            for name, value in evaluation.user_attrs().items():
                trial.set_user_attr(name, value)
            return evaluation.score(objective)
        try:
            if min_match > 0:
                match = evaluator.match_rate(skip)
                trial.set_user_attr("match", match)
                if match < min_match:
                    trial.set_user_attr("screened_out", f"teacher-forced match {match:.2f} < {min_match}")
                    return screened_score(match, objective)
            evaluation = evaluator.evaluate(skip, report=report, objective=objective)
        except SurplusTrial:
            raise
        except Exception as error:
            # Optuna marks the trial failed and the study goes on; keep the reason on the trial.
            trial.set_user_attr("fail_reason", f"{type(error).__name__}: {error}")
            raise
        finally:
            _free_memory(evaluator.model)
        for name, value in evaluation.user_attrs().items():
            trial.set_user_attr(name, value)
        if evaluation.prompts < len(evaluator.prompts):
            # Optuna's advice for the Wilcoxon pruner: return the estimate so far instead of raising TrialPruned,
            # so that the sampler learns from the trial.
            trial.set_user_attr("stopped_early", f"worse than the best trial after {evaluation.prompts} prompts")
        return evaluation.score(objective)

    return run_trial


def _free_memory(model: torch.nn.Module) -> None:
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class StopRequest:
    """Why this worker should stop starting trials (Ctrl-C, too many failures); empty while it should go on."""

    reason: str = ""


class Interrupted(Exception):
    """A second Ctrl-C: abandon the running trial now. An Exception, so that Optuna fails the trial and goes on
    to the callbacks instead of unwinding the whole study; the caller still exports what finished."""


@contextlib.contextmanager
def stop_after_trial_on_interrupt(stop: StopRequest) -> Iterator[None]:
    """First Ctrl-C: finish the running trial, then stop (the caller still exports). Second: abandon it now."""

    def on_sigint(signum: int, frame: Any) -> None:
        if stop.reason.startswith("interrupted"):
            stop.reason = "interrupted twice: the running trial was abandoned"
            optuna.logging.set_verbosity(optuna.logging.ERROR)  # no traceback for the abandoned trial
            raise Interrupted("stopped by a second Ctrl-C")
        stop.reason = "interrupted"
        print("\nstopping after the running trial (Ctrl-C again to stop now)", flush=True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass(frozen=True)
class StudySettings:
    study_name: str
    storage: str | optuna.storages.BaseStorage
    objective: str = "speed_x_acceptance"
    sampler: str = "tpe"
    seed: int = 0
    n_trials: int = 20  # distinct skip sets to evaluate
    timeout: float | None = None
    min_match: float = 0.5
    dataset: str = "builtin"
    num_prompts: int = 4
    max_new_tokens: int = 32
    show_progress_bar: bool = True
    max_failures: int = 5
    warm_starts: bool = True
    pruning: bool = True
    # (name, skip set) enqueued before the structured warm starts: --warm-start files, published sets.
    first_trials: tuple[tuple[str, SkipSet], ...] = ()
    heartbeat: Heartbeat | None = field(default_factory=Heartbeat)
    repeats: int = 1  # paired runs per prompt in a trial
    confirm_top: int = 3  # best distinct candidates re-measured before export
    confirm_repeats: int = 2  # paired runs per prompt when confirming
    # A sampler stuck on evaluated sets gets a random unevaluated one queued after this many repeats in a row;
    # when none can be drawn, the space counts as exhausted.
    explore_after_repeats: int = 10
    compile: bool = False  # torch.compile the draft and verify steps (reused by trials sharing a skip set)


def run_study(
    model: torch.nn.Module, model_info: ModelInfo, dtype: str, prompts: list[list[int]], settings: StudySettings,
    space: SearchSpace, policy: DraftPolicy, eos_token_id: int | list[int] | None,
    profile: CostProfile | None = None, clock: Callable[[], float] = time.perf_counter,
) -> optuna.Study:
    """Run (or resume) the study until it has evaluated `settings.n_trials` distinct skip sets (or until
    timeout, Ctrl-C or an exhausted space), then confirm its best candidates (see `confirm_candidates`)."""
    multi = settings.objective == "pareto"
    prune = settings.pruning and not multi
    # Paired per-prompt comparisons with the best trial: drift moves both sides of a pair alike.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        pruner = optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=2) if prune else optuna.pruners.NopPruner()
    storage = settings.storage
    if isinstance(storage, str):
        storage = make_storage(storage, settings.heartbeat)
    study = open_study(settings.study_name, storage, settings.objective,
                       sampler=make_sampler(settings.sampler, settings.seed, multi), pruner=pruner)
    info = {
        "model": asdict(model_info), "objective": settings.objective, "sampler": settings.sampler,
        "dataset": settings.dataset, "num_prompts": settings.num_prompts, "max_new_tokens": settings.max_new_tokens,
        "seed": settings.seed, "device": str(model.device), "device_name": device_name(model.device), "dtype": dtype,
        "draft": asdict(policy),
        "space": asdict(space),
    }
    existing = study.user_attrs.get(STUDY_ATTR)
    if existing is None:
        # Labelled at once, before any slow work: a worker started beside this one checks its settings against it.
        study.set_user_attr(STUDY_ATTR, info)
    if settings.objective == "modeled":
        # The study keeps its profile, so a resumed study scores with the same costs.
        if existing is not None and "cost_profile" in existing and profile is None:
            profile = CostProfile.from_dict(existing["cost_profile"])
        elif profile is None:
            profile = profile_costs(model, contexts=contexts_for(model, prompts, settings.max_new_tokens),
                                    show_progress=settings.show_progress_bar)
        profile.check_model(model)
        info["cost_profile"] = profile.to_dict()
    if existing is not None:
        _check_resumable(settings.study_name, existing, info)
    if "cost_profile" in info and "cost_profile" not in (existing or {}):
        study.set_user_attr(STUDY_ATTR, info)  # now with the cost profile
    # Files and published sets first (also on resume), then the structured ones; only as many as the
    # budget, since a queued warm start is a trial too.
    for name, skip in settings.first_trials:
        study.enqueue_trial(space.params_for(skip), user_attrs={"warm_start": name}, skip_if_exists=True)
    if existing is None and settings.warm_starts:
        for skip in space.warm_starts()[: max(0, settings.n_trials - len(settings.first_trials))]:
            study.enqueue_trial(space.params_for(skip), user_attrs={"warm_start": True}, skip_if_exists=True)
    evaluator = Evaluator(model=model, prompts=prompts, max_new_tokens=settings.max_new_tokens, policy=policy,
                          eos_token_id=eos_token_id, profile=profile, repeats=settings.repeats,
                          timed=settings.objective != "modeled", clock=clock, show_progress=settings.show_progress_bar,
                          compile=settings.compile)
    stopped = ""
    if len(distinct_trials(study)) < settings.n_trials:
        objective = make_objective(space, evaluator, settings.objective, settings.min_match, settings.n_trials)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            stopped = _work(study, storage, objective, settings, space)
    if stopped.startswith("interrupted"):
        print("not confirming after Ctrl-C: the export keeps the last confirmation, if any")
    elif _confirmation_is_stale(study, settings.confirm_top):
        confirm_candidates(study, evaluator, settings.objective, settings.confirm_top, settings.confirm_repeats,
                           settings.show_progress_bar)
    return study


def confirmation_candidates(study: optuna.Study, top: int) -> list[FrozenTrial]:
    """The `top` distinct completed trials that skip something and were decoded, best score first."""
    multi = len(study.directions) > 1
    trials = [t for t in distinct_trials(study) if t.state == TrialState.COMPLETE and t.user_attrs.get("skipped", 0)
              and "screened_out" not in t.user_attrs]
    return sorted(trials, key=lambda t: _trial_score(t, multi), reverse=True)[:top]


def _trial_score(trial: FrozenTrial, multi: bool) -> float:
    if not multi:
        return trial.values[0]
    acceptance = trial.user_attrs.get("acceptance_rate")
    return trial.user_attrs["speedup"] * (1.0 if acceptance is None else acceptance)


def _confirmation_is_stale(study: optuna.Study, top: int) -> bool:
    record = study.user_attrs.get(CONFIRM_ATTR)
    wanted = [t.number for t in confirmation_candidates(study, top)]
    return record is None or [c["trial"] for c in record["candidates"]] != wanted


def confirm_candidates(study: optuna.Study, evaluator: Evaluator, objective: str, top: int, repeats: int,
                       show_progress: bool = True) -> dict[str, Any]:
    """Re-measure the best distinct candidates against plain decoding with more paired runs, and store the
    figures on the study: the export reads them, so the verdict, best.json, the plots and the notebook
    all quote the same confirmed numbers."""
    from tqdm.auto import tqdm

    results = []
    for trial in tqdm(confirmation_candidates(study, top), desc="confirming the best skip sets", unit="set",
                      disable=not show_progress, dynamic_ncols=True):
        skip = SkipSet.of(trial.user_attrs["skip_attn"], trial.user_attrs["skip_mlp"])
        evaluation = evaluator.evaluate(skip, objective=objective, repeats=repeats)
        score = evaluation.score(objective)
        results.append({"trial": trial.number, "skip_attn": list(skip.attn), "skip_mlp": list(skip.mlp),
                        "score": score[0] * score[1] if isinstance(score, tuple) else score,
                        **evaluation.user_attrs()})
    record = {"candidates": results, "top": top, "repeats": repeats if evaluator.timed else 1,
              "prompts": len(evaluator.prompts), "distinct_trials": len(distinct_trials(study))}
    study.set_user_attr(CONFIRM_ATTR, record)
    return record


def _work(
    study: optuna.Study, storage: optuna.storages.BaseStorage, objective: Callable, settings: StudySettings,
    space: SearchSpace | None = None,
) -> str:
    """Run trials one at a time until the study, shared with any other workers, has evaluated `n_trials`
    distinct skip sets; returns why it stopped short ("" when it did not).

    Distinct finished trials count; so do running ones, of this worker or another, so that the
    workers together do not overshoot. A repeated proposal costs no decoding and does not count.
    With heartbeats, a running trial whose worker died is failed after the grace period and
    re-enqueued, so a worker that only waits on running trials checks for stale ones instead of
    stopping. Failed trials do not count: they are retried, up to `max_failures` in a row.
    """
    heartbeat = heartbeat_enabled(storage)
    grace_s = (settings.heartbeat or Heartbeat()).grace_s
    stop = StopRequest()
    deadline = time.monotonic() + settings.timeout if settings.timeout else None
    failures_in_a_row = repeats_in_a_row = 0
    errors: list[Exception] = []  # the last trial's error, which Optuna catches and a full disk keeps off the trial

    def tracked(trial: optuna.Trial) -> float | tuple[float, float]:
        errors.clear()
        try:
            return objective(trial)
        except Exception as error:
            errors.append(error)
            raise

    def after_trial(study: optuna.Study, trial: FrozenTrial) -> None:
        nonlocal failures_in_a_row, repeats_in_a_row
        if str(trial.user_attrs.get("fail_reason", "")).startswith("not run"):
            return  # a surplus trial, not a failure
        if errors and disk_full(errors[0]):
            raise errors[0]
        failures_in_a_row = failures_in_a_row + 1 if trial.state == TrialState.FAIL else 0
        if failures_in_a_row >= settings.max_failures:
            reason = trial.user_attrs.get("fail_reason") or (
                f"{type(errors[0]).__name__}: {errors[0]}" if errors else "of an error Optuna logged above")
            stop.reason = f"{settings.max_failures} trials in a row failed, the last because {reason}"
        repeats_in_a_row = repeats_in_a_row + 1 if "repeat_of" in trial.user_attrs else 0
        if space is None:
            return
        distinct = distinct_trials(study)
        if len(distinct) >= space.size:
            stop.reason = f"the search space is exhausted: all {space.size} skip sets in it were evaluated"
        elif repeats_in_a_row >= settings.explore_after_repeats:
            # TPE on a small space can keep proposing its favourite; a random unevaluated set moves it on.
            evaluated = {skip_key(t.user_attrs) for t in distinct}
            fresh = space.random_unevaluated(evaluated, random.Random(settings.seed + trial.number))
            if fresh is None:
                stop.reason = (f"the sampler proposed only already-evaluated skip sets {repeats_in_a_row} times in a "
                               f"row and no unevaluated one could be drawn ({len(distinct)} distinct sets "
                               "evaluated): the search space looks exhausted")
            else:
                study.enqueue_trial(space.params_for(fresh), user_attrs={"explored": True})
                repeats_in_a_row = 0

    note = ""
    with stop_after_trial_on_interrupt(stop), _progress(study, settings.n_trials, settings.show_progress_bar) as bar:
        while not stop.reason:
            try:
                if heartbeat:
                    explain_stale_trials(study)
                else:
                    recover_dead_workers_trials(study, grace_s)
                finished = len(distinct_trials(study))
                running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if finished >= settings.n_trials:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    stop.reason = "timeout"
                    break
                if finished + len(running) >= settings.n_trials:
                    if not heartbeat:
                        # Their workers are alive (dead ones were recovered above): they finish the study.
                        owners = sorted({str(t.user_attrs.get(WORKER_ATTR, "?")) for t in running})
                        note = (f"the study's last {len(running)} trial(s) are running in other workers "
                                f"({', '.join(owners)}), which finish the study")
                        break
                    time.sleep(min(5.0, storage.get_heartbeat_interval()))
                    continue
                study.optimize(tracked, n_trials=1, callbacks=[after_trial, bar], catch=(Exception,))
            except Interrupted:
                break  # raised between trials; stop.reason says so
            except Exception as error:
                if disk_full(error):
                    raise OSError(errno.ENOSPC, f"no space left on the device while writing the study "
                                                f"({_first_line(error)})") from None
                raise
    if note:
        print(note)
    if stop.reason and stop.reason not in ("timeout", "interrupted"):
        print(f"stopped: {stop.reason}")
    return stop.reason


def study_summary(study: optuna.Study) -> str:
    """What the study evaluated, in the units `--n-trials` counts."""
    distinct = distinct_trials(study)
    warm = [t.number for t in distinct if t.user_attrs.get("warm_start")]
    plain = [t.number for t in distinct if "plain_decoding" in t.user_attrs]
    screened = sum("screened_out" in t.user_attrs for t in distinct)
    early = sum("stopped_early" in t.user_attrs for t in distinct)
    repeats = sum("repeat_of" in t.user_attrs for t in finished_trials(study))
    failed = len(study.get_trials(deepcopy=False, states=(TrialState.FAIL,)))
    parts = [f"{len(distinct)} distinct skip sets evaluated",
             f"warm starts: trials {', '.join(map(str, warm))}" if warm else "no warm starts",
             *[f"trial {n}, the empty set, is plain decoding: scored 1 by definition, not decoded" for n in plain],
             f"{screened} stopped by the pre-screen", f"{early} stopped early by the pruner",
             f"{repeats} repeated proposals answered from earlier trials without decoding"]
    if failed:
        parts.append(f"{failed} failed")
    return "; ".join(parts)


@contextlib.contextmanager
def _progress(study: optuna.Study, total: int, enabled: bool) -> Iterator[Callable[[optuna.Study, FrozenTrial], None]]:
    """A bar of the distinct skip sets evaluated (all workers), with the best trial so far."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=min(total, len(distinct_trials(study))), unit="set", disable=not enabled,
               dynamic_ncols=True, desc="skip sets")

    def callback(study: optuna.Study, trial: FrozenTrial) -> None:
        bar.n = min(total, len(distinct_trials(study)))
        # Plain decoding's own trial scores about 1 by construction: the bar shows the best set that skips something.
        best = next(iter(confirmation_candidates(study, 1)), None)
        if best is not None:
            bar.set_postfix_str(f"best skip set so far {_best_label(best)} (trial {best.number}, unconfirmed)",
                                refresh=False)
        bar.refresh()

    try:
        yield callback
    finally:
        bar.close()


def _best_label(trial: FrozenTrial) -> str:
    attrs = trial.user_attrs
    key = "predicted_speedup" if attrs.get("predicted_speedup") is not None else "speedup"
    if attrs.get(key) is None:
        return "screened out"
    acceptance = attrs.get("acceptance_rate")
    return f"{attrs[key]:.2f}x, acceptance {'-' if acceptance is None else format(acceptance, '.2f')}"


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _check_resumable(name: str, existing: dict[str, Any], wanted: dict[str, Any]) -> None:
    # Anything that changes what a trial measures: a resumed study must measure its new trials as it did the old.
    for key, label in (("model", "model"), ("objective", "--objective"), ("space", "search space"),
                       ("dataset", "--dataset"), ("num_prompts", "--num-prompts"), ("seed", "--seed (it picks the prompts)"),
                       ("max_new_tokens", "--max-new-tokens"), ("draft", "drafting settings"), ("dtype", "--dtype")):
        have, want = existing.get(key), wanted[key]
        if key == "model":
            have = {k: have[k] for k in ("architecture", "num_hidden_layers", "hidden_size")}
            want = {k: want[k] for k in ("architecture", "num_hidden_layers", "hidden_size")}
        if have != want:
            raise ValueError(
                f"study {name!r} was made with another {label} ({have}); use a new --study-name for {want}"
            )
