"""skipsearch: find which sublayers to skip for self-speculative decoding, by Bayesian optimization."""

from .config import SkipConfig, load_skip_config, save_skip_config
from .decoding import DecodeStats, DraftPolicy, GenerationOutput, Sampling, generate
from .models import LoadedModel, encode_prompt, load_model
from .skipping import SkipSet, draft_mode

__all__ = [
    "DecodeStats", "DraftPolicy", "GenerationOutput", "LoadedModel", "Sampling", "SkipConfig", "SkipSet",
    "draft_mode", "encode_prompt", "generate", "load_model", "load_skip_config", "save_skip_config",
]
__version__ = "0.1.0"
