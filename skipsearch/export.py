"""From a finished study to a skip config: the best trial, the verdict on whether it pays, the JSON export."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from .config import ModelInfo, SkipConfig, save_skip_config, write_atomic
from .decoding import DraftPolicy
from .search import STUDY_ATTR, best_trial, finished_trials
from .skipping import SkipSet
from .warmstart import dv_json, dv_name


def config_from_trial(study: optuna.Study, trial: FrozenTrial) -> SkipConfig:
    """The skip config of a finished trial, with its metrics and the study's search settings."""
    info = study.user_attrs.get(STUDY_ATTR)
    if info is None:
        raise ValueError(f"study {study.study_name!r} was not made by skipsearch (no {STUDY_ATTR!r} attribute)")
    if trial.state != TrialState.COMPLETE:
        raise ValueError(f"trial {trial.number} of study {study.study_name!r} is {trial.state.name}, not COMPLETE")
    model = ModelInfo(**info["model"])
    skip = SkipSet.of(trial.user_attrs["skip_attn"], trial.user_attrs["skip_mlp"], model.num_hidden_layers)
    attrs = trial.user_attrs
    objective = info["objective"]
    metrics = {
        "objective": objective,
        "score": trial.values[0] if objective != "pareto" else attrs["speedup"] * attrs["acceptance_rate"],
        "speedup": attrs["speedup"],
        "acceptance_rate": attrs["acceptance_rate"],
        "tokens_per_second": attrs["tokens_per_second"],
        "baseline_tokens_per_second": attrs["baseline_tokens_per_second"],
        "mean_accepted_tokens": attrs["mean_accepted_tokens"],
    }
    if attrs.get("predicted_speedup") is not None:
        metrics["predicted_speedup"] = attrs["predicted_speedup"]
    return SkipConfig(model=model, skip=skip, draft=DraftPolicy(**info["draft"]), metrics=metrics,
                      search=_search_settings(study, trial.number))


def _search_settings(study: optuna.Study, trial_number: int | None) -> dict:
    info = study.user_attrs[STUDY_ATTR]
    return {
        "study_name": study.study_name, "trial_number": trial_number, "sampler": info["sampler"],
        "dataset": info["dataset"], "num_prompts": info["num_prompts"], "max_new_tokens": info["max_new_tokens"],
        "device": info["device"], "dtype": info["dtype"], "created_at": datetime.now(timezone.utc).isoformat(),
    }


def speedup_key(study: optuna.Study) -> str:
    """The user attribute that holds a trial's speedup: predicted for modeled studies, else measured."""
    return "predicted_speedup" if study.user_attrs.get(STUDY_ATTR, {}).get("objective") == "modeled" else "speedup"


def fastest_skip_trial(study: optuna.Study) -> FrozenTrial | None:
    """The completed trial with the highest speedup among those that skip something."""
    key = speedup_key(study)
    trials = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
              if t.user_attrs.get("skipped", 0) > 0 and t.user_attrs.get(key) is not None]
    return max(trials, key=lambda t: t.user_attrs[key], default=None)


def verdict(study: optuna.Study) -> tuple[bool, str]:
    """(whether the best trial beats plain decoding, a sentence that says so with the measured numbers)."""
    best = best_trial(study)
    if best is None:
        return False, "no trial has completed yet"
    fastest = fastest_skip_trial(study)
    key = speedup_key(study)
    kind = "predicted" if key == "predicted_speedup" else "measured"
    if best.user_attrs.get("skipped", 0) > 0 and best.user_attrs[key] > 1.0:
        a = best.user_attrs
        return True, (f"skip set of trial {best.number} decodes {a[key]:.2f}x as fast as plain decoding ({kind}; "
                      f"acceptance {a['acceptance_rate']:.2f}, {a['skipped']} sublayers skipped)")
    if fastest is None:
        return False, "no skip set beats plain decoding on this model and device: no skipping trial completed"
    text = (f"no skip set beats plain decoding on this model and device: best {fastest.user_attrs[key]:.2f}x "
            f"({kind}, trial {fastest.number})")
    if fastest.user_attrs[key] > 1.0:
        text += "; that trial loses on the objective through its acceptance rate, --objective speedup would keep it"
    return False, text


def plain_decoding_config(study: optuna.Study, reason: str) -> SkipConfig:
    """The config to export when nothing pays: skip nothing, so inference decodes plainly."""
    info = study.user_attrs[STUDY_ATTR]
    fastest = fastest_skip_trial(study)
    baseline = max((t.user_attrs.get("baseline_tokens_per_second", 0.0) for t in finished_trials(study)), default=0.0)
    metrics = {
        "objective": info["objective"], "score": 1.0, "speedup": 1.0, "acceptance_rate": 1.0,
        "tokens_per_second": baseline, "baseline_tokens_per_second": baseline, "mean_accepted_tokens": 0.0,
        "verdict": reason, "best_skipping_speedup": fastest.user_attrs[speedup_key(study)] if fastest else None,
    }
    return SkipConfig(model=ModelInfo(**info["model"]), skip=SkipSet(), draft=DraftPolicy(**info["draft"]),
                      metrics=metrics, search=_search_settings(study, None))


def export_trial(study: optuna.Study, path: Path, trial_number: int | None = None,
                 write: Callable[[SkipConfig, Path], None] = save_skip_config) -> SkipConfig:
    """Write trial `trial_number`'s config, or the study's best; plain decoding when the best does not pay.
    `write` writes it (another format: `write_dv`)."""
    if trial_number is None:
        if best_trial(study) is None:
            raise ValueError(f"study {study.study_name!r} has no completed trial to export yet")
        pays, reason = verdict(study)
        config = config_from_trial(study, best_trial(study)) if pays else plain_decoding_config(study, reason)
        config.metrics["verdict"] = reason
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
