"""skipsearch: find which sublayers to skip for self-speculative decoding, by Bayesian optimization."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public names resolve on first use (PEP 562), so `python -m skipsearch --help` never imports torch.
_EXPORTS = {
    "SkipConfig": "decode.config", "load_skip_config": "decode.config", "save_skip_config": "decode.config",
    "self_speculative": "decode.custom_generate", "DraftMemory": "decode.controller",
    "DecodeStats": "decode.stats", "DraftPolicy": "decode.policy", "GenerationOutput": "decode.stats",
    "Sampling": "decode.sampling", "generate": "decode.loop",
    "LoadedModel": "io.models", "encode_prompt": "io.models", "load_model": "io.models",
    "SkipSet": "decode.skipset", "draft_mode": "decode.skipping",
    # What each command does, as one function (the command line calls the same): settings in, result out.
    "optimize": "api.optimize", "OptimizeSettings": "api.optimize", "Optimization": "api.optimize",
    "generate_text": "api.generate", "GenerateSettings": "api.generate",
    "benchmark": "api.bench", "BenchSettings": "api.bench",
    "profile_device": "api.profile", "ProfileSettings": "api.profile",
    "export_study": "api.study", "ExportSettings": "api.study", "plot_study": "api.study",
    "StudyOptions": "api.options", "check_family": "decode.families",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .api.bench import BenchSettings, benchmark
    from .api.generate import GenerateSettings, generate_text
    from .api.optimize import Optimization, OptimizeSettings, optimize
    from .api.options import StudyOptions
    from .api.profile import ProfileSettings, profile_device
    from .api.study import ExportSettings, export_study, plot_study
    from .decode.config import SkipConfig, load_skip_config, save_skip_config
    from .decode.controller import DraftMemory
    from .decode.custom_generate import self_speculative
    from .decode.families import check_family
    from .decode.loop import generate
    from .decode.policy import DraftPolicy
    from .decode.sampling import Sampling
    from .decode.skipping import draft_mode
    from .decode.skipset import SkipSet
    from .decode.stats import DecodeStats, GenerationOutput
    from .io.models import LoadedModel, encode_prompt, load_model


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'skipsearch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
