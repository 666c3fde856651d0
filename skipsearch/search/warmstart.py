"""Skip sets from files, as warm starts for a study: skipsearch configs, and the JSON that Draft & Verify and
SWIFT publish, `{"<name>": {"attention": [...], "mlp": [...]}}` (0-based layer ids; other keys are ignored)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..decode.config import FORMAT as CONFIG_FORMAT, MODEL_SHAPE, ModelInfo, parse_skip_config
from ..decode.skipset import DraftHead, SkipSet
from ..io.files import read_json


@dataclass(frozen=True)
class NamedSkipSet:
    """A skip set read from a file; `model` holds the shape it was made for when the file says so."""

    name: str
    attn: tuple[int, ...]
    mlp: tuple[int, ...]
    origin: str  # where it came from, for messages: FILE:NAME
    model: dict[str, Any] | None = None
    # A skipsearch config's trimmed head. A study drafts with its own head of that size, ranked on its own prompts.
    head: DraftHead | None = None

    def skip_set(self, num_layers: int) -> SkipSet:
        """The validated skip set for a model of `num_layers` layers; ValueError naming the origin if it does not fit."""
        try:
            return SkipSet.of(self.attn, self.mlp, num_layers, self.head)
        except ValueError as error:
            raise ValueError(f"warm start {self.origin}: {error} (the model has {num_layers} layers)") from None

    def matches(self, model: ModelInfo) -> bool:
        """Whether it was made for a model of `model`'s architecture, layer count and hidden size."""
        return self.model is not None and all(self.model.get(key) == getattr(model, key) for key in MODEL_SHAPE)


def parse_skip_sets(data: Any, source: str) -> list[NamedSkipSet]:
    """The skip sets of a parsed JSON document: one for a skipsearch config, every entry of a D&V/SWIFT file."""
    if isinstance(data, dict) and data.get("format") == CONFIG_FORMAT:
        config = parse_skip_config(data, source=source)
        stem, several = Path(source).stem, len(config.entries) > 1
        names = [entry.label or f"{stem}[{i}]" if several else stem for i, entry in enumerate(config.entries)]
        return [NamedSkipSet(name, entry.skip.attn, entry.skip.mlp, f"{source}:{name}" if several else source,
                             vars(config.model).copy(), entry.skip.head) for name, entry in zip(names, config.entries)]
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{source}: expected a skipsearch skip config or {{\"<name>\": {{\"attention\": [...], "
                         "\"mlp\": [...]}}}")
    sets = []
    for name, entry in data.items():
        origin = f"{source}:{name}"
        if not isinstance(entry, dict) or not isinstance(entry.get("attention"), list) \
                or not isinstance(entry.get("mlp"), list):
            raise ValueError(f"{origin}: expected {{\"attention\": [...], \"mlp\": [...]}}")
        try:
            skip = SkipSet.of(entry["attention"], entry["mlp"])  # integers, no duplicates; range checked later
        except ValueError as error:
            raise ValueError(f"{origin}: {error}") from None
        model = entry.get("model") if isinstance(entry.get("model"), dict) else None
        sets.append(NamedSkipSet(name, skip.attn, skip.mlp, origin, model))
    return sets


def read_warm_starts(spec: str) -> list[NamedSkipSet]:
    """`FILE` (every skip set in it) or `FILE:NAME` (one entry); ValueError with one line when it cannot be read."""
    path, name = Path(spec), None
    if not path.is_file() and ":" in spec:
        head, tail = spec.rsplit(":", 1)
        path, name = Path(head), tail
    sets = parse_skip_sets(read_json(path, "warm-start file"), str(path))
    if name is None:
        return sets
    chosen = [s for s in sets if s.name == name]
    if not chosen:
        raise ValueError(f"warm-start file {str(path)!r} has no entry {name!r}: it has {', '.join(s.name for s in sets)}")
    return chosen


def dv_json(name: str, skip: SkipSet) -> dict[str, dict[str, list[int]]]:
    """`skip` in the Draft & Verify / SWIFT format, under `name`."""
    return {name: {"attention": list(skip.attn), "mlp": list(skip.mlp)}}


def dv_name(model: ModelInfo) -> str:
    """The entry name D&V and SWIFT use: the model's name, lower-case, without its organisation or folder."""
    return Path(model.name_or_path.rstrip("/")).name.removesuffix(".gguf").lower() or "model"


def outside_space(skip: SkipSet, space: Any) -> str | None:
    """Why a search space (`search.SearchSpace`) cannot propose `skip`, or None when it can."""
    allowed = set(space.sublayers())
    fixed = [f"{kind} {i}" for kind, ids in (("attn", skip.attn), ("mlp", skip.mlp)) for i in ids
             if (kind, i) not in allowed]
    if fixed:
        return (f"it skips {', '.join(fixed)}, which the search keeps (first and last layers): "
                "add --allow-first-last")
    if skip.head is not None and skip.head.rows not in space.head_rows:
        return (f"it drafts with a head of {skip.head.rows} rows, a size the search does not try "
                f"({', '.join(map(str, space.head_rows)) or 'the full head only'}): add it to --head-rows")
    if skip.size > space.max_skipped:
        return (f"it skips {skip.size} sublayers, more than --max-skip-fraction allows ({space.max_skipped}): "
                "raise --max-skip-fraction")
    return None
