"""Skip attention and MLP sublayers of a Hugging Face causal LM while drafting.

Nothing of transformers' modeling code is copied. For each skip set a list of thin layer
wrappers is built once: a layer whose attention is skipped runs `h + mlp(norm(h))`, one whose
MLP is skipped `h + attn(norm(h))`, one with both skipped is the identity, and the others are
the original layers. A skipped sublayer thus costs one op (or none), and the norm that feeds
only it is skipped with it. `draft_model` gives a view of the model that shares every
parameter and runs the draft path, so nothing is swapped per round; `draft_mode` puts the
wrappers in the decoder for callers that run `model(...)` directly (one attribute set, restored
on exit). The original model is never changed outside `draft_mode`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from . import adapter
from .adapter import decoder_layers  # re-exported: callers of the draft path import it from here


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


@dataclass(frozen=True)
class LayerLayout:
    """Names of a decoder layer's sublayers and of the norm that feeds only each of them."""

    attn_norm: str
    attn: str
    mlp_norm: str
    mlp: str


# The only architecture-specific knowledge: pre-norm decoder layers of the Llama family
# (Llama, Mistral, Qwen2, Qwen3, SmolLM) name their parts alike.
LAYOUTS = (LayerLayout("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"),)


def layer_layout(layer: nn.Module) -> LayerLayout:
    for layout in LAYOUTS:
        if all(isinstance(getattr(layer, name, None), nn.Module) for name in vars(layout).values()):
            return layout
    raise ValueError(f"{type(layer).__name__} has no known sublayer layout (expected one of {LAYOUTS})")


class AttentionOnly(nn.Module):
    """A decoder layer with its MLP (and the MLP's norm) skipped."""

    def __init__(self, norm: nn.Module, attn: nn.Module):
        super().__init__()
        self.norm, self.attn = norm, attn

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states + adapter.attention_output(self.attn(self.norm(hidden_states), *args, **kwargs))


class MLPOnly(nn.Module):
    """A decoder layer with its attention (and the attention's norm) skipped: it touches no KV cache."""

    def __init__(self, norm: nn.Module, mlp: nn.Module):
        super().__init__()
        self.norm, self.mlp = norm, mlp

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states + self.mlp(self.norm(hidden_states))


class SkippedLayer(nn.Module):
    """A decoder layer with both sublayers skipped: the residual stream passes through."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


def _draft_cache(model: nn.Module) -> dict:
    """Per-model memo of draft paths, keyed by skip set (kept on the model, so it lives and dies with it)."""
    memo = model.__dict__.get("_skipsearch_drafts")
    if memo is None:
        memo = {}
        object.__setattr__(model, "_skipsearch_drafts", memo)
    return memo


def draft_layers(model: nn.Module, skip: SkipSet) -> nn.ModuleList:
    """The decoder layers of the draft path for `skip`, built once per skip set and model."""
    memo = _draft_cache(model)
    if ("layers", skip) not in memo:
        layers = decoder_layers(model)
        skip.check_fits(len(layers))
        attn, mlp = set(skip.attn), set(skip.mlp)
        built = []
        for i, layer in enumerate(layers):
            parts = layer_layout(layer)
            if i in attn and i in mlp:
                built.append(SkippedLayer())
            elif i in attn:
                built.append(MLPOnly(getattr(layer, parts.mlp_norm), getattr(layer, parts.mlp)))
            elif i in mlp:
                built.append(AttentionOnly(getattr(layer, parts.attn_norm), getattr(layer, parts.attn)))
            else:
                built.append(layer)
        memo[("layers", skip)] = nn.ModuleList(built)
    return memo[("layers", skip)]


def _with_module(parent: nn.Module, name: str, child: nn.Module) -> nn.Module:
    """A shallow copy of `parent` whose submodule `name` is `child`; parameters and hooks stay shared."""
    view = copy.copy(parent)
    view._modules = {**parent._modules, name: child}
    return view


def model_with_layers(model: nn.Module, layers: nn.ModuleList) -> nn.Module:
    """A view of `model` whose decoder runs `layers`: same parameters, the model's own forward."""
    return _with_module(model, adapter.decoder_attribute(model), _with_module(model.get_decoder(), "layers", layers))


def draft_model(model: nn.Module, skip: SkipSet) -> nn.Module:
    """A view of `model` that drafts with `skip` skipped: same parameters, built once per skip set."""
    memo = _draft_cache(model)
    if ("model", skip) not in memo:
        memo[("model", skip)] = model_with_layers(model, draft_layers(model, skip))
    return memo[("model", skip)]


def forget_draft(model: nn.Module, skip: SkipSet) -> None:
    """Drop what `draft_layers` and `draft_model` keep for `skip`, so that a long study's memory stays flat."""
    memo = _draft_cache(model)
    memo.pop(("layers", skip), None)
    memo.pop(("model", skip), None)


@contextlib.contextmanager
def draft_mode(model: nn.Module, skip: SkipSet) -> Iterator[None]:
    """Run `model` itself with the sublayers in `skip` skipped; restores the decoder's layers on exit, also on error."""
    layers = draft_layers(model, skip)
    decoder = model.get_decoder()
    original = decoder.layers
    decoder.layers = layers
    try:
        yield
    finally:
        decoder.layers = original
