"""A study's settings, checked when made: what every worker of the study runs by, and what a resumed study must
measure as its label says."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import optuna

from ..decode.config import MODEL_SHAPE
from ..decode.cost_profile import CostProfile
from ..decode.skipset import SkipSet
from .records import StudyLabel
from .storage import Heartbeat, redact_url


# The fewest new tokens under which a study measures a draft: the prefill gives the first token, and a round needs
# room for a draft plus the full model's own token (loop.py's `_round`). With fewer, nothing is ever drafted and
# a "speedup" is timing noise around 1. Three measure one round; a figure worth ranking by takes many rounds per
# prompt (the command's default is 32).
MIN_STUDY_NEW_TOKENS = 3


def check_measurable(max_new_tokens: int, max_draft_tokens: int | None = None,
                     names: tuple[str, str] = ("max_new_tokens", "max_draft_tokens")) -> None:
    """A ValueError for study settings under which no token is ever drafted (`names`: the two settings as the
    caller's user knows them, e.g. the command's flags); `max_draft_tokens` None: not checked."""
    if max_new_tokens < MIN_STUDY_NEW_TOKENS:
        raise ValueError(f"{names[0]} {max_new_tokens} leaves no room for a draft (the prefill gives the first token, "
                         f"a round needs one for a draft and one for the full model's): a study needs {names[0]} >= "
                         f"{MIN_STUDY_NEW_TOKENS} to measure a draft, and many rounds for a meaningful speedup")
    if max_draft_tokens == 0:
        raise ValueError(f"{names[1]} 0 drafts nothing, and a study measures drafting: give {names[1]} >= 1")


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
    dataset: str | list[str] = "builtin"  # a list: several datasets, each prompt's named in run_study's call
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
    # Compiled (regional) draft and verify steps, as `generate --compile` runs them on CUDA; None: on CUDA only,
    # where eager trials would time the host's Python rather than the GPU.
    compile: bool | None = None

    def __post_init__(self) -> None:
        check_measurable(self.max_new_tokens)

    def __repr__(self) -> str:  # the storage URL redacted: a repr lands in logs and tracebacks
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(self.storage, str):
            shown["storage"] = redact_url(self.storage)
        return f"StudySettings({', '.join(f'{name}={value!r}' for name, value in shown.items())})"


# What a trial measures: a resumed study must measure its new trials as it did the old. (Label field, its flag.)
_MEASUREMENT_SETTINGS = (("model", "model"), ("objective", "--objective"), ("space", "search space"),
                         ("dataset", "--dataset"), ("num_prompts", "--num-prompts"),
                         ("seed", "--seed (it picks the prompts)"), ("max_new_tokens", "--max-new-tokens"),
                         ("draft", "drafting settings"), ("dtype", "--dtype"), ("compile", "--compile"))
# Settings a label of an older release may lack: such a study is resumed without checking them.
_LABELLED_LATER = ("compile",)


def check_resumable(name: str, existing: StudyLabel, wanted: StudyLabel) -> None:
    have_all, want_all = existing.attrs(), wanted.attrs()  # as stored, which is how the message shows them
    for key, flag in _MEASUREMENT_SETTINGS:
        have, want = have_all.get(key), want_all[key]
        if key == "model":
            have, want = ({k: model[k] for k in MODEL_SHAPE} for model in (have, want))
        if key in _LABELLED_LATER and have is None:
            continue
        if have != want:
            raise ValueError(f"study {name!r} was made with another {flag} ({have}); use a new --study-name for {want}")


def profile_words(profile: CostProfile) -> str:
    """A profile as a refusal names it: two of one device differ by when they were measured."""
    created = profile.provenance.get("created_at")
    return profile.label() + (f", measured {created}" if created else "")
