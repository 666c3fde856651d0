"""The skip-config JSON: what a search exports and inference loads.

Version 1 carries one skip set ("skip", with its "metrics"); version 2 several ("skips": a list of {"label", "skip",
"metrics"}, e.g. the best set per dataset of a study of several), among which decoding chooses one per prompt
(choice.py). A config of one unlabelled set is written as version 1, which every release reads. Each set's "metrics"
and the config's "search" say where the sets came from (provenance.py); decoding reads neither.

A skip set whose draft reads a trimmed LM head carries it as "head" beside "attn" and "mlp" (`DraftHead.to_json`: its
ids as a deflated bitmap over the vocabulary, their count and sha256), and the model's "vocab_size" and "tokenizer"
(a fingerprint of its vocabulary) say what the ids mean: a config is refused for a model of another vocabulary size,
and, where the tokenizer is at hand, for another tokenizer. Configs without them load as before.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch import nn

from ..io.files import json_matches, json_type, read_json, write_atomic
from .policy import DEPRECATED_FIELDS, DraftPolicy, deprecation
from .provenance import ConfigMetrics, ConfigSearch, known_fields
from .skipping import check_model, supported_layers
from . import adapter
from .skipset import DraftHead, SkipSet

FORMAT = "skipsearch/skip-config"
VERSIONS = (1, 2)
MODEL_SHAPE = ("architecture", "num_hidden_layers", "hidden_size")  # what a config, a warm start or a study is for


@dataclass(frozen=True)
class ModelInfo:
    name_or_path: str
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int | None = None  # the LM head's rows (configs before trimmed heads: None)
    tokenizer: str | None = None  # `tokenizer_fingerprint` of the tokenizer the study encoded with (None: unknown)

    @classmethod
    def of(cls, model: nn.Module, name_or_path: str, tokenizer: Any = None) -> ModelInfo:
        return cls(
            name_or_path=name_or_path,
            architecture=type(model).__name__,
            num_hidden_layers=len(supported_layers(model)),
            hidden_size=int(model.config.hidden_size),
            vocab_size=int(adapter.output_head(model)[1].shape[0]),
            tokenizer=None if tokenizer is None else tokenizer_fingerprint(tokenizer),
        )

    def to_json(self) -> dict[str, Any]:
        return known_fields(self)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary (each token and its id): the same for the same token ids, whatever folder
    or format the tokenizer was read from."""
    pairs = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()


def skip_json(skip: SkipSet, vocab_size: int | None) -> dict[str, Any]:
    """A skip set as a config carries it: its sublayers, and its head's ids where trimmed."""
    out: dict[str, Any] = {"attn": list(skip.attn), "mlp": list(skip.mlp)}
    if skip.head is not None:
        out["head"] = skip.head.to_json(vocab_size or max(skip.head.ids) + 1)
    return out


@dataclass(frozen=True)
class SkipEntry:
    """One skip set of a config: what it skips, what it was chosen on (e.g. a dataset; None: unsaid), its figures."""

    skip: SkipSet
    label: str | None = None
    metrics: ConfigMetrics = field(default_factory=ConfigMetrics)

    def to_json(self, vocab_size: int | None = None) -> dict[str, Any]:
        return {"label": self.label, "skip": skip_json(self.skip, vocab_size), "metrics": self.metrics.to_json()}


@dataclass
class SkipConfig:
    """A skip set (`skip`, its `metrics`) with the draft policy to decode with, or several sets: `skip` is then the
    first, `label` what it was chosen on, and `others` the rest (`entries` lists them all)."""

    model: ModelInfo
    skip: SkipSet
    draft: DraftPolicy = field(default_factory=DraftPolicy)
    metrics: ConfigMetrics = field(default_factory=ConfigMetrics)
    search: ConfigSearch = field(default_factory=ConfigSearch)
    label: str | None = None
    others: tuple[SkipEntry, ...] = ()

    @classmethod
    def of_entries(cls, model: ModelInfo, entries: Sequence[SkipEntry], draft: DraftPolicy,
                   search: ConfigSearch = ConfigSearch()) -> SkipConfig:
        first, *others = entries
        return cls(model=model, skip=first.skip, draft=draft, metrics=first.metrics, search=search,
                   label=first.label, others=tuple(others))

    @property
    def entries(self) -> tuple[SkipEntry, ...]:
        """Every skip set of the config, the first first."""
        return (SkipEntry(self.skip, self.label, self.metrics), *self.others)

    @property
    def skip_sets(self) -> tuple[SkipSet, ...]:
        return tuple(entry.skip for entry in self.entries)

    def to_json(self) -> dict[str, Any]:
        several = bool(self.others) or self.label is not None
        return {
            "format": FORMAT,
            "version": 2 if several else 1,
            "model": self.model.to_json(),
            **({"skips": [entry.to_json(self.model.vocab_size) for entry in self.entries]} if several
               else {"skip": skip_json(self.skip, self.model.vocab_size)}),
            "draft": self.draft.as_dict(),
            **({} if several else {"metrics": self.metrics.to_json()}),
            "search": self.search.to_json(),
        }

    def check_model(self, model: nn.Module) -> None:
        """Raise ValueError unless this config was made for a model of `model`'s shape (TypeError for no model)."""
        check_model(model)
        actual = ModelInfo.of(model, self.model.name_or_path)
        heads = [skip.head for skip in self.skip_sets if skip.head is not None]
        for name in (*MODEL_SHAPE, *(("vocab_size",) if heads and self.model.vocab_size is not None else ())):
            want, have = getattr(self.model, name), getattr(actual, name)
            if want != have:
                raise ValueError(
                    f"skip config is for a model with {name}={want!r}, but the loaded model has {name}={have!r} "
                    f"(config made for {self.model.name_or_path!r})"
                )
        for head in heads:
            head.check_fits(actual.vocab_size)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise ValueError where a trimmed head's ids were chosen with another tokenizer than `tokenizer` (a config
        that names none, or has no trimmed head, fits any)."""
        if self.model.tokenizer is None or all(skip.head is None for skip in self.skip_sets):
            return
        if tokenizer_fingerprint(tokenizer) != self.model.tokenizer:
            raise ValueError(f"skip config's draft head was made for another tokenizer than the loaded model's "
                             f"(config made for {self.model.name_or_path!r}): its token ids would name other tokens")


def save_skip_config(config: SkipConfig, path: str | Path) -> None:
    write_atomic(path, json.dumps(config.to_json(), indent=2) + "\n")


def load_skip_config(path: str | Path, model: nn.Module | None = None, tokenizer: Any = None) -> SkipConfig:
    """Read a skip config; with `model`, also check it was made for this model's architecture and size (and
    vocabulary, for a trimmed head); with `tokenizer`, that a trimmed head's ids are this tokenizer's."""
    path = Path(path)
    config = parse_skip_config(read_json(path, "skip config"), source=str(path))
    try:
        if model is not None:
            config.check_model(model)
        if tokenizer is not None:
            config.check_tokenizer(tokenizer)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    return config


def combine_skip_configs(configs: Sequence[SkipConfig], sources: Sequence[str] | None = None,
                         same_draft: bool = True) -> SkipConfig:
    """One config carrying the skip sets of all `configs` (made for one model shape and vocabulary, drafting alike
    unless not `same_draft`: the caller gives the policy decoding uses), for decoding to choose among per prompt; a
    set given twice is kept once. A set without a label is labelled with its config's source (its file, say) when
    `sources` are given. The combined config knows the vocabulary and tokenizer any of them knows, so that its
    checks are every config's."""
    names = list(sources) if sources is not None else [f"config {i + 1}" for i in range(len(configs))]
    first = configs[0]
    for config, name in zip(configs[1:], names[1:]):
        for key in (*MODEL_SHAPE, "vocab_size", "tokenizer"):  # the last two: None where unknown, which fits any
            mine, theirs = getattr(first.model, key), getattr(config.model, key)
            if mine != theirs and (key in MODEL_SHAPE or None not in (mine, theirs)):
                shown = (mine, theirs) if key != "tokenizer" else ("a tokenizer", "another (its vocabulary's hash)")
                raise ValueError(f"skip configs {names[0]} and {name} are for different models ({key}="
                                 f"{shown[0]!r} and {shown[1]!r})")
        if same_draft and config.draft != first.draft:
            raise ValueError(f"skip configs {names[0]} and {name} draft differently ({first.draft} and "
                             f"{config.draft}): decoding drafts with one policy (give it as policy=...)")
    known = {key: next((getattr(c.model, key) for c in configs if getattr(c.model, key) is not None), None)
             for key in ("vocab_size", "tokenizer")}
    entries: dict[SkipSet, SkipEntry] = {}
    for config, name in zip(configs, names if sources is not None else [None] * len(configs)):
        for entry in config.entries:
            entries.setdefault(entry.skip, replace(entry, label=entry.label or name))
    return SkipConfig.of_entries(replace(first.model, **known), list(entries.values()), first.draft, first.search)


def _need(mapping: Any, key: str, kind: Any, where: str, source: str) -> Any:
    """`mapping[key]`, refused in one line where it is missing or not of the type `kind`."""
    if not isinstance(mapping, dict) or key not in mapping:
        raise ValueError(f"{source}: missing {where}{key!r}")
    value = mapping[key]
    if not json_matches(value, kind):
        raise ValueError(f"{source}: {where}{key!r} has the wrong type ({type(value).__name__}), expected "
                         f"{json_type(kind)}")
    return value


def _object_or_empty(mapping: dict, key: str) -> Any:
    """An optional object of what the config says of itself: an empty one where it is absent or null (unknown either
    way); its type is its reader's to check."""
    value = mapping.get(key)
    return {} if value is None else value


def _skip_set(mapping: Any, where: str, num_layers: int, source: str) -> SkipSet:
    attn, mlp = _need(mapping, "attn", list, where, source), _need(mapping, "mlp", list, where, source)
    try:
        head = DraftHead.from_json(mapping["head"]) if mapping.get("head") is not None else None
    except ValueError as error:
        raise ValueError(f"{source}: {where}head: {error}") from None
    try:
        return SkipSet.of(attn, mlp, num_layers, head)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


def _entries(data: dict, num_layers: int, source: str) -> list[SkipEntry]:
    """The config's skip sets: version 1's one ("skip" and "metrics"), version 2's list ("skips")."""
    if data["version"] == 1:
        skip = _skip_set(_need(data, "skip", dict, "", source), "skip.", num_layers, source)
        return [SkipEntry(skip, None, ConfigMetrics.from_json(_object_or_empty(data, "metrics"), "metrics", source))]
    listed = _need(data, "skips", list, "", source)
    if not listed:
        raise ValueError(f"{source}: 'skips' is empty: a config carries at least one skip set")
    entries = []
    for i, item in enumerate(listed):
        where = f"skips[{i}]."
        if not isinstance(item, dict):
            raise ValueError(f"{source}: skips[{i}] has the wrong type ({type(item).__name__}), expected an object")
        label = item.get("label")
        if label is not None and not isinstance(label, str):
            raise ValueError(f"{source}: {where}'label' has the wrong type ({type(label).__name__}), expected text")
        skip = _skip_set(_need(item, "skip", dict, where, source), f"{where}skip.", num_layers, source)
        if any(entry.skip == skip for entry in entries):
            raise ValueError(f"{source}: skips[{i}] repeats an earlier skip set ({skip})")
        metrics = ConfigMetrics.from_json(_object_or_empty(item, "metrics"), f"{where}metrics", source)
        entries.append(SkipEntry(skip, label, metrics))
    return entries


def parse_skip_config(data: Any, source: str = "skip config") -> SkipConfig:
    def need(mapping: Any, key: str, kind: Any, where: str) -> Any:
        return _need(mapping, key, kind, where, source)

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        if isinstance(data, dict) and data and all(isinstance(v, dict) and {"attention", "mlp"} <= v.keys()
                                                   for v in data.values()):
            raise ValueError(f"{source}: a Draft & Verify / SWIFT skip file (as `export --format dv` writes), not a "
                             "skipsearch skip config: give the JSON `export` writes by default, or pass this one to "
                             "`optimize --warm-start`")
        raise ValueError(f"{source}: not a skipsearch skip config (expected \"format\": \"{FORMAT}\")")
    if data.get("version") is None:
        raise ValueError(f"{source}: missing 'version' (this skipsearch reads versions {' and '.join(map(str, VERSIONS))})")
    if data["version"] not in VERSIONS or isinstance(data["version"], bool):
        raise ValueError(f"{source}: unsupported version {data.get('version')!r} (this skipsearch reads versions "
                         f"{' and '.join(map(str, VERSIONS))})")
    model = need(data, "model", dict, "")
    info = ModelInfo(
        name_or_path=need(model, "name_or_path", str, "model."),
        architecture=need(model, "architecture", str, "model."),
        num_hidden_layers=need(model, "num_hidden_layers", int, "model."),
        hidden_size=need(model, "hidden_size", int, "model."),
        vocab_size=need(model, "vocab_size", int, "model.") if model.get("vocab_size") is not None else None,
        tokenizer=need(model, "tokenizer", str, "model.") if model.get("tokenizer") is not None else None,
    )
    entries = _entries(data, info.num_hidden_layers, source)
    draft_data = data.get("draft", {})  # null is refused: it would decode with defaults nobody chose
    if not isinstance(draft_data, dict):
        raise ValueError(f"{source}: 'draft' has the wrong type ({type(draft_data).__name__}), expected an object")
    search = ConfigSearch.from_json(_object_or_empty(data, "search"), "search", source)
    defaults = DraftPolicy()

    def draft_field(key: str, kind: Any) -> Any:
        return need(draft_data, key, kind, "draft.") if key in draft_data else getattr(defaults, key)

    old = [key for key in DEPRECATED_FIELDS if key in draft_data]
    if old:  # every export of format 1 and 2 before issue 27 has them
        warnings.warn(deprecation([f"draft.{key}" for key in old], f"{source}:"), FutureWarning, stacklevel=2)
    try:
        draft = DraftPolicy(max_draft_tokens=draft_field("max_draft_tokens", int),
                            adaptive=draft_field("adaptive", bool), guard=draft_field("guard", bool))
    except (TypeError, ValueError) as error:
        message = str(error)
        raise ValueError(message if message.startswith(source) else f"{source}: {message}") from None
    return SkipConfig.of_entries(info, entries, draft, search)
