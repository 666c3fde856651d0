"""The Optuna study: propose skip sets, score them by real self-speculative decoding, confirm the best.

`run_study` opens (or resumes) a study, labels it with what it measures and queues the warm starts; a
`TrialRunner` is Optuna's objective, one skip set per trial; worker.py runs the trials until a stopping rule
calls `study.stop()`; `confirm_candidates` measures the best sets again, for export.py to decide by.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from ..constants import OBJECTIVES, SAMPLERS  # kept there so the CLI reads them without importing optuna
from ..costs.profiler import contexts_for, device_name, profile_costs, study_compile_mode
from ..decode.config import ModelInfo
from ..decode.cost_profile import CostProfile
from ..decode.policy import DraftPolicy
from ..decode.skipset import SkipSet
from ..io.errors import ResourceExhausted, exhausted_resource, resource_error
from . import records
from .evaluation import Evaluation, Evaluator
from .heads import ranked_space
from .ranking import best_candidates, score, screened_score
from .records import (Confirmation, ConfirmedCandidate, StudyLabel, TrialRecord, distinct_trials,
                      read_confirmation, read_label)
from .settings import StudySettings, check_measurable, check_resumable, profile_words
from .space import SearchSpace
from .storage import make_storage, shared_storage, storage_place, worker_tag
from .worker import Interrupted, StopRequest, SurplusTrial, TrialLost, ends_the_study, stop_on_signals, work

Value = float | tuple[float, float]  # a trial's value: one objective, or (speedup, acceptance rate) for pareto
PLAIN_DECODING = ("skips nothing: plain decoding, whose speedup is 1 and acceptance counts as 1 by definition; "
                  "not decoded")


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


def sampler_seed(seed: int, storage: str | optuna.storages.BaseStorage) -> int:
    """The seed of this process's sampler: `seed` itself where one process runs the study (reproducible from it);
    with a shared storage mixed with the worker's host:pid, since workers running the same command with one seed
    would propose the same sets (identical TPE startup draws, every draw of the random sampler)."""
    if not shared_storage(storage):
        return seed
    return seed ^ zlib.crc32(worker_tag().encode())


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


@dataclass
class TrialRunner:
    """Optuna's objective: each trial evaluates the skip set its parameters propose.

    A set the study already evaluated is answered from its first trial, without decoding; the empty set is plain
    decoding, whose value is known; a set below the pre-screen's `min_match` gets an estimate; any other set is
    decoded paired with plain decoding, and the pruner may stop it early.
    """

    space: SearchSpace
    evaluator: Evaluator
    objective: str
    min_match: float
    n_trials: int | None = None  # the budget a trial checks when it starts (workers race for the last trials)
    # Optuna logs a failed trial's exception and keeps it to itself: the stopping rules read it here.
    last_error: Exception | None = field(default=None, repr=False)
    trial: optuna.Trial | None = field(default=None, repr=False)  # the trial run last
    told: int | None = field(default=None, repr=False)  # the last trial whose result Optuna stored (`was_told`)

    def __call__(self, trial: optuna.Trial) -> Value:
        self.last_error, self.trial = None, trial
        try:
            value = self._run(trial)
        except Exception as error:
            self.last_error = error
            _keep_reason(trial, error)
            if ends_the_study(error):
                # Optuna would log the trial's traceback as a warning; the study ends on this error, in one line.
                optuna.logging.set_verbosity(optuna.logging.ERROR)
            raise
        finally:
            lost = _finished_elsewhere(trial)
            if lost is not None:  # said in one line by worker.py, without Optuna's traceback
                optuna.logging.set_verbosity(optuna.logging.ERROR)
        if lost is not None:
            raise TrialLost(lost)  # a value returned for a finished trial trips an assertion in Optuna's tell
        return value

    def was_told(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """The first callback: Optuna stored `trial`'s result (callbacks run only after it did)."""
        self.told = trial.number

    def take_lost_trial(self) -> str | None:
        """Why Optuna could not store the result of the trial run last, where another worker had ended it; None
        where the trial was stored, or is not finished (then whatever Optuna raised is an error of its own). Said
        once: a later error is never taken for the same lost trial."""
        trial, self.trial = self.trial, None
        if trial is None or self.told == trial.number:
            return None
        return _finished_elsewhere(trial)

    def _run(self, trial: optuna.Trial) -> Value:
        skip = self.space.suggest(trial)
        # Journal recovery reads the worker; set once the trial's point is whole, so a retry re-runs the same point.
        records.write(trial, TrialRecord(worker=worker_tag(), skip=skip))
        first = _first_trial_of(trial.study, skip)
        if first is not None:
            return self._repeat(trial, first)
        self._claim_budget(trial)
        records.write(trial, TrialRecord(skipped=skip.size, skipped_fraction=skip.skipped_fraction(self.space.num_layers)))
        if not skip.drafts:
            return self._plain_decoding(trial)
        return self._measure(trial, skip)

    def _repeat(self, trial: optuna.Trial, first: TrialRecord) -> Value:
        """Decoding the same set again would only add noise: the sampler gets the value it already had."""
        records.write(trial, replace(first.measurement(), repeat_of=first.number))
        return first.values if len(first.values) > 1 else first.values[0]

    def _claim_budget(self, trial: optuna.Trial) -> None:
        """Two workers may start a trial at once when one is left; the lower number wins."""
        if self.n_trials is None:
            return
        ahead = [t for t in trial.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                 if t.number < trial.number]
        if len(distinct_trials(trial.study)) + len(ahead) >= self.n_trials:
            records.write(trial, TrialRecord(fail_reason=records.surplus_reason(self.n_trials)))
            raise SurplusTrial(f"the study already had {self.n_trials} finished or running trials")

    def _plain_decoding(self, trial: optuna.Trial) -> Value:
        evaluation = self.evaluator.plain_decoding(report=self._reporter(trial))
        records.write(trial, replace(_record_of(evaluation), plain_decoding=PLAIN_DECODING))
        return evaluation.score(self.objective)

    def _measure(self, trial: optuna.Trial, skip: SkipSet) -> Value:
        """Pre-screen `skip`, then decode it paired with plain decoding."""
        try:
            if self.min_match > 0:
                match = self.evaluator.match_rate(skip)
                records.write(trial, TrialRecord(match=match))
                if match < self.min_match:
                    records.write(trial, TrialRecord(screened_out=f"teacher-forced match {match:.2f} < {self.min_match}"))
                    return screened_score(match, self.objective)
            evaluation = self.evaluator.evaluate(skip, report=self._reporter(trial), objective=self.objective)
        finally:
            _free_memory(self.evaluator.model)
        stopped_early = None
        if evaluation.prompts < len(self.evaluator.prompts):
            # Optuna's advice for the Wilcoxon pruner: return the estimate so far instead of raising TrialPruned,
            # so that the sampler learns from the trial.
            stopped_early = f"worse than the best trial after {evaluation.prompts} prompts"
        records.write(trial, replace(_record_of(evaluation), stopped_early=stopped_early))
        return evaluation.score(self.objective)

    def _reporter(self, trial: optuna.Trial) -> Callable[[int, float], bool]:
        """What the evaluator calls after each prompt with that prompt's value: whether to stop (the pruner's call)."""

        def report(step: int, value: float) -> bool:
            if self.objective == "pareto":
                return False  # Optuna prunes single-objective studies only
            trial.report(value, step)  # the step is the prompt's index: the pruner pairs prompts across trials
            return trial.should_prune()

        return report


def _keep_reason(trial: optuna.Trial, error: Exception) -> None:
    """Optuna marks a trial failed by any error and the study goes on: the reason is kept on the trial, wherever in the
    trial the error came (a second Ctrl-C came in the memory's release after the decoding too, CI of 2026-11-28).
    A surplus trial has its own reason; a trial another worker ended can take none."""
    if isinstance(error, SurplusTrial):
        return
    with contextlib.suppress(Exception):
        records.write(trial, TrialRecord(fail_reason=f"{type(error).__name__}: {error}"))


def _finished_elsewhere(trial: optuna.Trial) -> str | None:
    """Why `trial` is no longer running before this worker told its result, if it is not. Another worker ended it:
    failed it as stale (a late heartbeat, from a paused or starved process; Optuna queues a retry), failed it as
    its journal's dead worker's (a retry is queued too), or took it too and finished it first."""
    try:
        stored = trial.study._storage.get_trial(trial._trial_id)
        ranking = records.read_vocabulary(trial.study) if stored.state.is_finished() else None
    except Interrupted:
        raise
    except Exception:  # a storage that cannot be read now: the trial's own error (if any) must be the one raised
        return None
    if not stored.state.is_finished():
        return None
    reason = TrialRecord.of(stored, ranking).fail_reason or "no reason given"
    return (f"trial {trial.number} was ended by another worker while this one ran it ({stored.state.name}: "
            f"{reason}); its result is dropped and the study goes on")


def _first_trial_of(study: optuna.Study, skip: SkipSet) -> TrialRecord | None:
    """The completed trial that first evaluated `skip`, if any."""
    first = next((t for t in distinct_trials(study) if t.skip == skip), None)
    return first if first is not None and first.state == TrialState.COMPLETE else None


def _record_of(evaluation: Evaluation) -> TrialRecord:
    return TrialRecord(skipped=evaluation.skip.size, skipped_fraction=evaluation.skipped_fraction,
                       figures=evaluation.figures(), datasets=evaluation.dataset_figures())


def _free_memory(model: torch.nn.Module) -> None:
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def run_study(
    model: torch.nn.Module, model_info: ModelInfo, dtype: str, prompts: list[list[int]], settings: StudySettings,
    space: SearchSpace, policy: DraftPolicy, eos_token_id: int | list[int] | None,
    profile: CostProfile | None = None, clock: Callable[[], float] = time.perf_counter,
    stop: StopRequest | None = None,
    prompt_datasets: list[str] | None = None,
    special_token_ids: Sequence[int] = (),
    ranking_prompts: Sequence[Sequence[int]] = (),
    seen_prompts: Sequence[str] = (),
) -> optuna.Study:
    """Run (or resume) the study until it has evaluated `settings.n_trials` distinct skip sets (or until
    timeout, a stop signal or an exhausted space), then confirm its best candidates (see `confirm_candidates`).
    `prompt_datasets`: the dataset of each prompt, in a study of several (`settings.dataset` their list).
    `special_token_ids`: what a trimmed head always holds (the tokenizer's special tokens, EOS first);
    `ranking_prompts`: what the vocabulary is ranked on for trimmed heads (none: the calibration prompts);
    `seen_prompts`: the digests of both sets' rows, which the label keeps so that `bench` can hold them out.

    Ctrl-C or SIGTERM finishes the running trial or confirmation, then returns; a second one abandons it (worker.py's
    `stop_on_signals`). Either way the study keeps what finished for the export. Pass `stop` to learn whether a
    signal stopped the run (its `signal_name`) and what that left (`outcome`)."""
    check_measurable(settings.max_new_tokens, policy.max_draft_tokens)
    study, storage = _open(settings)
    compiled = settings.compile if settings.compile is not None else model.device.type == "cuda"
    label = StudyLabel(
        model=model_info, objective=settings.objective, sampler=settings.sampler, dataset=settings.dataset,
        num_prompts=settings.num_prompts, max_new_tokens=settings.max_new_tokens, seed=settings.seed,
        device=str(model.device), device_name=device_name(model.device), dtype=dtype, draft=policy, space=space,
        compile=compiled, seen_prompts=list(seen_prompts) or None)
    existing = read_label(study)
    if existing is None:
        # Labelled at once, before any slow work: a worker started beside this one checks its settings against it.
        records.write_label(study, label)
    if settings.objective == "modeled":
        profile = _study_profile(study, model, prompts, settings, existing, profile)
        profile.check_model(model)
        label = replace(label, cost_profile=profile)
    if existing is not None:
        check_resumable(settings.study_name, existing, label)
        if existing.seen_prompts is None and label.seen_prompts:  # an older release's study: the same prompts, named
            records.write_label(study, replace(existing, seen_prompts=label.seen_prompts))
    if label.cost_profile is not None and (existing is None or existing.cost_profile is None):
        records.write_label(study, label)  # now with the cost profile
    evaluator = Evaluator(model=model, prompts=prompts, max_new_tokens=settings.max_new_tokens, policy=policy,
                          eos_token_id=eos_token_id, profile=profile, repeats=settings.repeats,
                          timed=settings.objective != "modeled", clock=clock, show_progress=settings.show_progress_bar,
                          compile=compiled,
                          datasets=prompt_datasets)
    # A study with no trials yet is new even if labelled: a first run can stop after its label (the profiler refused a
    # noisy machine, Ctrl-C) and before queueing its warm starts, which its re-run must queue then.
    _enqueue_first_trials(study, settings, space, new=not study.get_trials(deepcopy=False))
    stop = stop if stop is not None else StopRequest()
    space = ranked_space(study, space, evaluator, special_token_ids, ranking_prompts, stop)
    if stop.interrupts:
        stop.outcome = ("before the first trial, while ranking the vocabulary: the export keeps the last confirmation, "
                        "if any, else plain decoding")
        return study
    _search(study, storage, evaluator, settings, space, stop)
    return study


def _study_profile(study: optuna.Study, model: torch.nn.Module, prompts: list[list[int]], settings: StudySettings,
                   existing: StudyLabel | None, given: CostProfile | None) -> CostProfile:
    """A modeled study's cost profile: the one it keeps (a resumed study scores with the same costs, so another one
    given is refused), else the one given, else this device's, measured, unless a worker started beside this one
    stored its own meanwhile: then that one, so that every trial of the study is priced alike."""
    stored = existing.cost_profile if existing is not None else None
    if stored is not None:
        if given is not None and given != stored:
            raise ValueError(f"study {settings.study_name!r} was made with another --cost-profile "
                             f"({profile_words(stored)}); use a new --study-name for {profile_words(given)}")
        return stored
    if given is not None:
        return given
    measured = profile_costs(model, contexts=contexts_for(model, prompts, settings.max_new_tokens),
                             show_progress=settings.show_progress_bar, compile_mode=study_compile_mode(model.device))
    now = read_label(study)
    return now.cost_profile if now is not None and now.cost_profile is not None else measured


def _open(settings: StudySettings) -> tuple[optuna.Study, optuna.storages.BaseStorage]:
    """The study and its storage, with the settings' sampler and pruner."""
    multi = settings.objective == "pareto"
    # Paired per-prompt comparisons with the best trial: drift moves both sides of a pair alike.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        pruner = (optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=2) if settings.pruning and not multi
                  else optuna.pruners.NopPruner())
    storage = settings.storage
    if isinstance(storage, str):
        storage = make_storage(storage, settings.heartbeat)
    study = open_study(settings.study_name, storage, settings.objective,
                       sampler=make_sampler(settings.sampler, sampler_seed(settings.seed, storage), multi),
                       pruner=pruner)
    return study, storage


def _enqueue_first_trials(study: optuna.Study, settings: StudySettings, space: SearchSpace, new: bool) -> None:
    """Files and published sets first (also on resume), then, in a study without trials, the structured warm starts;
    only as many as the budget, since a queued warm start is a trial too."""
    for name, skip in settings.first_trials:
        records.enqueue(study, space.params_for(skip), TrialRecord(warm_start=name), skip_if_exists=True)
    if new and settings.warm_starts:
        for params in space.warm_start_params()[: max(0, settings.n_trials - len(settings.first_trials))]:
            records.enqueue(study, params, TrialRecord(warm_start=True), skip_if_exists=True)


def _search(study: optuna.Study, storage: optuna.storages.BaseStorage, evaluator: Evaluator,
            settings: StudySettings, space: SearchSpace, stop: StopRequest) -> None:
    """The trials this worker still owes the study, then the confirmation (unless a stop signal stopped the trials).
    The stop signals are handled throughout, so that what finished is kept whenever one comes."""
    with stop_on_signals(stop):
        try:
            if len(distinct_trials(study)) < settings.n_trials:
                # The first forwards, before any trial: a model whose logits are not finite ends the study here
                # (loop.py's `check_finite`) instead of in one failed trial after another.
                evaluator.reference_tokens()
                runner = TrialRunner(space, evaluator, settings.objective, settings.min_match, settings.n_trials)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    work(study, storage, runner, settings, space, stop)
            if stop.interrupts:
                stop.outcome = "during the trials, before the confirmation: the export keeps the last one, if any"
                print(f"not confirming after {stop.signal_name}: the export keeps the last confirmation, if any")
            elif _confirmation_is_stale(study, settings.confirm_top, _confirm_repeats(settings, evaluator),
                                        len(evaluator.prompts)):
                stop.running = "skip set being confirmed"
                confirmation = confirm_candidates(study, evaluator, settings.objective, settings.confirm_top,
                                                  settings.confirm_repeats, settings.show_progress_bar, stop)
                if stop.interrupts:
                    stop.outcome = (f"during the confirmation, after {len(confirmation.candidates)} of "
                                    f"{confirmation.wanted} skip sets were confirmed")
        except Interrupted:  # a second signal between the steps: nothing was running to abandon
            pass
        except Exception as error:
            exhausted = _out_of_resource(error, settings, evaluator)
            if exhausted is None:
                raise
            raise exhausted from None
    if stop.interrupts and not stop.outcome:  # between the steps, or after the last
        stop.outcome = "as the study finished: the export keeps what it had"


def _out_of_resource(error: Exception, settings: StudySettings, evaluator: Evaluator) -> ResourceExhausted | None:
    """`error` as the one line that ends a study which ran out of disk space, a file-size limit or memory (None for
    other errors): what ran out, where (the study's file, or the device), and that the finished trials are kept."""
    found = exhausted_resource(error)
    if found is None:
        return None
    memory = found[0] == "memory"
    doing = f"decoding on {evaluator.model.device}" if memory else f"writing {storage_place(settings.storage)}"
    return resource_error(error, doing, "the trials that finished are kept: free some and run the same command again")


def _confirmation_is_stale(study: optuna.Study, top: int, repeats: int, prompts: int) -> bool:
    """Whether the stored confirmation is not this run's: other candidates, or measured with other repeats or prompts
    (a re-run with more --confirm-repeats, as a verdict whose interval includes 1.0 advises, must measure again)."""
    confirmation = read_confirmation(study)
    wanted = [t.number for t in best_candidates(study, top)]
    return (confirmation is None or not confirmation.complete or [c.trial for c in confirmation.candidates] != wanted
            or confirmation.repeats != repeats or confirmation.prompts != prompts)


def _confirm_repeats(settings: StudySettings, evaluator: Evaluator) -> int:
    """The paired runs per prompt a confirmation stores: one where nothing is timed (a modeled study's is exact)."""
    return settings.confirm_repeats if evaluator.timed else 1


def confirm_candidates(study: optuna.Study, evaluator: Evaluator, objective: str, top: int, repeats: int,
                       show_progress: bool = True, stop: StopRequest | None = None) -> Confirmation:
    """Re-measure the best distinct candidates against plain decoding with more paired runs, and store the
    figures on the study: the export reads them, so the verdict, best.json, the plots and the notebook
    all quote the same confirmed numbers.

    With `stop` (handled by `stop_on_signals`), a first stop signal ends the confirmation after the candidate being
    measured and a second abandons that one: the candidates confirmed by then are stored, marked incomplete, and the
    export decides by them. With none confirmed nothing is stored: the export keeps the last confirmation, if any."""
    from tqdm.auto import tqdm

    candidates, confirmed, distinct = best_candidates(study, top), [], len(distinct_trials(study))
    try:
        for trial in tqdm(candidates, desc="confirming the best skip sets", unit="set", disable=not show_progress,
                          dynamic_ncols=True):
            if stop is not None and stop.interrupts:
                break
            confirmed.append(_confirm(trial, evaluator, objective, repeats))
    except Interrupted:
        pass  # the candidate being measured is abandoned; those before it stand
    confirmation = Confirmation(tuple(confirmed), top=top, repeats=repeats if evaluator.timed else 1,
                                prompts=len(evaluator.prompts), distinct_trials=distinct, wanted=len(candidates))
    if confirmed or confirmation.complete:
        records.write_confirmation(study, confirmation)
    return confirmation


def _confirm(trial: TrialRecord, evaluator: Evaluator, objective: str, repeats: int) -> ConfirmedCandidate:
    evaluation = evaluator.evaluate(trial.skip, objective=objective, repeats=repeats)
    figures = evaluation.figures()
    return ConfirmedCandidate(trial=trial.number, skip=trial.skip, score=score(figures, objective),
                              skipped=trial.skip.size, skipped_fraction=evaluation.skipped_fraction, figures=figures,
                              datasets=evaluation.dataset_figures())
