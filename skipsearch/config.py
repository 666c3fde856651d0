"""The skip-config JSON (format version 1): what a search exports and inference loads."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from .files import read_json, write_atomic
from .policy import DraftPolicy
from .skipping import SkipSet, decoder_layers

FORMAT = "skipsearch/skip-config"
VERSION = 1
MODEL_SHAPE = ("architecture", "num_hidden_layers", "hidden_size")  # what a config, a warm start or a study is for


@dataclass(frozen=True)
class ModelInfo:
    name_or_path: str
    architecture: str
    num_hidden_layers: int
    hidden_size: int

    @classmethod
    def of(cls, model: nn.Module, name_or_path: str) -> ModelInfo:
        return cls(
            name_or_path=name_or_path,
            architecture=type(model).__name__,
            num_hidden_layers=len(decoder_layers(model)),
            hidden_size=int(model.config.hidden_size),
        )


@dataclass
class SkipConfig:
    model: ModelInfo
    skip: SkipSet
    draft: DraftPolicy = field(default_factory=DraftPolicy)
    metrics: dict[str, Any] = field(default_factory=dict)
    search: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": vars(self.model).copy(),
            "skip": self.skip.as_dict(),
            "draft": {
                "max_draft_tokens": self.draft.max_draft_tokens,
                "confidence_threshold": self.draft.confidence_threshold,
                "adaptive": self.draft.adaptive,
                "target_acceptance": self.draft.target_acceptance,
                "threshold_step": self.draft.threshold_step,
                "stop_rule": self.draft.stop_rule,
                "guard": self.draft.guard,
            },
            "metrics": self.metrics,
            "search": self.search,
        }

    def check_model(self, model: nn.Module) -> None:
        """Raise ValueError unless this config was made for a model of `model`'s shape (TypeError for no model)."""
        from .inputs import check_model

        check_model(model)
        actual = ModelInfo.of(model, self.model.name_or_path)
        for name in MODEL_SHAPE:
            want, have = getattr(self.model, name), getattr(actual, name)
            if want != have:
                raise ValueError(
                    f"skip config is for a model with {name}={want!r}, but the loaded model has {name}={have!r} "
                    f"(config made for {self.model.name_or_path!r})"
                )


def save_skip_config(config: SkipConfig, path: str | Path) -> None:
    write_atomic(path, json.dumps(config.to_json(), indent=2) + "\n")


def load_skip_config(path: str | Path, model: nn.Module | None = None) -> SkipConfig:
    """Read a skip config; with `model`, also check it was made for this model's architecture and size."""
    path = Path(path)
    config = parse_skip_config(read_json(path, "skip config"), source=str(path))
    if model is not None:
        config.check_model(model)
    return config


def parse_skip_config(data: Any, source: str = "skip config") -> SkipConfig:
    def need(mapping: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
        if not isinstance(mapping, dict) or key not in mapping:
            raise ValueError(f"{source}: missing {where}{key!r}")
        value = mapping[key]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise ValueError(f"{source}: {where}{key!r} has the wrong type ({type(value).__name__})")
        return value

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        if isinstance(data, dict) and data and all(isinstance(v, dict) and {"attention", "mlp"} <= v.keys()
                                                   for v in data.values()):
            raise ValueError(f"{source}: a Draft & Verify / SWIFT skip file (as `export --format dv` writes), not a "
                             "skipsearch skip config: give the JSON `export` writes by default, or pass this one to "
                             "`optimize --warm-start`")
        raise ValueError(f"{source}: not a skipsearch skip config (expected \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise ValueError(f"{source}: unsupported version {data.get('version')!r} (this skipsearch reads version {VERSION})")
    model = need(data, "model", dict, "")
    info = ModelInfo(
        name_or_path=need(model, "name_or_path", str, "model."),
        architecture=need(model, "architecture", str, "model."),
        num_hidden_layers=need(model, "num_hidden_layers", int, "model."),
        hidden_size=need(model, "hidden_size", int, "model."),
    )
    skip_data = need(data, "skip", dict, "")
    attn, mlp = need(skip_data, "attn", list, "skip."), need(skip_data, "mlp", list, "skip.")
    draft_data = data.get("draft", {})
    if not isinstance(draft_data, dict):
        raise ValueError(f"{source}: 'draft' has the wrong type ({type(draft_data).__name__}), expected an object")
    for key in ("metrics", "search"):
        if not isinstance(data.get(key, {}), dict):
            raise ValueError(f"{source}: {key!r} has the wrong type ({type(data[key]).__name__}), expected an object")
    defaults = DraftPolicy()

    def draft_field(key: str, kind: type | tuple[type, ...]) -> Any:
        return need(draft_data, key, kind, "draft.") if key in draft_data else getattr(defaults, key)

    try:
        skip = SkipSet.of(attn, mlp, info.num_hidden_layers)
        draft = DraftPolicy(
            max_draft_tokens=draft_field("max_draft_tokens", int),
            adaptive=draft_field("adaptive", bool),
            confidence_threshold=float(draft_field("confidence_threshold", (int, float))),
            target_acceptance=float(draft_field("target_acceptance", (int, float))),
            threshold_step=float(draft_field("threshold_step", (int, float))),
            stop_rule=draft_field("stop_rule", str),
            guard=draft_field("guard", bool),
        )
    except (TypeError, ValueError) as error:
        message = str(error)
        raise ValueError(message if message.startswith(source) else f"{source}: {message}") from None
    return SkipConfig(model=info, skip=skip, draft=draft, metrics=data.get("metrics", {}), search=data.get("search", {}))
