"""From a study to a skip config: the confirmed choice, the verdict that says whether it pays, the JSON export.

A skip set is exported only when its confirmation (a re-measurement against plain decoding with
more paired runs, stored on the study by `search.confirm_candidates`) puts the lower bound of its
speedup's interval above 1.0. Otherwise the export is "skip nothing", quoting the best confirmed
figure. Every surface (verdict line, best.json, plots, notebook, bench) reads this one decision.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from .config import ModelInfo, SkipConfig, save_skip_config
from .files import write_atomic
from .policy import DraftPolicy
from .search import CONFIRM_ATTR, STUDY_ATTR
from .skipping import SkipSet
from .warmstart import dv_json, dv_name

# The figures a confirmation carries into best.json's metrics.
_METRIC_KEYS = ("speedup", "speedup_low", "speedup_high", "paired_runs", "acceptance_rate", "tokens_per_second",
                "baseline_tokens_per_second", "mean_accepted_tokens", "predicted_speedup", "predicted_speedup_low",
                "predicted_speedup_high")


@dataclass(frozen=True)
class Decision:
    """What to export: `chosen` is the confirmed candidate (None: plain decoding); `best` the candidate with
    the highest confirmed speedup, quoted either way; `text` the verdict sentence."""

    chosen: dict[str, Any] | None
    best: dict[str, Any] | None
    text: str

    @property
    def pays(self) -> bool:
        return self.chosen is not None


def study_info(study: optuna.Study) -> dict[str, Any]:
    info = study.user_attrs.get(STUDY_ATTR)
    if info is None:
        raise ValueError(f"study {study.study_name!r} was not made by skipsearch (no {STUDY_ATTR!r} attribute)")
    return info


def speedup_key(study: optuna.Study) -> str:
    """Where a speedup lives: predicted for modeled studies (deterministic), else measured."""
    return "predicted_speedup" if study_info(study).get("objective") == "modeled" else "speedup"


def _figure(candidate: dict[str, Any], key: str) -> str:
    if key == "predicted_speedup":
        basis = f"predicted by the cost model from acceptance over {candidate['prompts']} prompts"
    elif candidate["paired_runs"] < 2:
        return f"{candidate[key]:.2f}x as fast as plain decoding (measured, one paired run: no interval)"
    else:
        basis = f"measured, {candidate['paired_runs']} paired runs"
    high = candidate[key + "_high"]
    return (f"{candidate[key]:.2f}x as fast as plain decoding (95% interval {candidate[key + '_low']:.2f}-"
            f"{'unbounded' if high is None else format(high, '.2f')}, {basis})")


def decide(study: optuna.Study) -> Decision:
    """Read the study's confirmation and decide: a skip set only when its interval lies above 1.0."""
    record = study.user_attrs.get(CONFIRM_ATTR)
    if record is None:
        return Decision(None, None, "no skip set has been confirmed yet (the study stopped before its confirmation "
                                    "step): run the same `optimize` command again to confirm; plain decoding is exported")
    key = speedup_key(study)
    candidates = [c for c in record["candidates"] if c.get(key) is not None]
    if not candidates and record.get("top") == 0:
        return Decision(None, None, "confirmation was turned off (--confirm-top 0): plain decoding is exported")
    if not candidates:
        if not any(t.user_attrs.get("skipped") for t in study.get_trials(deepcopy=False)):
            return Decision(None, None, "no trial skipped anything (the search space allows no skipping, e.g. "
                                        "--max-skip-fraction 0, or it stopped first): plain decoding is exported")
        return Decision(None, None, "no skip set got past the pre-screen and the pruner to be confirmed: "
                                    "plain decoding is exported")
    best = max(candidates, key=lambda c: c[key])
    passing = [c for c in candidates if c[key + "_low"] > 1.0]
    if passing:
        chosen = max(passing, key=lambda c: c["score"])
        acceptance = chosen["acceptance_rate"]
        return Decision(chosen, best, (
            f"skip set of trial {chosen['trial']} ({_skip_text(chosen)}) decodes {_figure(chosen, key)}; "
            f"acceptance {acceptance:.2f}, {chosen['skipped']} sublayers skipped"))
    text = (f"no skip set was confirmed faster than plain decoding on this model and device: the best, trial "
            f"{best['trial']} ({_skip_text(best)}), decodes {_figure(best, key)}")
    if best[key] > 1.0:
        text += "; that interval includes 1.0, so it cannot be told apart from plain decoding"
    return Decision(None, best, text + "; plain decoding is exported")


def _skip_text(candidate: dict[str, Any]) -> str:
    return str(SkipSet.of(candidate["skip_attn"], candidate["skip_mlp"]))


def verdict(study: optuna.Study) -> tuple[bool, str]:
    """(whether a confirmed skip set beats plain decoding, the sentence that says so with its interval)."""
    decision = decide(study)
    return decision.pays, decision.text


def config_from_trial(study: optuna.Study, trial: FrozenTrial) -> SkipConfig:
    """The skip config of one finished trial with the trial's own (unconfirmed) metrics."""
    info = study_info(study)
    if trial.state != TrialState.COMPLETE:
        raise ValueError(f"trial {trial.number} of study {study.study_name!r} is {trial.state.name}, not COMPLETE")
    if "skip_attn" not in trial.user_attrs:
        raise ValueError(f"trial {trial.number} of study {study.study_name!r} has no skip set")
    attrs = trial.user_attrs
    record = study.user_attrs.get(CONFIRM_ATTR) or {"candidates": []}
    confirmed = next((c for c in record["candidates"] if c["trial"] == trial.number), None)
    if confirmed is not None:  # the confirmation's figures are the better-measured ones
        metrics = _metrics(info["objective"], confirmed["score"], confirmed)
        metrics["confirmed"] = True
        metrics["verdict"] = (f"trial {trial.number} exported on request; its confirmation measured "
                              f"{_figure(confirmed, speedup_key(study))}")
    else:
        metrics = _metrics(info["objective"], trial.values[0] if len(trial.values) == 1 else None, attrs)
        metrics["confirmed"] = False
        metrics["verdict"] = f"trial {trial.number} exported on request: its figures come from the search, unconfirmed"
    return _config(study, SkipSet.of(attrs["skip_attn"], attrs["skip_mlp"]), metrics, trial.number)


def _metrics(objective: str, score: float | None, figures: dict[str, Any]) -> dict[str, Any]:
    return {"objective": objective, "score": score, **{k: figures.get(k) for k in _METRIC_KEYS}}


def _config(study: optuna.Study, skip: SkipSet, metrics: dict[str, Any], trial_number: int | None) -> SkipConfig:
    info = study_info(study)
    model = ModelInfo(**info["model"])
    skip.check_fits(model.num_hidden_layers)
    return SkipConfig(model=model, skip=skip, draft=DraftPolicy(**info["draft"]), metrics=metrics,
                      search=_search_settings(study, trial_number))


def decided_config(study: optuna.Study) -> SkipConfig:
    """The config the study's decision exports: the confirmed skip set, or plain decoding."""
    info = study_info(study)
    decision = decide(study)
    if decision.chosen is not None:
        chosen = decision.chosen
        metrics = _metrics(info["objective"], chosen["score"], chosen)
        metrics.update(confirmed=True, verdict=decision.text)
        return _config(study, SkipSet.of(chosen["skip_attn"], chosen["skip_mlp"]), metrics, chosen["trial"])
    best = decision.best
    baseline = best.get("baseline_tokens_per_second") if best else None
    metrics = {"objective": info["objective"], "score": 1.0, "speedup": 1.0, "acceptance_rate": None,
               "tokens_per_second": baseline, "baseline_tokens_per_second": baseline, "mean_accepted_tokens": None,
               "confirmed": best is not None, "verdict": decision.text,
               "best_skipping": None if best is None else {
                   "trial": best["trial"], "skip": {"attn": best["skip_attn"], "mlp": best["skip_mlp"]},
                   **{k: best.get(k) for k in _METRIC_KEYS}}}
    return _config(study, SkipSet(), metrics, None)


def _search_settings(study: optuna.Study, trial_number: int | None) -> dict:
    info = study_info(study)
    record = study.user_attrs.get(CONFIRM_ATTR) or {}
    return {
        "study_name": study.study_name, "trial_number": trial_number, "sampler": info["sampler"],
        "dataset": info["dataset"], "num_prompts": info["num_prompts"], "max_new_tokens": info["max_new_tokens"],
        "device": info["device"], "device_name": info.get("device_name"), "dtype": info["dtype"],
        "confirm_repeats": record.get("repeats"),
        "created_at": datetime.now(timezone.utc).isoformat(),
    }


def export_trial(study: optuna.Study, path: Path, trial_number: int | None = None,
                 write: Callable[[SkipConfig, Path], None] = save_skip_config) -> SkipConfig:
    """Write the study's decided config (`trial_number` None), or that trial's; `write` writes it (the skip-config
    JSON by default, `write_dv` for the Draft & Verify / SWIFT format)."""
    if trial_number is None:
        config = decided_config(study)
    else:
        trials = study.get_trials(deepcopy=False)
        if not 0 <= trial_number < len(trials):
            raise ValueError(f"study {study.study_name!r} has no trial {trial_number} (it has {len(trials)})")
        config = config_from_trial(study, trials[trial_number])
    write(config, path)
    return config


def write_dv(config: SkipConfig, path: Path) -> None:
    """Write `config`'s skip set in the Draft & Verify / SWIFT format, named after its model."""
    write_atomic(path, json.dumps(dv_json(dv_name(config.model), config.skip), indent=2) + "\n")
