"""From a study to a skip config: the confirmed choice, the verdict that says whether it pays, the JSON export.

A skip set is exported only when its confirmation (a re-measurement against plain decoding with
more paired runs, stored on the study by `search.confirm_candidates`) puts the lower bound of its
speedup's interval above 1.0. Otherwise the export is "skip nothing", quoting the best confirmed
figure. Every surface (verdict line, best.json, plots, notebook, bench) reads this one decision.

A study of several datasets also decides per dataset, from the confirmation's figures over that dataset's prompts;
when the datasets' confirmed sets differ, best.json carries each (version 2, labelled with its datasets) and
decoding chooses among them per prompt (choice.py). Otherwise the export is the decision over all prompts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import optuna
from optuna.trial import TrialState

from ..decode.config import SkipConfig, SkipEntry, save_skip_config
from ..decode.provenance import BestSkipping, ConfigMetrics, ConfigSearch
from ..decode.skipset import SkipSet
from ..io.files import write_atomic
from ..search.ranking import best_confirmed, fastest_confirmed, quoted_speedup, score
from ..search.records import (Confirmation, ConfirmedCandidate, Figures, Ratio, StudyLabel, TrialRecord,
                              read_confirmation, read_trials, study_label)
from ..search.warmstart import dv_json, dv_name

# The figures of a measurement that best.json's metrics carry (of Figures' flat names; not `identical` or `prompts`).
_METRIC_FIGURES = ("speedup", "speedup_low", "speedup_high", "paired_runs", "acceptance_rate", "tokens_per_second",
                   "baseline_tokens_per_second", "mean_accepted_tokens", "predicted_speedup", "predicted_speedup_low",
                   "predicted_speedup_high")


@dataclass(frozen=True)
class Decision:
    """What to export: `chosen` is the confirmed candidate (None: plain decoding); `best` the candidate with
    the highest confirmed speedup, quoted either way; `text` the verdict sentence."""

    chosen: ConfirmedCandidate | None
    best: ConfirmedCandidate | None
    text: str

    @property
    def pays(self) -> bool:
        return self.chosen is not None


def _figure(figures: Figures, label: StudyLabel) -> str:
    speedup = quoted_speedup(figures, label.objective)
    if label.objective == "modeled":
        device = f" for {label.predicted_for}" if label.predicted_for else ""
        basis = f"predicted{device} by the cost model from acceptance over {figures.prompts} prompts"
    elif figures.paired_runs < 2:
        return f"{speedup.estimate:.2f}x as fast as plain decoding (measured, one paired run: no interval)"
    else:
        basis = f"measured, {figures.paired_runs} paired runs"
    if speedup.low is None:  # a damaged record: no interval to quote
        return f"{speedup.estimate:.2f}x as fast as plain decoding (no interval recorded, {basis})"
    high = "unbounded" if speedup.high is None else format(speedup.high, ".2f")
    return f"{speedup.estimate:.2f}x as fast as plain decoding (95% interval {speedup.low:.2f}-{high}, {basis})"


def decide(study: optuna.Study, dataset: str | None = None) -> Decision:
    """Read the study's confirmation and decide: a skip set only when its interval lies above 1.0. With `dataset`
    (a study of several), by the confirmed figures over that dataset's prompts alone."""
    confirmation = read_confirmation(study)
    if confirmation is None:
        return Decision(None, None, "no skip set has been confirmed yet (the study stopped before its confirmation "
                                    "step confirmed one): run the same `optimize` command again to confirm; plain "
                                    "decoding is exported")
    decision = _decide_by(confirmation, study, dataset)
    if confirmation.complete:
        return decision
    stopped = f"the confirmation was stopped after {len(confirmation.candidates)} of {confirmation.wanted} skip sets"
    return replace(decision, text=f"{decision.text} ({stopped}: run the same `optimize` command again to confirm "
                                  "them all)")


def _decide_by(confirmation: Confirmation, study: optuna.Study, dataset: str | None) -> Decision:
    label = study_label(study)
    objective = label.objective

    def speedup(candidate: ConfirmedCandidate) -> Ratio | None:
        return quoted_speedup(candidate.figures, objective)

    candidates = [c for c in _measured_on(confirmation.candidates, dataset, objective) if speedup(c) is not None]
    if not candidates and confirmation.top == 0:
        return Decision(None, None, "confirmation was turned off (--confirm-top 0): plain decoding is exported")
    if not candidates:
        if not any(t.skip is not None and t.skip.drafts for t in read_trials(study)):
            return Decision(None, None, "no trial skipped anything (the search space allows no skipping, e.g. "
                                        "--max-skip-fraction 0, or it stopped first): plain decoding is exported")
        return Decision(None, None, "no skip set that drafts was decoded to be confirmed (the pre-screen stopped "
                                    "each, or its trial failed): plain decoding is exported")
    best = fastest_confirmed(candidates, objective)
    passing = [c for c in candidates if speedup(c).low is not None and speedup(c).low > 1.0]  # None: a damaged record
    if passing:
        chosen = best_confirmed(passing)
        return Decision(chosen, best, (
            f"skip set of trial {chosen.trial} ({chosen.skip}) decodes {_figure(chosen.figures, label)}; "
            f"acceptance {chosen.figures.acceptance_rate:.2f}, {chosen.skipped} sublayers skipped"))
    where = (" and device" if objective != "modeled" else f", as predicted for {label.predicted_for}"
             if label.predicted_for else ", as the cost model predicts")
    text = (f"no skip set was confirmed faster than plain decoding on this model{where}: the best, trial "
            f"{best.trial} ({best.skip}), decodes {_figure(best.figures, label)}")
    if speedup(best).estimate > 1.0 and objective != "modeled" and best.figures.paired_runs < 2:
        text += ", so it cannot be told apart from plain decoding: confirm with more prompts or --confirm-repeats"
    elif speedup(best).estimate > 1.0:
        text += "; that interval includes 1.0, so it cannot be told apart from plain decoding"
    return Decision(None, best, text + "; plain decoding is exported")


def _measured_on(candidates: tuple[ConfirmedCandidate, ...], dataset: str | None, objective: str
                 ) -> list[ConfirmedCandidate]:
    """The confirmed candidates as measured over `dataset`'s prompts (None: over all prompts)."""
    if dataset is None:
        return list(candidates)
    return [replace(c, figures=c.datasets[dataset], score=score(c.datasets[dataset], objective))
            for c in candidates if c.datasets and dataset in c.datasets]


def dataset_verdicts(study: optuna.Study) -> list[str]:
    """In a study of several datasets, each one's decision ("<dataset>: <verdict>"); none in a study of one."""
    datasets = study_label(study).datasets
    return [f"{d}: {decide(study, d).text}" for d in datasets] if len(datasets) > 1 else []


def verdict(study: optuna.Study) -> tuple[bool, str]:
    """(whether best.json drafts, the sentence that says what it holds: the decision over all prompts with its
    interval, or in a study of several datasets whose confirmed sets differ, which set each dataset gets)."""
    choices = dataset_choices(study)
    if not choices:
        decision = decide(study)
        return decision.pays, decision.text
    sets = "; ".join(f"trial {d.chosen.trial} ({d.chosen.skip}) for {datasets}" for datasets, d in choices)
    return True, (f"one skip set per dataset is exported, chosen per prompt at decoding: {sets}, each confirmed "
                  "faster than plain decoding on its dataset's prompts (each dataset's verdict follows)")


def dataset_choices(study: optuna.Study) -> list[tuple[str, Decision]]:
    """In a study of several datasets whose confirmed sets differ: each distinct set's decision (of the first dataset
    it won) with the datasets it won, joined by ", "; a dataset on which no set pays is left to plain decoding,
    which decoding always weighs. Empty when best.json holds the decision over all prompts."""
    datasets = study_label(study).datasets
    won: dict[SkipSet, list[tuple[str, Decision]]] = {}
    for dataset in datasets if len(datasets) > 1 else ():
        decision = decide(study, dataset)
        if decision.chosen is not None:
            won.setdefault(decision.chosen.skip, []).append((dataset, decision))
    if len(won) < 2:
        return []
    return [(", ".join(d for d, _ in wins), replace(wins[0][1], text="; ".join(f"{d}: {w.text}" for d, w in wins)))
            for wins in won.values()]


def config_from_trial(study: optuna.Study, trial: TrialRecord) -> SkipConfig:
    """The skip config of one finished trial with the trial's own (unconfirmed) metrics."""
    label = study_label(study)
    if trial.state != TrialState.COMPLETE:
        raise ValueError(f"trial {trial.number} of study {study.study_name!r} is {trial.state.name}, not COMPLETE")
    if trial.skip is None:
        raise ValueError(f"trial {trial.number} of study {study.study_name!r} has no skip set")
    confirmation = read_confirmation(study)
    confirmed = confirmation.of_trial(trial.number) if confirmation is not None else None
    if confirmed is not None:  # the confirmation's figures are the better-measured ones
        metrics = _metrics(label.objective, confirmed.score, confirmed.figures, confirmed=True,
                           verdict=f"trial {trial.number} exported on request; its confirmation measured "
                                   f"{_figure(confirmed.figures, label)}")
    elif trial.screened_out is not None:  # its value is the pre-screen's estimate, on another scale than a score
        metrics = _metrics(label.objective, None, Figures(), confirmed=False,
                           verdict=f"trial {trial.number} exported on request: the pre-screen stopped it "
                                   f"({trial.screened_out}), so nothing was decoded and it has no measured score")
    else:
        metrics = _metrics(label.objective, trial.values[0] if len(trial.values) == 1 else None,
                           trial.figures or Figures(), confirmed=False,
                           verdict=f"trial {trial.number} exported on request: its figures come from the search, "
                                   "unconfirmed")
    return _config(study, label, trial.skip, metrics, trial.number)


def _metrics(objective: str | None, score: float | None, figures: Figures, **rest) -> ConfigMetrics:
    """best.json's metrics of a skip set: `figures` as the confirmation or the search measured them."""
    flat = figures.as_dict()
    return ConfigMetrics(objective=objective, score=score, **{name: flat[name] for name in _METRIC_FIGURES}, **rest)


def _config(study: optuna.Study, label: StudyLabel, skip: SkipSet, metrics: ConfigMetrics,
            trial_number: int | None) -> SkipConfig:
    skip.check_fits(label.model.num_hidden_layers)
    return SkipConfig(model=label.model, skip=skip, draft=label.draft, metrics=metrics,
                      search=_search_settings(study, label, trial_number))


def decided_config(study: optuna.Study) -> SkipConfig:
    """The config the study's decision exports: the confirmed skip set, or plain decoding; in a study of several
    datasets whose confirmed sets differ, each of them (`dataset_choices`)."""
    label = study_label(study)
    choices = dataset_choices(study)
    if choices:
        entries = [SkipEntry(d.chosen.skip, datasets, _metrics(label.objective, d.chosen.score, d.chosen.figures,
                                                               confirmed=True, trial=d.chosen.trial, verdict=d.text))
                   for datasets, d in choices]
        return SkipConfig.of_entries(label.model, entries, label.draft, _search_settings(study, label, None))
    decision = decide(study)
    if decision.chosen is not None:
        chosen = decision.chosen
        metrics = _metrics(label.objective, chosen.score, chosen.figures, confirmed=True, verdict=decision.text)
        return _config(study, label, chosen.skip, metrics, chosen.trial)
    best = decision.best
    baseline = best.figures.baseline_tokens_per_second if best else None
    metrics = ConfigMetrics(objective=label.objective, score=1.0, speedup=1.0, tokens_per_second=baseline,
                            baseline_tokens_per_second=baseline, confirmed=best is not None, verdict=decision.text,
                            best_skipping=None if best is None else BestSkipping(
                                best.trial, best.skip.attn, best.skip.mlp, best.skip.head_rows,
                                _metrics(None, None, best.figures)))
    return _config(study, label, SkipSet(), metrics, None)


def _confirmed_a_set(config: SkipConfig) -> bool:
    """Whether a category's study exported a skip set (a trimmed head alone drafts too), not plain decoding."""
    return config.skip.drafts and not config.others


def categories_confirmed(configs: dict[str, SkipConfig]) -> str:
    """Which categories' studies confirmed a skip set, and which did not, for the line that names the combined file."""
    won = [category for category, config in configs.items() if _confirmed_a_set(config)]
    lost = [category for category in configs if category not in won]
    return f"a skip set confirmed for {_listed(won) or 'no category'}" + (f"; none for {_listed(lost)}"
                                                                         if won and lost else "")


def _listed(names: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return " and ".join(filter(None, [", ".join(names[:-1]), *names[-1:]]))


def category_config(configs: dict[str, SkipConfig], study_name: str) -> SkipConfig:
    """One config of each category's exported skip set (one study per category), labelled with the categories it
    won (joined by ", ") and carrying its study's figures; a category whose study exported plain decoding is left
    out, since decoding always weighs plain decoding. None won: plain decoding, each category's verdict quoted."""
    won: dict[SkipSet, list[tuple[str, SkipConfig]]] = {}
    for category, config in configs.items():
        if _confirmed_a_set(config):
            won.setdefault(config.skip, []).append((category, config))
    first = next(iter(configs.values()))
    counts = [config.search.num_prompts for config in configs.values()]
    seen = sorted({digest for config in configs.values() for digest in config.search.seen_prompts or ()})
    search = replace(first.search, study_name=study_name, trial_number=None, categories=list(configs),
                     seen_prompts=seen or None,
                     num_prompts=None if None in counts else sum(counts),
                     category_studies={c: config.search.study_name for c, config in configs.items()},
                     created_at=datetime.now(timezone.utc).isoformat())
    verdicts = "; ".join(f"{c}: {config.metrics.verdict}" for c, config in configs.items())
    if not won:
        metrics = ConfigMetrics(objective=first.metrics.objective, score=1.0, speedup=1.0,
                                confirmed=all(config.metrics.confirmed for config in configs.values()),
                                verdict=f"no category's skip set was confirmed faster than plain decoding ({verdicts});"
                                        " plain decoding is exported")
        return SkipConfig(model=first.model, skip=SkipSet(), draft=first.draft, metrics=metrics, search=search)
    entries = [SkipEntry(skip, ", ".join(c for c, _ in wins), replace(
        wins[0][1].metrics, verdict="; ".join(f"{c}: {w.metrics.verdict}" for c, w in wins)))
        for skip, wins in won.items()]
    return SkipConfig.of_entries(first.model, entries, first.draft, search)


def _search_settings(study: optuna.Study, label: StudyLabel, trial_number: int | None) -> ConfigSearch:
    confirmation = read_confirmation(study)
    return ConfigSearch(
        study_name=study.study_name, trial_number=trial_number, sampler=label.sampler, dataset=label.dataset,
        num_prompts=label.num_prompts, max_new_tokens=label.max_new_tokens, device=label.device,
        device_name=label.device_name, dtype=label.dtype, predicted_for=label.predicted_for,
        seen_prompts=label.seen_prompts,
        confirm_repeats=None if confirmation is None else confirmation.repeats,
        created_at=datetime.now(timezone.utc).isoformat(),
    )


def export_trial(study: optuna.Study, path: Path, trial_number: int | None = None,
                 write: Callable[[SkipConfig, Path], None] = save_skip_config) -> SkipConfig:
    """Write the study's decided config (`trial_number` None), or that trial's; `write` writes it (the skip-config
    JSON by default, `write_dv` for the Draft & Verify / SWIFT format)."""
    if trial_number is None:
        config = decided_config(study)
    else:
        trials = read_trials(study)
        if not 0 <= trial_number < len(trials):
            raise ValueError(f"study {study.study_name!r} has no trial {trial_number} (it has {len(trials)})")
        config = config_from_trial(study, trials[trial_number])
    write(config, path)
    return config


def write_dv(config: SkipConfig, path: Path) -> None:
    """Write `config`'s skip set in the Draft & Verify / SWIFT format, named after its model."""
    if config.others:
        raise ValueError(f"the decision carries {len(config.entries)} skip sets, one per dataset, and the Draft & "
                         "Verify format holds one: export one of them with --trial N")
    if config.skip.head is not None:
        raise ValueError(f"the skip set drafts with a trimmed head of {config.skip.head.rows} rows, which the Draft & "
                         "Verify format cannot hold: export it in skipsearch's format")
    write_atomic(path, json.dumps(dv_json(dv_name(config.model), config.skip), indent=2) + "\n")


def exported_text(config: SkipConfig) -> str:
    """What an exported config skips, for the line that names its file."""
    if config.others:
        sets = "; ".join(f"{entry.label}: {entry.skip}" for entry in config.entries)
        return f"{len(config.entries)} skip sets, one chosen per prompt at decoding ({sets})"
    return f"skip {config.skip if config.skip.drafts else 'nothing (plain decoding)'}"

