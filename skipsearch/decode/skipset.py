"""A skip set: which decoder layers' attention and MLP sublayers a draft skips. A plain value, with no torch, so that
configs, studies, plots and the command line carry it without importing the draft path (skipping.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SkipSet:
    """0-based decoder-layer ids whose attention / MLP the draft skips (sorted, unique)."""

    attn: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()

    @classmethod
    def of(cls, attn: Iterable[int] = (), mlp: Iterable[int] = (), num_layers: int | None = None) -> SkipSet:
        """Build a validated skip set; `num_layers` bounds the ids when given."""
        return cls(_layer_ids(attn, "attn", num_layers), _layer_ids(mlp, "mlp", num_layers))

    @property
    def size(self) -> int:
        return len(self.attn) + len(self.mlp)

    def skipped_fraction(self, num_layers: int) -> float:
        return self.size / (2 * num_layers)

    def check_fits(self, num_layers: int) -> None:
        """Raise ValueError if an id does not name one of `num_layers` layers."""
        SkipSet.of(self.attn, self.mlp, num_layers)

    def as_dict(self) -> dict[str, list[int]]:
        return {"attn": list(self.attn), "mlp": list(self.mlp)}

    def __str__(self) -> str:
        return f"attn={list(self.attn)} mlp={list(self.mlp)}"


def _layer_ids(ids: Iterable[int], kind: str, num_layers: int | None) -> tuple[int, ...]:
    ids = list(ids)
    for i in ids:
        # bool is an int subclass; True as a layer id is a bug, not layer 1.
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"{kind} skip ids must be integers, got {i!r}")
        if i < 0 or (num_layers is not None and i >= num_layers):
            bound = f"0..{num_layers - 1}" if num_layers is not None else ">= 0"
            raise ValueError(f"{kind} skip id {i} is out of range: layer ids are {bound}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{kind} skip ids contain duplicates: {ids}")
    return tuple(sorted(ids))
