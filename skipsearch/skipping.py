"""Skip attention and MLP sublayers of a Hugging Face causal LM while drafting.

Nothing of transformers' modeling code is copied: inside `draft_mode` the skipped
`self_attn` / `mlp` modules of each decoder layer are swapped for parameter-free
stand-ins that add nothing to the residual stream, and the originals are put back on
exit. Outside the context manager the model is untouched (same modules, same state dict).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn


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


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Llama-family causal LM (each with `.self_attn` and `.mlp`)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(
        hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers
    ):
        raise ValueError(
            f"{type(model).__name__} is not a supported decoder: expected decoder layers with "
            "`self_attn` and `mlp` sublayers (Llama, Mistral, Qwen2, SmolLM)"
        )
    return layers


class SkippedAttention(nn.Module):
    """Stands in for a decoder layer's `self_attn`: contributes zero and touches no KV cache."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
        return torch.zeros_like(hidden_states), None


class SkippedMLP(nn.Module):
    """Stands in for a decoder layer's `mlp`: contributes zero."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


@contextlib.contextmanager
def draft_mode(model: nn.Module, skip: SkipSet) -> Iterator[None]:
    """Run `model` with the sublayers in `skip` skipped; restores every module on exit, also on error."""
    layers = decoder_layers(model)
    skip.check_fits(len(layers))
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        # Stand-ins hold no state, so one instance of each kind serves every layer.
        for ids, name, stand_in in ((skip.attn, "self_attn", SkippedAttention()), (skip.mlp, "mlp", SkippedMLP())):
            for i in ids:
                swapped.append((layers[i], name, getattr(layers[i], name)))
                setattr(layers[i], name, stand_in)
        yield
    finally:
        for layer, name, original in reversed(swapped):
            setattr(layer, name, original)
