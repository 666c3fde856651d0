"""`profile`: this device's cost profile for a model, written as JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..constants import DEFAULT_MODEL
from ..costs.profiler import profile_costs, study_compile_mode
from ..decode.cost_profile import CostProfile
from ..io import models
from ..io.files import check_output_file
from .options import ModelOptions


@dataclass(frozen=True)
class ProfileSettings(ModelOptions):
    output: Path | None = None  # None: <studies_dir>/cost-profile.json
    studies_dir: Path = Path("studies")
    contexts: list[int] | None = None  # None: the profiler's defaults for the device
    config_only: bool = False  # random weights from the model's config alone: costs do not depend on their values
    repeats: int = 20
    no_progress: bool = False
    compile: bool = False  # the regional compiled steps on a CPU too (always on CUDA)


def profile_device(settings: ProfileSettings) -> tuple[CostProfile, Path]:
    """Profile the model as `python -m skipsearch profile` does; returns the profile and the file it was saved to."""
    s = settings
    output = s.output or s.studies_dir / "cost-profile.json"
    check_output_file(output, "--output" if s.output else "--studies-dir", inside=None if s.output else s.studies_dir)
    if s.config_only:
        model = models.model_from_config(s.model, device=s.device, dtype=s.dtype)
    else:
        model = s.load().model
    mode = "regional" if s.compile else study_compile_mode(model.device)
    profile = profile_costs(model, contexts=s.contexts, repeats=s.repeats, show_progress=not s.no_progress,
                            compile_mode=mode)
    weights = "random (built from the config alone)" if s.config_only else "real"
    profile = dataclasses.replace(profile, provenance={**profile.provenance, "model": s.model or DEFAULT_MODEL,
                                                       "weights": weights, "steps": mode or "eager"})
    profile.save(output)
    return profile, output
