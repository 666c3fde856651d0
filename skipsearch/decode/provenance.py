"""What a skip config says of where its skip sets came from: the figures each was measured at (`ConfigMetrics`) and
the search that chose them (`ConfigSearch`).

Both are informational: decoding reads neither. In the JSON each is an object of optional fields, written only where
known (null and absent read alike, as in the study label), so that configs of every release load; a field of the
wrong type is refused in one line, and a field this release does not know is ignored.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any, get_type_hints

from ..io.files import json_matches, json_type


@dataclass(frozen=True)
class BestSkipping:
    """In a "skip nothing" export, the fastest skip set the confirmation measured, which did not pay: its trial, its
    sublayers and head size (a config carries the exported head's ids alone), and its figures."""

    trial: int
    attn: tuple[int, ...]
    mlp: tuple[int, ...]
    head_rows: int | None
    figures: ConfigMetrics

    def to_json(self) -> dict[str, Any]:
        skip: dict[str, Any] = {"attn": list(self.attn), "mlp": list(self.mlp)}
        if self.head_rows is not None:
            skip["head_rows"] = self.head_rows
        return {**self.figures.to_json(), "trial": self.trial, "skip": skip}

    @classmethod
    def from_json(cls, data: Any, where: str, source: str) -> BestSkipping:
        if not (isinstance(data, dict) and json_matches(data.get("trial"), int) and isinstance(data.get("skip"), dict)):
            raise ValueError(f"{source}: {_quoted(where)} is not a trial with a skip set")
        skip = data["skip"]
        sublayers = {kind: skip.get(kind, []) for kind in ("attn", "mlp")}
        if not all(json_matches(layers, list[int]) for layers in sublayers.values()):
            raise ValueError(f"{source}: {where}.skip has the wrong type (expected lists of layer indices)")
        if not json_matches(skip.get("head_rows"), int | None):
            raise ValueError(f"{source}: {where}.skip.'head_rows' has the wrong type (expected a row count)")
        figures = {k: v for k, v in data.items() if k not in ("trial", "skip")}
        return cls(data["trial"], tuple(sublayers["attn"]), tuple(sublayers["mlp"]), skip.get("head_rows"),
                   ConfigMetrics.from_json(figures, where, source))


@dataclass(frozen=True)
class ConfigMetrics:
    """A skip set's figures: the objective and its score, the speedup over plain decoding with its interval, the
    acceptance, and the verdict that says whether the set pays. Unknown figures are None."""

    objective: str | None = None
    score: float | None = None
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    paired_runs: int | None = None
    acceptance_rate: float | None = None
    tokens_per_second: float | None = None
    baseline_tokens_per_second: float | None = None
    mean_accepted_tokens: float | None = None
    predicted_speedup: float | None = None
    predicted_speedup_low: float | None = None
    predicted_speedup_high: float | None = None
    # Whether the export rests on the confirmation (the sets measured again, with more paired runs, after the
    # search): the set it exports passed it, or plain decoding is exported because the sets confirmed did not.
    confirmed: bool | None = None
    verdict: str | None = None
    trial: int | None = None  # the trial that found the set, where a config carries several
    best_skipping: BestSkipping | None = None

    def to_json(self) -> dict[str, Any]:
        out = known_fields(self)
        if self.best_skipping is not None:
            out["best_skipping"] = self.best_skipping.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any, where: str, source: str) -> ConfigMetrics:
        """The metrics in the JSON object `data`, found at the path `where` in `source` (both for errors)."""
        values = _read(cls, data, where, source, nested=("best_skipping",))
        if data.get("best_skipping") is not None:
            values["best_skipping"] = BestSkipping.from_json(data["best_skipping"], f"{where}.best_skipping", source)
        return cls(**values)


@dataclass(frozen=True)
class ConfigSearch:
    """How the study that chose a config's skip sets searched: its name, the trial exported (None: the study's
    decision), its sampler, prompts and device; a config of one study per category also names each one's study."""

    study_name: str | None = None
    trial_number: int | None = None
    sampler: str | None = None
    dataset: str | list[str] | None = None  # a list: a study of several datasets
    num_prompts: int | None = None  # the prompts its studies decoded: of every dataset, of every category
    max_new_tokens: int | None = None
    device: str | None = None
    device_name: str | None = None
    dtype: str | None = None
    predicted_for: str | None = None  # a modeled study's: the device its cost profile prices, whose figures these are
    confirm_repeats: int | None = None
    created_at: str | None = None  # when the config was exported, ISO 8601 in UTC
    categories: list[str] | None = None
    seen_prompts: list[str] | None = None  # digests of the prompts its studies decoded or ranked a head on (bench)
    category_studies: dict[str, str | None] | None = None

    def to_json(self) -> dict[str, Any]:
        return known_fields(self)

    @classmethod
    def from_json(cls, data: Any, where: str, source: str) -> ConfigSearch:
        return cls(**_read(cls, data, where, source))


def known_fields(record: Any) -> dict[str, Any]:
    """A dataclass's fields that are not None, as JSON values: copies of its lists and mappings, since a frozen record
    must not change through its JSON (nested records are each class's to write)."""
    values = {f.name: getattr(record, f.name) for f in fields(record)}
    return {name: copy.copy(value) for name, value in values.items()
            if value is not None and not isinstance(value, BestSkipping)}


def _read(cls: type, data: Any, where: str, source: str, nested: tuple[str, ...] = ()) -> dict[str, Any]:
    """`cls`'s fields found in the JSON object `data`, each checked against its type (`nested` ones are left to the
    caller); `where` is the object's path in errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: {_quoted(where)} has the wrong type ({type(data).__name__}), expected an object")
    hints = get_type_hints(cls)
    values = {}
    for f in fields(cls):
        value = data.get(f.name)
        if value is None or f.name in nested:
            continue
        if not json_matches(value, hints[f.name]):
            raise ValueError(f"{source}: {where}.{f.name!r} has the wrong type ({type(value).__name__}), expected "
                             f"{json_type(hints[f.name])}")
        values[f.name] = value
    return values


def _quoted(path: str) -> str:
    """A JSON path as the config's errors name a key: its last part quoted (`skips[1].'metrics'`)."""
    parent, _, key = path.rpartition(".")
    return f"{parent}.{key!r}" if parent else repr(key)
