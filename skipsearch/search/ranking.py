"""What each objective's values mean, and what "best" means: one number per measured skip set, the higher the better.

A single-objective study ranks skip sets by its objective's value. A Pareto study keeps a front of sets that trade
speed for acceptance and has no best of its own: it ranks them by speedup x acceptance, the default objective, so
that its confirmation, plots and progress bar show the sets a single-objective study would. Acceptance counts as 1
when nothing was drafted (plain decoding rejects nothing).

The confirmation's candidates are chosen by two orders taken in turn: by score, and by the score at the low end of
the speedup's 95% interval (`assured_score`). A trial's score rests on few paired runs; on a shared machine noise
lifts some sets' estimates far above what they give, with wide intervals, and those take every place a ranking by
score alone offers. The second order gives a place to the sets whose runs agree.

The verdict quotes the speedup its objective is about: predicted by the cost model for `modeled` studies, measured
otherwise; when it exports nothing it names the fastest confirmed set.
"""

from __future__ import annotations

import optuna

from .records import ConfirmedCandidate, Figures, Ratio, TrialRecord, decoded_trials, study_label
from .space import SearchSpace


def objective_value(figures: Figures, objective: str) -> float | tuple[float, float]:
    """The value a trial gives Optuna: one number, or (speedup, acceptance rate) for the Pareto objective."""
    if objective == "modeled":
        if figures.predicted_speedup is None:
            raise ValueError("the modeled objective needs a cost profile")
        return figures.predicted_speedup.estimate
    acceptance = 1.0 if figures.acceptance_rate is None else figures.acceptance_rate
    if objective == "speedup":
        return figures.speedup.estimate
    if objective == "pareto":
        return figures.speedup.estimate, acceptance
    return figures.speedup.estimate * acceptance


def screened_score(match: float, objective: str) -> float | tuple[float, float]:
    """The value a set stopped by the teacher-forced pre-screen gives the sampler, so that GP and TPE learn
    from it: an estimate below any set worth decoding, still rising with the match rate (acceptance
    follows match, and a set accepted this rarely runs at most at about half speed)."""
    if objective == "pareto":
        return 0.5 * match, match
    return 0.5 * match * match if objective == "speed_x_acceptance" else 0.5 * match


def score(figures: Figures, objective: str) -> float:
    """How good a skip set is: the objective's value, or for a Pareto study speedup x acceptance."""
    value = objective_value(figures, objective)
    return value[0] * value[1] if isinstance(value, tuple) else value


def assured_score(figures: Figures, objective: str) -> float:
    """`score` with the speedup at the low end of its 95% interval: what a set gives as surely as its paired runs
    show. The estimate's score where no low end was recorded (older studies) or none is measured."""
    speedup = quoted_speedup(figures, objective)
    if speedup is None or speedup.low is None or speedup.estimate <= 0:
        return score(figures, objective)
    return score(figures, objective) * speedup.low / speedup.estimate  # every objective's score is linear in speedup


def quoted_speedup(figures: Figures | None, objective: str) -> Ratio | None:
    """The speedup a verdict quotes (None where it was not measured): predicted for modeled studies, else measured."""
    if figures is None:
        return None
    return figures.predicted_speedup if objective == "modeled" else figures.speedup


def ranked(study: optuna.Study, dataset: str | None = None) -> list[TrialRecord]:
    """The distinct skip sets the study decoded that draft (skip something, or trim the head), best first. Plain decoding (known without
    decoding), pre-screen estimates (another scale) and repeated proposals are not ranked. With `dataset` (a study
    of several), by the figures of that dataset's prompts alone, among the sets that decoded some of them."""
    objective = study_label(study).objective
    skipping = [t for t in decoded_trials(study) if t.skip is not None and t.skip.drafts]
    if dataset is None:
        return sorted(skipping, key=lambda t: score(t.figures, objective), reverse=True)
    measured = [t for t in skipping if t.datasets and dataset in t.datasets]
    return sorted(measured, key=lambda t: score(t.datasets[dataset], objective), reverse=True)


def best_candidates(study: optuna.Study, top: int) -> list[TrialRecord]:
    """The `top` best sets, and in a study of several datasets each dataset's `top` best too, each set once: the ones
    worth measuring again before the export. The places go in turn to the next set by score (`ranked`) and by
    `assured_score`, so that a set measured precisely is confirmed beside sets that noise ranked above it. Two
    workers may decode one set at once (neither finds the other's trial finished); such a set counts once, as its
    lowest-numbered trial, so that it is neither confirmed twice nor takes two of the `top` places."""
    label = study_label(study)
    chosen: dict[tuple, TrialRecord] = {}
    for dataset in (None, *(label.datasets if len(label.datasets) > 1 else ())):
        by_score = _first_of_each_set(ranked(study, dataset))
        by_assurance = sorted(by_score, reverse=True, key=lambda t: assured_score(
            t.figures if dataset is None else t.datasets[dataset], label.objective))
        for trial in _in_turn(by_score, by_assurance)[:top]:
            chosen.setdefault(SearchSpace.key(trial.skip), trial)
    return list(chosen.values())


def _in_turn(first: list[TrialRecord], second: list[TrialRecord]) -> list[TrialRecord]:
    """The trials of two orders of the same trials taken in turn, `first` leading, each once."""
    taken: dict[int, TrialRecord] = {}
    for pair in zip(first, second):
        for trial in pair:
            taken.setdefault(trial.number, trial)
    return list(taken.values())


def _first_of_each_set(ranking: list[TrialRecord]) -> list[TrialRecord]:
    """`ranking` with each skip set (sublayers and head size) once: its lowest-numbered trial, in that trial's place."""
    first: dict[tuple, int] = {}
    for trial in sorted(ranking, key=lambda t: t.number):
        first.setdefault(SearchSpace.key(trial.skip), trial.number)
    return [t for t in ranking if first[SearchSpace.key(t.skip)] == t.number]


def best_confirmed(candidates: list[ConfirmedCandidate]) -> ConfirmedCandidate:
    """The best of skip sets measured again: the highest score (`score` of their confirmed figures)."""
    return max(candidates, key=lambda c: c.score)


def fastest_confirmed(candidates: list[ConfirmedCandidate], objective: str) -> ConfirmedCandidate:
    """The fastest of skip sets measured again, by the speedup a verdict quotes: the one it names when none pays."""
    return max(candidates, key=lambda c: quoted_speedup(c.figures, objective).estimate)

