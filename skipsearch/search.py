"""The Optuna study: propose skip sets, score them by real self-speculative decoding, export the best.

Search space. Every sublayer that may be skipped gets one parameter u in [0, 1], and is
skipped when u < `skip_prior`. A sampler drawing u uniformly therefore skips about
`skip_prior` of the sublayers (15% by default) instead of half of them, which small and
mid-size models never accept. `skip_prior=0.5` is the plain 2L-switch space of Draft & Verify.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import socket
import signal
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from .config import ModelInfo
from .costs import CostProfile, profile_costs
from .storage import Heartbeat, make_storage
from .decoding import DecodeStats, DraftPolicy, generate
from .skipping import SkipSet, draft_mode

OBJECTIVES = ("speed_x_acceptance", "speedup", "pareto", "modeled")
SAMPLERS = ("tpe", "gp", "cmaes", "random", "nsga2")
STUDY_ATTR = "skipsearch"


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
class Baseline:
    """Plain greedy decoding of the calibration prompts, timed, in this process."""

    seconds: list[float]
    tokens: list[list[int]]
    measured_at: float = field(default_factory=time.monotonic)

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.tokens)) / sum(self.seconds)


@dataclass
class Evaluation:
    skip: SkipSet
    speedup: float
    acceptance_rate: float
    tokens_per_second: float
    baseline_tokens_per_second: float
    mean_accepted_tokens: float
    identical: bool
    skipped_fraction: float
    predicted_speedup: float | None = None  # from a cost profile, when the evaluator has one

    def score(self, objective: str) -> float | tuple[float, float]:
        if objective == "modeled":
            if self.predicted_speedup is None:
                raise ValueError("the modeled objective needs a cost profile")
            return self.predicted_speedup
        if objective == "speedup":
            return self.speedup
        if objective == "pareto":
            return self.speedup, self.acceptance_rate
        return self.speedup * self.acceptance_rate

    def user_attrs(self) -> dict[str, Any]:
        attrs = {k: v for k, v in asdict(self).items() if k != "skip"}
        attrs["skipped"] = self.skip.size
        return attrs


@dataclass
class Evaluator:
    """Runs real self-speculative decoding of calibration prompts and compares it with plain decoding."""

    model: torch.nn.Module
    prompts: list[list[int]]
    max_new_tokens: int
    policy: DraftPolicy
    eos_token_id: int | list[int] | None
    baseline_refresh_s: float = 600.0
    baseline: Baseline | None = None
    profile: CostProfile | None = None
    compile: bool = False

    def _decode(self, prompt: list[int], skip: SkipSet | None) -> tuple[list[int], DecodeStats]:
        out = generate(self.model, prompt, skip=skip, max_new_tokens=self.max_new_tokens, policy=self.policy,
                       eos_token_id=self.eos_token_id, compile=self.compile)
        return out.tokens, out.stats

    def measure_baseline(self) -> Baseline:
        self._decode(self.prompts[0], None)  # warm-up: first calls pay one-time allocation costs
        runs = [self._decode(p, None) for p in self.prompts]
        self.baseline = Baseline(seconds=[s.wall_time_s for _, s in runs], tokens=[t for t, _ in runs])
        return self.baseline

    def current_baseline(self) -> Baseline:
        """The baseline, re-measured when it is older than `baseline_refresh_s` (machines drift)."""
        if self.baseline is None or time.monotonic() - self.baseline.measured_at > self.baseline_refresh_s:
            return self.measure_baseline()
        return self.baseline

    @torch.inference_mode()
    def match_rate(self, skip: SkipSet) -> float:
        """Share of positions where the draft's argmax equals the full model's greedy token, teacher-forced:
        one parallel forward per prompt (SWIFT's "matchness")."""
        baseline = self.current_baseline()
        matched = total = 0
        with draft_mode(self.model, skip):
            for prompt, continuation in zip(self.prompts, baseline.tokens):
                ids = torch.tensor([prompt + continuation], device=self.model.device)
                guesses = self.model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
                matched += int((guesses == ids[0, len(prompt) :]).sum())
                total += len(continuation)
        return matched / total

    def evaluate(self, skip: SkipSet, report: Callable[[int, float], None] | None = None,
                 objective: str = "speed_x_acceptance") -> Evaluation:
        """Decode every prompt with `skip`; `report(step, running_score)` after each (it may raise to prune)."""
        baseline = self.current_baseline()
        total = DecodeStats()
        identical = True
        for step, prompt in enumerate(self.prompts):
            tokens, stats = self._decode(prompt, skip)
            identical &= tokens == baseline.tokens[step]
            total.add(stats)
            if report is not None:
                report(step, self._summary(skip, total, baseline, step + 1, identical).score(objective))
        return self._summary(skip, total, baseline, len(self.prompts), identical)

    def _summary(self, skip: SkipSet, total: DecodeStats, baseline: Baseline, n: int, identical: bool) -> Evaluation:
        num_layers = self.model.config.num_hidden_layers
        base_tps = sum(map(len, baseline.tokens[:n])) / sum(baseline.seconds[:n])
        # A draft with nothing skipped is the full model: all of it would be accepted.
        acceptance = total.acceptance_rate if skip.size else 1.0
        return Evaluation(
            skip=skip, speedup=total.tokens_per_second / base_tps, acceptance_rate=acceptance,
            tokens_per_second=total.tokens_per_second, baseline_tokens_per_second=base_tps,
            mean_accepted_tokens=total.mean_accepted_tokens, identical=identical,
            skipped_fraction=skip.skipped_fraction(num_layers),
            predicted_speedup=self.profile.predict_speedup(skip, total) if self.profile else None,
        )


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


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The best finished trial; for a Pareto study, the fastest trial on the front."""
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return None
    if len(study.directions) > 1:
        return max(study.best_trials, key=lambda t: t.user_attrs.get("speedup", 0.0))
    return study.best_trial


def finished_trials(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))


class SurplusTrial(Exception):
    """Raised at the start of a trial that would take the study past its trial budget."""


def make_objective(
    space: SearchSpace, evaluator: Evaluator, objective: str, min_match: float, n_trials: int | None = None
) -> Callable[[optuna.Trial], float | tuple[float, float]]:
    def run_trial(trial: optuna.Trial) -> float | tuple[float, float]:
        if n_trials is not None:
            # Two workers may start a trial at once when one is left; the lower number wins.
            ahead = trial.study.get_trials(
                deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING))
            if sum(t.number < trial.number for t in ahead) >= n_trials:
                trial.set_user_attr("fail_reason", f"not run: the study already had {n_trials} trials")
                raise SurplusTrial(f"the study already had {n_trials} finished or running trials")
        skip = space.suggest(trial)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        trial.set_user_attr("skip_attn", list(skip.attn))
        trial.set_user_attr("skip_mlp", list(skip.mlp))
        trial.set_user_attr("skipped", skip.size)
        trial.set_user_attr("skipped_fraction", skip.skipped_fraction(space.num_layers))
        try:
            if skip.size and min_match > 0:
                match = evaluator.match_rate(skip)
                trial.set_user_attr("match", match)
                if match < min_match:
                    raise optuna.TrialPruned(f"teacher-forced match {match:.2f} < {min_match}")

            def report(step: int, value: float) -> None:
                if objective == "pareto":
                    return  # Optuna prunes single-objective studies only
                trial.report(value, step)
                if trial.should_prune():
                    raise optuna.TrialPruned(f"pruned after {step + 1} prompts at {value:.3f}")

            evaluation = evaluator.evaluate(skip, report=report, objective=objective)
        except (optuna.TrialPruned, SurplusTrial):
            raise
        except Exception as error:
            # Optuna marks the trial failed and the study goes on; keep the reason on the trial.
            trial.set_user_attr("fail_reason", f"{type(error).__name__}: {error}")
            raise
        finally:
            _free_memory(evaluator.model)
        for key, value in evaluation.user_attrs().items():
            trial.set_user_attr(key, value)
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


@contextlib.contextmanager
def stop_after_trial_on_interrupt(stop: StopRequest) -> Iterator[None]:
    """First Ctrl-C: finish the running trial, then stop (the caller still exports). Second: stop now."""

    def on_sigint(signum: int, frame: Any) -> None:
        if stop.reason == "interrupted":
            raise KeyboardInterrupt
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
    n_trials: int = 20
    timeout: float | None = None
    min_match: float = 0.5
    dataset: str = "builtin"
    num_prompts: int = 4
    max_new_tokens: int = 32
    show_progress_bar: bool = True
    max_failures: int = 5
    warm_starts: bool = True
    pruning: bool = True
    heartbeat: Heartbeat | None = field(default_factory=Heartbeat)
    compile: bool = False  # torch.compile the draft and verify steps (reused by trials sharing a skip set)


def run_study(
    model: torch.nn.Module, model_info: ModelInfo, dtype: str, prompts: list[list[int]], settings: StudySettings,
    space: SearchSpace, policy: DraftPolicy, eos_token_id: int | list[int] | None,
    profile: CostProfile | None = None,
) -> optuna.Study:
    """Run (or resume) the study until it holds `settings.n_trials` finished trials, or until timeout / Ctrl-C."""
    multi = settings.objective == "pareto"
    prune = settings.pruning and not multi
    pruner = optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=1) if prune else optuna.pruners.NopPruner()
    storage = settings.storage
    if isinstance(storage, str):
        storage = make_storage(storage, settings.heartbeat)
    study = open_study(settings.study_name, storage, settings.objective,
                       sampler=make_sampler(settings.sampler, settings.seed, multi), pruner=pruner)
    info = {
        "model": asdict(model_info), "objective": settings.objective, "sampler": settings.sampler,
        "dataset": settings.dataset, "num_prompts": settings.num_prompts, "max_new_tokens": settings.max_new_tokens,
        "seed": settings.seed, "device": str(model.device), "dtype": dtype, "draft": asdict(policy),
        "space": asdict(space),
    }
    existing = study.user_attrs.get(STUDY_ATTR)
    if settings.objective == "modeled":
        # The study keeps its profile, so a resumed study scores with the same costs.
        if existing is not None and "cost_profile" in existing and profile is None:
            profile = CostProfile(**existing["cost_profile"])
        elif profile is None:
            profile = profile_costs(model)
        profile.check_model(model)
        info["cost_profile"] = asdict(profile)
    if existing is None:
        study.set_user_attr(STUDY_ATTR, info)
        for skip in space.warm_starts() if settings.warm_starts else ():
            study.enqueue_trial(space.params_for(skip), user_attrs={"warm_start": True}, skip_if_exists=True)
    else:
        _check_resumable(settings.study_name, existing, info)
    remaining = settings.n_trials - len(finished_trials(study))
    if remaining <= 0:
        return study
    evaluator = Evaluator(model=model, prompts=prompts, max_new_tokens=settings.max_new_tokens, policy=policy,
                          eos_token_id=eos_token_id, profile=profile, compile=settings.compile)
    evaluator.measure_baseline()
    objective = make_objective(space, evaluator, settings.objective, settings.min_match, settings.n_trials)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        _work(study, storage, objective, settings)
    return study


def _work(
    study: optuna.Study, storage: optuna.storages.BaseStorage, objective: Callable, settings: StudySettings
) -> None:
    """Run trials one at a time until the study, shared with any other workers, holds `n_trials` finished ones.

    Finished (complete or pruned) trials count; so do running ones, of this worker or another,
    so that the workers together do not overshoot. With heartbeats, a running trial whose worker
    died is failed after the grace period and re-enqueued, so a worker that only waits on running
    trials checks for stale ones instead of stopping. Failed trials do not count: they are retried,
    up to `max_failures` in a row.
    """
    heartbeat = isinstance(storage, optuna.storages.RDBStorage) and storage.get_heartbeat_interval() is not None
    stop = StopRequest()
    deadline = time.monotonic() + settings.timeout if settings.timeout else None
    failures_in_a_row = 0

    def after_trial(study: optuna.Study, trial: FrozenTrial) -> None:
        nonlocal failures_in_a_row
        if str(trial.user_attrs.get("fail_reason", "")).startswith("not run"):
            return  # a surplus trial, not a failure
        failures_in_a_row = failures_in_a_row + 1 if trial.state == TrialState.FAIL else 0
        if failures_in_a_row >= settings.max_failures:
            stop.reason = (f"{settings.max_failures} trials in a row failed, the last because "
                           f"{trial.user_attrs.get('fail_reason')}")

    with stop_after_trial_on_interrupt(stop), _progress(study, settings.n_trials, settings.show_progress_bar) as bar:
        while not stop.reason:
            if heartbeat:
                optuna.storages.fail_stale_trials(study)
            finished = len(finished_trials(study))
            running = len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
            if finished >= settings.n_trials:
                break
            if deadline is not None and time.monotonic() >= deadline:
                stop.reason = "timeout"
                break
            if finished + running >= settings.n_trials:
                if not heartbeat:
                    stop.reason = (f"{running} trial(s) still marked running by other workers; without heartbeats "
                                   "(journal storage) a killed worker's trial stays so")
                    break
                time.sleep(min(5.0, storage.get_heartbeat_interval()))
                continue
            study.optimize(objective, n_trials=1, callbacks=[after_trial, bar], catch=(Exception,))
    if stop.reason and stop.reason != "timeout":
        print(f"stopped: {stop.reason}")


@contextlib.contextmanager
def _progress(study: optuna.Study, total: int, enabled: bool) -> Iterator[Callable[[optuna.Study, FrozenTrial], None]]:
    """A bar of the study's finished trials (all workers), with the best score so far and elapsed time."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=len(finished_trials(study)), unit="trial", disable=not enabled, dynamic_ncols=True)

    def callback(study: optuna.Study, trial: FrozenTrial) -> None:
        bar.n = min(total, len(finished_trials(study)))
        best = best_trial(study)
        if best is not None:
            bar.set_postfix_str(f"best {_best_label(best)} (trial {best.number})", refresh=False)
        bar.refresh()

    try:
        yield callback
    finally:
        bar.close()


def _best_label(trial: FrozenTrial) -> str:
    attrs = trial.user_attrs
    speedup = attrs["predicted_speedup"] if attrs.get("predicted_speedup") is not None else attrs.get("speedup", float("nan"))
    return f"{speedup:.2f}x at acceptance {attrs.get('acceptance_rate', float('nan')):.2f}"


def _check_resumable(name: str, existing: dict[str, Any], wanted: dict[str, Any]) -> None:
    for key, label in (("model", "model"), ("objective", "--objective"), ("space", "search space")):
        have, want = existing.get(key), wanted[key]
        if key == "model":
            have = {k: have[k] for k in ("architecture", "num_hidden_layers", "hidden_size")}
            want = {k: want[k] for k in ("architecture", "num_hidden_layers", "hidden_size")}
        if have != want:
            raise ValueError(
                f"study {name!r} was made with another {label} ({have}); use a new --study-name for {want}"
            )
