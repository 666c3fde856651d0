"""What a study keeps, as typed records: each trial's skip set and figures, the study's label, the confirmation.

Optuna stores them as user attributes (JSON values under string keys). This module is the one conversion between
the two, so the stored names, and what studies written by earlier releases hold, live here alone; the rest of
skipsearch reads and writes the records. (storage.py's crash recovery also reads and writes three trial
attributes, whose names it owns.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, get_type_hints

import optuna
from optuna.trial import FrozenTrial, TrialState

from ..decode.config import ModelInfo
from ..decode.cost_profile import CostProfile
from ..decode.policy import DraftPolicy
from ..decode.skipset import SkipSet
from ..io.files import json_matches
from .measure import Interval
from .space import SearchSpace
from .vocabulary import VocabularyRanking
from .storage import FAIL_REASON_ATTR, RETRY_ATTR, WORKER_ATTR

STUDY_ATTR = "skipsearch"
CONFIRM_ATTR = "skipsearch_confirmation"
VOCABULARY_ATTR = "skipsearch_vocabulary"  # the study's vocabulary ranking, which trimmed heads take their rows from


@dataclass(frozen=True)
class Ratio:
    """A speedup over plain decoding as a study keeps it: the estimate and its 95% interval. `high` None: unbounded
    (one paired run bounds nothing above, and JSON has no infinity); `low` None: not recorded."""

    estimate: float
    low: float | None = None
    high: float | None = None

    @classmethod
    def of(cls, interval: Interval | None) -> Ratio | None:
        if interval is None:
            return None
        return cls(interval.estimate, interval.low, interval.high if math.isfinite(interval.high) else None)


@dataclass(frozen=True)
class Figures:
    """What decoding the calibration prompts with one skip set showed, each speed paired with plain decoding."""

    speedup: Ratio | None = None  # measured; None where nothing was timed (the modeled objective)
    paired_runs: int | None = None  # behind `speedup`
    predicted_speedup: Ratio | None = None  # from a cost profile
    acceptance_rate: float | None = None  # None when nothing was drafted: plain decoding has no acceptance rate
    tokens_per_second: float | None = None
    baseline_tokens_per_second: float | None = None
    mean_accepted_tokens: float | None = None
    identical: bool | None = None  # every output equalled plain greedy decoding's
    prompts: int | None = None  # prompts the figures cover: fewer when the pruner stopped the trial early

    def as_dict(self) -> dict[str, Any]:
        """Flat JSON: the names under which Optuna's trial attributes, the confirmation and best.json's metrics
        all keep these figures."""
        flat = {name: getattr(self, name) for name in _PLAIN_FIGURES}
        for name in _RATIOS:
            ratio = getattr(self, name)  # an unmeasured one is null under all three names
            flat.update({name: None if ratio is None else ratio.estimate,
                         f"{name}_low": None if ratio is None else ratio.low,
                         f"{name}_high": None if ratio is None else ratio.high})
        return flat

    @classmethod
    def from_dict(cls, flat: dict[str, Any]) -> Figures | None:
        """The figures in `flat`, None when it holds none of them (a trial stopped before it measured anything)."""
        if not any(name in flat for name in (*_PLAIN_FIGURES, *_RATIOS)):
            return None
        ratios = {name: None if flat.get(name) is None else Ratio(flat[name], flat.get(f"{name}_low"),
                                                                  flat.get(f"{name}_high"))
                  for name in _RATIOS}
        return cls(**{name: flat.get(name) for name in _PLAIN_FIGURES}, **ratios)


_RATIOS = ("speedup", "predicted_speedup")
_PLAIN_FIGURES = tuple(f.name for f in fields(Figures) if f.name not in _RATIOS)
DATASETS_ATTR = "dataset_figures"  # a trial's or a confirmed candidate's figures per dataset, in studies of several


def _datasets_attrs(datasets: dict[str, Figures] | None) -> dict[str, Any]:
    return {DATASETS_ATTR: {name: figures.as_dict() for name, figures in datasets.items()}} if datasets else {}


def _datasets_of(attrs: dict[str, Any]) -> dict[str, Figures] | None:
    stored = attrs.get(DATASETS_ATTR)
    return {name: Figures.from_dict(flat) or Figures() for name, flat in stored.items()} if stored else None


@dataclass(frozen=True)
class TrialRecord:
    """One trial: how it came about, the skip set it proposed and what that set measured.

    Read from a finished or running Optuna trial with `of`; written a few fields at a time with `write`, as the
    trial learns them (fields left None are not written). `number`, `state` and `values` are Optuna's own.
    """

    number: int | None = None
    state: TrialState | None = None
    values: tuple[float, ...] | None = None
    skip: SkipSet | None = None  # None until the trial's parameters are drawn
    # How it came about.
    worker: str | None = None  # "host:pid" of the process that ran it (crash recovery reads it)
    warm_start: str | bool | None = None  # True: a structured warm start; a name: from a file or a published set
    explored: bool = False  # queued after the sampler proposed only evaluated sets for a while
    retry_of: int | None = None  # re-runs this failed trial (a worker died)
    fail_reason: str | None = None
    # What it measured.
    repeat_of: int | None = None  # the set's first trial, whose measurement this repeated proposal copies
    skipped: int | None = None  # sublayers skipped; recorded once the trial starts measuring
    skipped_fraction: float | None = None
    plain_decoding: str | None = None  # why the empty set's value is plain decoding's, known without decoding
    match: float | None = None  # the pre-screen's teacher-forced agreement of the draft with the full model
    screened_out: str | None = None  # why the pre-screen stopped it: its value is an estimate, not a measurement
    stopped_early: str | None = None  # why the pruner stopped it: its figures cover fewer prompts
    figures: Figures | None = None
    datasets: dict[str, Figures] | None = None  # in a study of several datasets: the figures of each one's prompts

    @classmethod
    def of(cls, trial: FrozenTrial, ranking: VocabularyRanking | None = None) -> TrialRecord:
        """The record of `trial`; `ranking`: the study's, which a trimmed head's rows come from."""
        attrs = trial.user_attrs
        has_skip = "skip_attn" in attrs and "skip_mlp" in attrs
        stored = {name: attrs.get(_KEYS.get(name, name)) for name in _STORED}
        return cls(
            number=trial.number, state=trial.state, values=None if trial.values is None else tuple(trial.values),
            skip=_skip_of(attrs, ranking) if has_skip else None,
            explored=bool(attrs.get("explored")), figures=Figures.from_dict(attrs), datasets=_datasets_of(attrs),
            **{name: _words(value) if name in _WORDS else value for name, value in stored.items()},
        )

    def attrs(self) -> dict[str, Any]:
        """This record's fields that are set, as Optuna user attributes."""
        attrs: dict[str, Any] = {}
        if self.skip is not None:
            attrs.update(_skip_attrs(self.skip))
        attrs.update({_KEYS.get(name, name): getattr(self, name) for name in _STORED if getattr(self, name) is not None})
        if self.explored:
            attrs["explored"] = True
        if self.figures is not None:
            attrs.update(self.figures.as_dict())
        attrs.update(_datasets_attrs(self.datasets))
        return attrs

    def measurement(self) -> TrialRecord:
        """What this trial measured, without how it came about: what a repeated proposal of its set copies."""
        return TrialRecord(skip=self.skip, skipped=self.skipped, skipped_fraction=self.skipped_fraction,
                           plain_decoding=self.plain_decoding, match=self.match, screened_out=self.screened_out,
                           stopped_early=self.stopped_early, figures=self.figures, datasets=self.datasets)


# Why a trial that found the budget spent when it started was not run: no failure (worker.py), told apart by this.
SURPLUS_REASON = "not run: the study already had"


def surplus_reason(n_trials: int) -> str:
    return f"{SURPLUS_REASON} {n_trials} trials"


# The record's fields stored as they are, each under its name or the one crash recovery gives it; those in words.
_STORED = tuple(f.name for f in fields(TrialRecord)
                if f.name not in ("number", "state", "values", "skip", "explored", "figures", "datasets"))
_KEYS = {"worker": WORKER_ATTR, "retry_of": RETRY_ATTR, "fail_reason": FAIL_REASON_ATTR}
_WORDS = {"worker", "fail_reason", "plain_decoding", "screened_out", "stopped_early"}


def _words(value: Any) -> str | None:
    return None if value is None else str(value)


def _skip_attrs(skip: SkipSet) -> dict[str, Any]:
    """A skip set as a trial stores it: its sublayers, and its head's size where trimmed (the rows are the study's
    ranking's top ones)."""
    return {"skip_attn": list(skip.attn), "skip_mlp": list(skip.mlp),
            **({"skip_head_rows": skip.head.rows} if skip.head is not None else {})}


def _skip_of(attrs: dict[str, Any], ranking: VocabularyRanking | None) -> SkipSet:
    rows = attrs.get("skip_head_rows")
    if rows and ranking is None:
        raise ValueError("a trial drafts with a trimmed head, but the study keeps no vocabulary ranking")
    return SkipSet.of(attrs["skip_attn"], attrs["skip_mlp"], head=ranking.head(rows) if rows else None)


@dataclass(frozen=True)
class StudyLabel:
    """What a study measures, written when it is created: a resumed study must measure as it did, and the export
    names the model, settings and device its figures come from. Fields a study of an older release may lack are
    None."""

    model: ModelInfo
    objective: str
    sampler: str | None = None
    dataset: str | list[str] | None = None  # a list: a study of several datasets, which ranks sets per dataset too
    num_prompts: int | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    device: str | None = None
    device_name: str | None = None
    dtype: str | None = None
    draft: DraftPolicy | None = None
    space: SearchSpace | None = None
    cost_profile: CostProfile | None = None  # a modeled study's: a resumed study scores with the same costs
    compile: bool | None = None  # whether its trials ran compiled (regional) steps; None: an older release's study
    seen_prompts: list[str] | None = None  # digests of the prompts it decoded or ranked a head on (io/data.py)

    @property
    def predicted_for(self) -> str | None:
        """The device a modeled study's speedups are predictions for (its cost profile's, seldom the one it decoded
        on); None in a study that measures its speedups, or a modeled one whose profile is not stored yet."""
        profile = self.cost_profile if self.objective == "modeled" else None
        return None if profile is None else profile.provenance.get("device_name") or profile.device

    @property
    def datasets(self) -> tuple[str, ...]:
        """The datasets whose prompts the trials decode, in order."""
        return (self.dataset,) if isinstance(self.dataset, str) else tuple(self.dataset or ())

    def attrs(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        values["model"] = values["model"].to_json()  # fields an older release lacked are left out, not null
        if "space" in values:
            values["space"] = values["space"].as_dict()
        if self.draft is not None:
            values["draft"] = self.draft.as_dict()
        if self.cost_profile is not None:
            values["cost_profile"] = self.cost_profile.to_dict()
        return values

    @classmethod
    def from_attrs(cls, attrs: Any) -> StudyLabel:
        """The label in `attrs`; ValueError when it is not one (damaged, or written by another tool)."""
        try:
            values = {f.name: attrs.get(f.name) for f in fields(cls)}
            values["model"] = ModelInfo(**attrs["model"])
            values["draft"] = None if values["draft"] is None else DraftPolicy.from_dict(values["draft"])
            if values["space"] is not None:
                values["space"] = SearchSpace(**{**values["space"],
                                                 "head_rows": tuple(values["space"].get("head_rows", ()))})
            if values["cost_profile"] is not None:
                values["cost_profile"] = CostProfile.from_dict(values["cost_profile"])
            hints = get_type_hints(cls)
            for name in _LABEL_SCALARS:
                if not json_matches(values[name], hints[name]):
                    raise TypeError(f"{name} is {values[name]!r}")
            return cls(**values)
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a skipsearch study label ({error})") from None


# A label's fields that are plain JSON values, each checked against its type when a study is opened (a damaged one
# is refused there, not in a later traceback).
_LABEL_SCALARS = ("objective", "sampler", "dataset", "num_prompts", "max_new_tokens", "seed", "device", "device_name",
                  "dtype", "compile", "seen_prompts")


@dataclass(frozen=True)
class ConfirmedCandidate:
    """A skip set measured again, with more paired runs, before the export."""

    trial: int
    skip: SkipSet
    score: float  # ranking.score of the confirmed figures
    skipped: int
    skipped_fraction: float
    figures: Figures
    datasets: dict[str, Figures] | None = None  # in a study of several datasets: the figures of each one's prompts

    def attrs(self) -> dict[str, Any]:
        return {"trial": self.trial, **_skip_attrs(self.skip), "score": self.score, **self.figures.as_dict(), "skipped_fraction": self.skipped_fraction,
                "skipped": self.skipped, **_datasets_attrs(self.datasets)}

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any], ranking: VocabularyRanking | None = None) -> ConfirmedCandidate:
        return cls(trial=attrs["trial"], skip=_skip_of(attrs, ranking), score=attrs["score"],
                   skipped=attrs.get("skipped"), skipped_fraction=attrs.get("skipped_fraction"),
                   figures=Figures.from_dict(attrs) or Figures(), datasets=_datasets_of(attrs))


@dataclass(frozen=True)
class Confirmation:
    """The study's best distinct skip sets, measured again: what the export decides by."""

    candidates: tuple[ConfirmedCandidate, ...]
    top: int | None  # how many were asked for (0: confirmation turned off)
    repeats: int | None  # paired runs per prompt
    prompts: int | None = None
    distinct_trials: int | None = None  # distinct skip sets the study had when it confirmed
    # Candidates it set out to confirm: more than it holds when a stop signal cut it short. None: all (earlier
    # releases stored complete confirmations only).
    wanted: int | None = None

    @property
    def complete(self) -> bool:
        return self.wanted is None or len(self.candidates) >= self.wanted

    def attrs(self) -> dict[str, Any]:
        attrs = {"candidates": [c.attrs() for c in self.candidates], "top": self.top, "repeats": self.repeats,
                 "prompts": self.prompts, "distinct_trials": self.distinct_trials}
        # Only where it says something: a complete confirmation reads back as the release before wrote it.
        return attrs if self.complete else {**attrs, "wanted": self.wanted}

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any], ranking: VocabularyRanking | None = None) -> Confirmation:
        return cls(candidates=tuple(ConfirmedCandidate.from_attrs(c, ranking) for c in attrs["candidates"]),
                   top=attrs.get("top"),
                   repeats=attrs.get("repeats"), prompts=attrs.get("prompts"),
                   distinct_trials=attrs.get("distinct_trials"), wanted=attrs.get("wanted"))

    def of_trial(self, number: int) -> ConfirmedCandidate | None:
        return next((c for c in self.candidates if c.trial == number), None)


# Reading and writing records on Optuna's studies and trials.

def read_trials(study: optuna.Study, states: Iterable[TrialState] | None = None) -> list[TrialRecord]:
    ranking = read_vocabulary(study)
    trials = study.get_trials(deepcopy=False, states=None if states is None else tuple(states))
    return [TrialRecord.of(t, ranking) for t in trials]


def finished_trials(study: optuna.Study) -> list[TrialRecord]:
    return read_trials(study, (TrialState.COMPLETE, TrialState.PRUNED))


def distinct_trials(study: optuna.Study) -> list[TrialRecord]:
    """Finished trials that evaluated a skip set for the first time: what `n_trials` counts."""
    return [t for t in finished_trials(study) if t.repeat_of is None]


def measured_trials(study: optuna.Study) -> list[TrialRecord]:
    """The distinct completed trials whose value was measured: not pre-screen estimates (another scale)."""
    return [t for t in distinct_trials(study) if t.state == TrialState.COMPLETE and t.screened_out is None]


def decoded_trials(study: optuna.Study) -> list[TrialRecord]:
    """The measured trials whose value came from decoding: not plain decoding's, which is known without decoding."""
    return [t for t in measured_trials(study) if t.plain_decoding is None]


def write(trial: optuna.Trial, record: TrialRecord) -> None:
    """Store the fields of `record` that are set on the running `trial`."""
    for key, value in record.attrs().items():
        trial.set_user_attr(key, value)


def enqueue(study: optuna.Study, params: dict[str, float], record: TrialRecord, skip_if_exists: bool = False) -> None:
    """Queue a trial at `params` that starts with `record`'s fields (how it came about)."""
    study.enqueue_trial(params, user_attrs=record.attrs(), skip_if_exists=skip_if_exists)


def made_by_skipsearch(study_attrs: dict[str, Any]) -> bool:
    """Whether a study's user attributes (as `storage.existing_study` reads them) carry skipsearch's label."""
    return STUDY_ATTR in study_attrs


def read_label(study: optuna.Study) -> StudyLabel | None:
    """The study's label; None on a study skipsearch has not labelled (yet)."""
    attrs = study.user_attrs.get(STUDY_ATTR)
    return None if attrs is None else StudyLabel.from_attrs(attrs)


def study_label(study: optuna.Study) -> StudyLabel:
    """The label of a study that must be skipsearch's."""
    label = read_label(study)
    if label is None:
        raise ValueError(f"study {study.study_name!r} was not made by skipsearch (no {STUDY_ATTR!r} attribute)")
    return label


def write_label(study: optuna.Study, label: StudyLabel) -> None:
    study.set_user_attr(STUDY_ATTR, label.attrs())


def read_confirmation(study: optuna.Study) -> Confirmation | None:
    attrs = study.user_attrs.get(CONFIRM_ATTR)
    return None if attrs is None else Confirmation.from_attrs(attrs, read_vocabulary(study))


def read_vocabulary(study: optuna.Study) -> VocabularyRanking | None:
    """The study's vocabulary ranking; None where it drafts with the full head only."""
    text = study.user_attrs.get(VOCABULARY_ATTR)
    return None if text is None else _ranking_of(text)


@functools.lru_cache(maxsize=4)
def _ranking_of(text: str) -> VocabularyRanking:
    return VocabularyRanking.from_text(text)  # read for every list of trials: decoded once per ranking


def write_vocabulary(study: optuna.Study, ranking: VocabularyRanking) -> None:
    study.set_user_attr(VOCABULARY_ATTR, ranking.to_text())


def write_confirmation(study: optuna.Study, confirmation: Confirmation) -> None:
    """Store `confirmation`, unless the study holds a complete one chosen from more trials: on a shared storage,
    another worker confirmed later trials while this one measured, and its figures stand (read just before writing:
    the window left is one storage round trip, not a confirmation's minutes)."""
    stored = read_confirmation(study)
    if (stored is not None and stored.complete
            and (stored.distinct_trials or 0) > (confirmation.distinct_trials or 0)):
        return
    study.set_user_attr(CONFIRM_ATTR, confirmation.attrs())


def study_summary(study: optuna.Study, n_trials: int | None = None) -> str:
    """What the study evaluated, in the units `--n-trials` counts (`n_trials`: the run's, where known)."""
    distinct = distinct_trials(study)
    warm = [t.number for t in distinct if t.warm_start]
    plain = [t.number for t in distinct if t.plain_decoding is not None]
    screened = sum(t.screened_out is not None for t in distinct)
    early = sum(t.stopped_early is not None for t in distinct)
    repeats = sum(t.repeat_of is not None for t in finished_trials(study))
    ended = read_trials(study, (TrialState.FAIL,))
    surplus = sum((t.fail_reason or "").startswith(SURPLUS_REASON) for t in ended)
    failed = len(ended) - surplus
    queued = sum("warm_start" in t.user_attrs for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
    parts = [f"{len(distinct)} distinct skip sets evaluated",
             f"warm starts: trials {', '.join(map(str, warm))}" if warm else
             f"{queued} warm start{'' if queued == 1 else 's'} queued, none evaluated yet" if queued else
             "no warm starts",
             *[f"trial {n}, the empty set, is plain decoding: scored 1 by definition, not decoded" for n in plain],
             f"{screened} stopped by the pre-screen", f"{early} stopped early by the pruner",
             f"{repeats} repeated proposals answered from earlier trials without decoding"]
    if failed:
        parts.append(f"{failed} failed")
    if surplus:
        parts.append(f"{surplus} not run, the study already had its trials (no failure)")
    if distinct and len(warm) == len(distinct):
        warm_starts = len(warm) + queued
        parts.append("every trial was a warm start: the sampler has proposed no set yet" + (
            f" (--n-trials {n_trials} leaves it none: give more than {warm_starts})"
            if n_trials is not None and n_trials <= warm_starts else ""))
    return "; ".join(parts)
