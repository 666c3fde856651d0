"""skipsearch: find which sublayers to skip for self-speculative decoding, by Bayesian optimization."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public names resolve on first use (PEP 562), so `python -m skipsearch --help` never imports torch.
_EXPORTS = {
    "SkipConfig": "config", "load_skip_config": "config", "save_skip_config": "config",
    "self_speculative": "custom_generate", "DraftMemory": "controller",
    "DecodeStats": "decoding", "DraftPolicy": "policy", "GenerationOutput": "decoding", "Sampling": "decoding",
    "generate": "decoding",
    "LoadedModel": "models", "encode_prompt": "models", "load_model": "models",
    "SkipSet": "skipping", "draft_mode": "skipping",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .config import SkipConfig, load_skip_config, save_skip_config
    from .controller import DraftMemory
    from .custom_generate import self_speculative
    from .decoding import DecodeStats, GenerationOutput, Sampling, generate
    from .models import LoadedModel, encode_prompt, load_model
    from .policy import DraftPolicy
    from .skipping import SkipSet, draft_mode


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'skipsearch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
