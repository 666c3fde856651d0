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
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .decode.config import SkipConfig, load_skip_config, save_skip_config
    from .decode.controller import DraftMemory
    from .decode.custom_generate import self_speculative
    from .decode.loop import generate
    from .decode.sampling import Sampling
    from .decode.stats import DecodeStats, GenerationOutput
    from .io.models import LoadedModel, encode_prompt, load_model
    from .decode.policy import DraftPolicy
    from .decode.skipping import draft_mode
    from .decode.skipset import SkipSet


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'skipsearch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
