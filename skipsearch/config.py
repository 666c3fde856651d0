"""The skip-config JSON (format version 1): what a search exports and inference loads."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from .decoding import DraftPolicy
from .skipping import SkipSet, decoder_layers

FORMAT = "skipsearch/skip-config"
VERSION = 1


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
            },
            "metrics": self.metrics,
            "search": self.search,
        }

    def check_model(self, model: nn.Module) -> None:
        """Raise ValueError unless this config was made for a model of `model`'s shape (TypeError for no model)."""
        from .inputs import check_model

        check_model(model)
        actual = ModelInfo.of(model, self.model.name_or_path)
        for name in ("architecture", "num_hidden_layers", "hidden_size"):
            want, have = getattr(self.model, name), getattr(actual, name)
            if want != have:
                raise ValueError(
                    f"skip config is for a model with {name}={want!r}, but the loaded model has {name}={have!r} "
                    f"(config made for {self.model.name_or_path!r})"
                )


def follow_umask(path: str | Path) -> None:
    """Give a file from mkstemp (0600) or a folder from mkdtemp (0700) the mode open() / mkdir() would give:
    0666 / 0777 less the umask, so that renamed-into-place outputs are as readable as any other file."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        follow_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_skip_config(config: SkipConfig, path: str | Path) -> None:
    write_atomic(path, json.dumps(config.to_json(), indent=2) + "\n")


def read_json(path: str | Path, what: str, lines: bool = False) -> Any:
    """A JSON file's content, or with `lines` a JSON Lines file's: a list of (line number, value), blank lines
    left out. A missing, unreadable, malformed or hostile file (nested past Python's recursion limit) is a
    ValueError of one line that names `what`, the file and, in JSON Lines, the line."""
    name = repr(str(path))
    if Path(path).is_dir():
        raise ValueError(f"{what} {name} is a folder: give a file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{what} {name} does not exist") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} {name} is not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise ValueError(f"cannot read {what} {name}: {error.strerror or error}") from None
    if not lines:
        return _parse_json(text, f"{what} {name}")
    return [(number, _parse_json(line, f"{what} {name}, line {number}"))
            for number, line in enumerate(text.splitlines(), start=1) if line.strip()]


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        place = f"column {error.colno}" if "\n" not in text.strip() else f"line {error.lineno} column {error.colno}"
        raise ValueError(f"{where}: not valid JSON ({error.msg} at {place})") from None
    except RecursionError:  # json's C decoder recurses once per level: a hostile or damaged file
        raise ValueError(f"{where}: nested too deeply to read (over {sys.getrecursionlimit()} levels of arrays or "
                         "objects; damaged, or not the file meant)") from None


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
        )
    except (TypeError, ValueError) as error:
        message = str(error)
        raise ValueError(message if message.startswith(source) else f"{source}: {message}") from None
    return SkipConfig(model=info, skip=skip, draft=draft, metrics=data.get("metrics", {}), search=data.get("search", {}))
