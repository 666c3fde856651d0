"""Skip attention and feed-forward sublayers of a Hugging Face causal LM while drafting.

Nothing of transformers' modeling code is copied, and no family's layer is rewritten: the draft
path runs each family's own decoder layer, as a shallow copy whose skipped sublayer is a module
that returns zeros in the structure the real one returns (`ZeroAttention`, `ZeroFeedForward`).
So a skipped sublayer adds nothing to the residual stream whatever the layer does around it
(norms before or after it, fused projections, a routed mixture of experts), a skipped attention
reads and writes no KV cache, and skipping costs a `zeros_like`. For the tested layer classes
(`adapter.sublayer_norms`) the norms that touch only a skipped sublayer become identities too:
one before it only fed it, and one after it is checked to map zeros to zeros when the draft path
is built (refused otherwise: a norm with a bias would add it to the residual stream); a layer with
both sublayers skipped is then the identity (`SkippedLayer`). An untested class keeps every norm,
which is correct, only not free.

The draft layers are built once per skip set. `draft_model` gives a view of the model that shares
every parameter and runs the draft path, so nothing is swapped per round; `draft_mode` puts the
draft layers in the decoder for callers that run `model(...)` directly (one attribute set,
restored on exit). The original model is never changed outside `draft_mode`.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import operator
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from transformers import PreTrainedModel

from . import adapter
from .adapter import decoder_layers  # re-exported: callers of the draft path import it from here
from .kvcache import check_layer_types
from .skipset import DraftHead, SkipSet


def supported_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of `model` where it is a decoder the draft path and the cache can run: layers with a
    separable attention and feed-forward block, attention of kinds the cache holds. A one-line ValueError naming the
    family and why for any other."""
    layers = decoder_layers(model)
    check_layer_types(model.config.get_text_config(decoder=True))
    return layers


class ZeroAttention(nn.Module):
    """A skipped attention: returns zeros and no weights, as an attention returns (output, weights); touches no
    KV cache."""

    def forward(self, *args, **kwargs) -> tuple[torch.Tensor, None]:
        return adapter.skipped_attention_output(args[0] if args else kwargs["hidden_states"])


class ZeroFeedForward(nn.Module):
    """A skipped feed-forward block: returns zeros, with `extras` more items where the block itself returns more."""

    def __init__(self, extras: int):
        super().__init__()
        self.extras = extras

    def forward(self, *args, **kwargs):
        return adapter.skipped_feed_forward_output(args[0] if args else kwargs["hidden_states"], self.extras)


class SkippedLayer(nn.Module):
    """A decoder layer with both sublayers skipped: the residual stream passes through."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


_FEED_FORWARD_EXTRAS: dict[type, int] = {}  # by block class: what its forward returns besides its output


def _feed_forward_extras(block: nn.Module, hidden_size: int) -> int:
    if type(block) not in _FEED_FORWARD_EXTRAS:
        _FEED_FORWARD_EXTRAS[type(block)] = adapter.feed_forward_extras(block, hidden_size)
    return _FEED_FORWARD_EXTRAS[type(block)]


def _maps_zeros_to_zeros(norm: nn.Module, hidden_size: int) -> bool:
    parameter = next(norm.parameters(), None)
    zeros = torch.zeros(1, 1, hidden_size, dtype=getattr(parameter, "dtype", None),
                        device=getattr(parameter, "device", None))
    with torch.no_grad():
        return not norm.forward(zeros).any()


def _draft_layer(layer: nn.Module, skip_attn: bool, skip_mlp: bool, hidden_size: int) -> nn.Module:
    """`layer` as the draft runs it: itself where nothing is skipped; else a shallow copy (same parameters) whose
    skipped sublayers return zeros and whose norms that touch only them are identities; the identity where both are
    skipped and the layer's norms are known. ValueError where a norm after a skipped sublayer would add to the
    residual stream what the sublayer did not."""
    if not (skip_attn or skip_mlp):
        return layer
    norms = adapter.sublayer_norms(layer)
    swaps: dict[str, nn.Module] = {}
    for part, skipped in (("attn", skip_attn), ("mlp", skip_mlp)):
        around = getattr(norms, part) if skipped and norms is not None else adapter.SublayerNorms()
        for name in around.after:
            if not _maps_zeros_to_zeros(getattr(layer, name), hidden_size):
                raise ValueError(f"{type(layer).__name__}.{name} maps zeros to non-zeros (a bias?): a skipped {part} "
                                 "would still add that to the residual stream, so it cannot be skipped")
        swaps.update({name: nn.Identity() for name in (*around.before, *around.after)})
    if skip_attn and skip_mlp and norms is not None:
        return SkippedLayer()
    if skip_attn:
        swaps[adapter.ATTENTION] = ZeroAttention()
    if skip_mlp:
        swaps[adapter.FEED_FORWARD] = ZeroFeedForward(
            _feed_forward_extras(getattr(layer, adapter.FEED_FORWARD), hidden_size))
    return _with_modules(layer, swaps)


DRAFT_STEPS_KEPT = 8  # skip sets whose draft paths (and compiled draft steps: engine.py) stay ready by default


class _Memo(collections.OrderedDict):
    """A dict that a copy of its model gets empty, and a saved one not at all: made again from the copy's own layers.
    `structure`: the modules its draft paths copied (`_structure`); `bound` and `pinned`: how many sets' draft paths
    it keeps, least recently used out, and the sets it keeps besides (the engine's current call's: `keep_drafts`)."""

    structure: tuple = ()
    bound: int = DRAFT_STEPS_KEPT
    pinned: set | frozenset = frozenset()

    def __deepcopy__(self, memo) -> _Memo:
        return _Memo()

    def __reduce__(self):  # saved as None (a saved model loads without skipsearch): remade on first use
        return type(None), ()


def _draft_cache(model: nn.Module) -> dict:
    """Per-model memo of draft paths, keyed by skip set (kept on the model, so it lives and dies with it; not copied
    with it: `_Memo`)."""
    memo = model.__dict__.get("_skipsearch_drafts")
    if memo is None:
        memo = _Memo()
        object.__setattr__(model, "_skipsearch_drafts", memo)
    return memo


def _structure(model: nn.Module) -> tuple:
    """The modules the draft paths copy references to: the model's children, its decoder's, its layers and theirs."""
    decoder, layers = model.get_decoder(), decoder_layers(model)
    return (*model._modules.values(), *decoder._modules.values(), *layers,
            *(child for layer in layers for child in layer._modules.values()))


def _current_drafts(model: nn.Module) -> _Memo:
    """The model's memo, emptied of its draft paths where a module they copied was replaced since (a new LM head, norm
    or layer, set by the user): those would draft with the old one. Checked once a call, not once a token."""
    memo, now = _draft_cache(model), _structure(model)
    if len(now) != len(memo.structure) or not all(map(operator.is_, now, memo.structure)):
        forget_drafts(model)
        memo.structure = now
    return memo


def keep_drafts(model: nn.Module, bound: int, pinned: set) -> None:
    """Keep the draft paths of the `bound` latest skip sets of `model` and of those in `pinned` (the engine's set of
    its current call's sets, read as it changes); frees older ones at once."""
    memo = _draft_cache(model)
    memo.bound, memo.pinned = bound, pinned
    _trim(memo)


def _trim(memo: _Memo, new: tuple | None = None) -> None:
    """Drop the least recently used sets' draft paths past the bound, none of the pinned sets' nor `new` (a trimmed
    head goes with the last path that drafts with it: `trimmed_head`)."""
    for kind, pinned in (("layers", {skip.sublayers for skip in memo.pinned}), ("model", memo.pinned)):
        keys = [key for key in memo if isinstance(key, tuple) and key[0] == kind]
        for key in [key for key in keys if key[1] not in pinned and key != new][: max(0, len(keys) - memo.bound)]:
            del memo[key]


def draft_layers(model: nn.Module, skip: SkipSet) -> nn.ModuleList:
    """The decoder layers of the draft path for `skip`, built once per set of skipped sublayers and model."""
    memo, skip = _current_drafts(model), skip.sublayers
    if ("layers", skip) not in memo:
        layers = supported_layers(model)
        skip.check_fits(len(layers))
        hidden_size = model.config.get_text_config(decoder=True).hidden_size
        memo[("layers", skip)] = nn.ModuleList(_draft_layer(layer, i in skip.attn, i in skip.mlp, hidden_size)
                                               for i, layer in enumerate(layers))
        _trim(memo, ("layers", skip))
    memo.move_to_end(("layers", skip))
    return memo[("layers", skip)]


def head_source(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What a copy of the LM head (a trimmed draft head, the packed verification head) is made from: the weight's and
    bias's memory, dtype and in-place version. A copy whose source no longer matches the model's head holds weights
    the model no longer has (loaded or trained in place, cast, moved) and is made again."""
    return tuple(None if tensor is None else
                 (tensor.data_ptr(), tensor.dtype, tensor.device, None if tensor.is_inference() else tensor._version)
                 for tensor in (weight, bias))


class TrimmedHead(nn.Module):
    """The LM head over a draft head's rows: their weights gathered once into one contiguous matrix (rows x hidden),
    logits computed for them alone and written at their token ids; every other token gets the dtype's lowest finite
    value (a family's soft cap maps it to minus the cap, still below every kept row), so greedy drafting never picks
    it and its probability is zero (e^-2cap under a soft cap: rejection sampling is exact for any draft
    distribution), while a logits processor that bans every kept row still leaves a distribution to sample. Token
    ids come out as the full model's: mapped on the device, no host read."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, head: DraftHead):
        super().__init__()
        head.check_fits(weight.shape[0])
        ids = torch.tensor(head.ids, dtype=torch.long, device=weight.device)
        self.vocab_size, self.source = weight.shape[0], head_source(weight, bias)
        self.register_buffer("ids", ids, persistent=False)
        self.register_buffer("weight", weight.detach()[ids].contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach()[ids].contiguous(), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        rows = nn.functional.linear(hidden_states, self.weight, self.bias)
        logits = rows.new_full((*rows.shape[:-1], self.vocab_size), torch.finfo(rows.dtype).min)
        return logits.index_copy(-1, self.ids, rows)


def trimmed_head(model: nn.Module, head: DraftHead) -> TrimmedHead:
    """The model's `TrimmedHead` for `head`: one per head while any draft path holds it (held weakly here, so that
    the engine's eviction of a skip set frees its head's matrix), shared by every skip set that drafts with it."""
    memo = _draft_cache(model).setdefault("heads", weakref.WeakValueDictionary())
    module, (_, weight, bias) = memo.get(head), adapter.output_head(model)
    if module is None or module.source != head_source(weight, bias):
        memo[head] = module = TrimmedHead(weight, bias, head)
    return module


def _with_modules(parent: nn.Module, children: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of `parent` whose submodules named in `children` are those; parameters and hooks stay shared."""
    view = copy.copy(parent)
    view._modules = {**parent._modules, **children}
    return view


def model_with_head(model: nn.Module, head: nn.Module) -> nn.Module:
    """A view of `model` whose LM head is `head` (a module computing the logits from the final hidden states): same
    parameters and layers, the model's own forward."""
    return _with_modules(model, {adapter.output_head(model)[0]: head})


def model_with_layers(model: nn.Module, layers: nn.ModuleList, head: DraftHead | None = None) -> nn.Module:
    """A view of `model` whose decoder runs `layers` (and whose LM head reads `head`'s rows only, where given): same
    parameters, the model's own forward."""
    decoder = _with_modules(model.get_decoder(), {"layers": layers})
    children = {adapter.decoder_attribute(model): decoder}
    if head is not None:
        children[adapter.output_head(model)[0]] = trimmed_head(model, head)
    return _with_modules(model, children)


def draft_model(model: nn.Module, skip: SkipSet) -> nn.Module:
    """A view of `model` that drafts with `skip` skipped (and its head trimmed): same parameters, built once per skip
    set."""
    memo, head_name = _current_drafts(model), adapter.output_head(model)[0]
    view = memo.get(("model", skip))
    if view is None or (skip.head is not None and view._modules[head_name] is not trimmed_head(model, skip.head)):
        memo[("model", skip)] = view = model_with_layers(model, draft_layers(model, skip), skip.head)
        _trim(memo, ("model", skip))
    memo.move_to_end(("model", skip))
    return view


def forget_draft(model: nn.Module, skip: SkipSet) -> None:
    """Drop what `draft_layers` and `draft_model` keep for `skip`, so that a long study's memory stays flat."""
    memo = _draft_cache(model)
    memo.pop(("layers", skip.sublayers), None)
    memo.pop(("model", skip), None)


def forget_drafts(model: nn.Module) -> None:
    """Drop every draft path kept for `model` (made from modules it may no longer have)."""
    memo = _draft_cache(model)
    for key in [key for key in memo if isinstance(key, tuple)]:
        del memo[key]


@contextlib.contextmanager
def draft_mode(model: nn.Module, skip: SkipSet) -> Iterator[None]:
    """Run `model` itself with the sublayers in `skip` skipped (and its head trimmed); restores the decoder's layers
    and the head on exit, also on error."""
    layers = draft_layers(model, skip)
    decoder = model.get_decoder()
    original = decoder.layers
    name = adapter.output_head(model)[0] if skip.head is not None else None
    head = model._modules[name] if name is not None else None
    decoder.layers = layers
    if name is not None:
        model._modules[name] = trimmed_head(model, skip.head)
    try:
        yield
    finally:
        decoder.layers = original
        if name is not None:
            model._modules[name] = head


def check_model(model: Any, what: str = "model") -> None:
    """A causal LM of transformers whose decoder layers the draft path can run (TypeError or ValueError otherwise)."""
    if isinstance(model, PreTrainedModel):
        # A ValueError naming the family for a decoder without separable sublayers (attention kinds the cache
        # cannot hold are refused by the cache, before any decoding: checked here, it would cost every call)
        decoder_layers(model)
        return
    hint = ""
    if hasattr(model, "model") and hasattr(model, "tokenizer"):
        hint = ": pass its .model (load_model returns the model with its tokenizer)"
    elif isinstance(model, nn.Module):
        hint = ": a transformers causal LM (AutoModelForCausalLM) is needed"
    raise TypeError(f"{what} must be a transformers causal LM, got {type(model).__name__}{hint}")
