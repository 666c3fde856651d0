"""Skip sets published with the papers that introduced layer-skip self-speculative decoding, shipped as data.

skipsearch/published/*.json keep the published files' own format (`{"<name>": {"attention", "mlp"}}`, so each is a
valid `--warm-start` file) and add, per entry, the model it was searched for and its source (paper, repository,
commit). `optimize` enqueues the sets made for a model of the same shape as warm starts.
"""

from __future__ import annotations

from pathlib import Path

from ..decode.config import ModelInfo
from ..io.files import read_json
from .warmstart import NamedSkipSet, parse_skip_sets

PUBLISHED_DIR = Path(__file__).parent.parent / "published"


def published_skip_sets() -> list[NamedSkipSet]:
    """Every shipped skip set, in file order."""
    sets = []
    for path in sorted(PUBLISHED_DIR.glob("*.json")):
        sets += parse_skip_sets(read_json(path, "published skip sets"), f"published/{path.name}")
    return sets


def matching_skip_sets(model: ModelInfo) -> list[NamedSkipSet]:
    """The shipped skip sets made for a model with `model`'s architecture, layer count and hidden size."""
    return [s for s in published_skip_sets() if s.matches(model)]
