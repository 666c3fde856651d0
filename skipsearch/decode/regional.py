"""Regional compiled steps: every decoder layer run through one compiled function for its kind (its class, its
attention kind and which of its sublayers the draft skips) and width, shared by all layers and all skip sets, so a
new skip set compiles nothing (engine.py's "regional" mode)."""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from . import adapter
from .adapter import decoder_layers
from .fused import FusedProjections, SharedGemms
from .kvcache import SpeculativeCache
from .skipping import SkippedLayer, draft_layers, model_with_layers
from .skipset import SkipSet


def _run_layer(layer: nn.Module, hidden: torch.Tensor, mask, position_embeddings, position_ids, kv, keyword: str
               ) -> torch.Tensor:
    return adapter.run_decoder_layer(layer, hidden, mask, position_embeddings, position_ids, kv, keyword)


def own_code(fn: Callable, name: str | None = None) -> Callable:
    """`fn` with a code object of its own, named `name` (`fn`'s own name unless given).

    Dynamo keeps compiled graphs per code object and fails a fullgraph compile once one code
    object has `recompile_limit` graphs: each compiled function here gets its own code, so each
    holds at most two (its first cache's length, then the length dynamic), however many skip sets,
    layer kinds and models a process compiles. What dynamo learns changes between calls (automatic dynamic
    shapes and floats) it keeps per source function instead: its file, first line and name.
    """
    names = {} if name is None else {"co_name": name, "co_qualname": name}
    code = fn.__code__.replace(**names)  # a copy even unrenamed: a code object of its own
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


_ENGINE_NUMBERS = itertools.count()


class LayerKind(NamedTuple):
    """What a layer's compiled code depends on besides its width: the layer's class, its attention kind (full or
    sliding), which sublayers the draft skips (a draft layer is a copy of the model's, of the same class) and the
    forward hooks in it (`layer_hooks`: dynamo guards on none, so a layer with hooks of its own compiles apart)."""

    cls: type
    attention: str
    skip_attn: bool
    skip_mlp: bool
    hooks: tuple = ()


def layer_hooks(layer: nn.Module) -> tuple:
    """The forward hooks and pre-hooks in `layer` (their handles' ids), by submodule; () where it has none."""
    return tuple((name, tuple(module._forward_hooks), tuple(module._forward_pre_hooks))
                 for name, module in layer.named_modules() if module._forward_hooks or module._forward_pre_hooks)


class CompiledLayers:
    """One compiled function per (layer kind, width), shared by every layer of a model, every skip set and every
    cache the engine makes.

    A layer is called with its own `PositionalLayer` as its cache, which ignores the layer index:
    so no compiled code depends on which layer it runs, and dynamo does not specialise per layer.
    The first cache's graphs are specialised to its length; a cache of another length recompiles each function once,
    with the length dynamic (dynamo's automatic dynamic shapes), and every later length reuses that graph: a profile's
    contexts and a study's longer prompts compile nothing more. Dynamo remembers the change per source function (its
    name among them), which every function here shares under a name of their own, so once their cache has changed
    length, later compiles take the length dynamic from their first call. Another engine's functions, another model's
    with other sizes or another norm epsilon, are named apart: what differs between models is no change to them (with
    one name, a second model made a layer's epsilon a float input uploaded at every call, torch 2.11 and 2.15). On a
    CPU a dynamic length changed a step's time by -8% to +4% (BENCHMARKS.md).
    """

    def __init__(self, backend: str, fuse: bool = False):
        self.backend = backend
        self.fused = FusedProjections() if fuse else None  # the layers' linears of one input fused (inductor only)
        self.code_name = f"_run_layer_{next(_ENGINE_NUMBERS)}"  # dynamo's memory of changes, this engine's own
        self.functions: dict[tuple[LayerKind, int], Callable] = {}
        self.warmed = False  # every one-token kind compiled for the current cache (Engine._warm_layer_kinds)

    def resized(self) -> None:
        """The engine's cache changed length: the next skip set's setup warms every kind again (a recompile with the
        length dynamic the first time, nothing after), so that no later set compiles."""
        self.warmed = False

    def __call__(self, kind: LayerKind, layer: nn.Module, hidden: torch.Tensor, mask, position_embeddings,
                 position_ids, kv, keyword: str):
        key = (kind, hidden.shape[1])
        if key not in self.functions:
            # The pass that keeps one GEMM of a fused group's: with the projections fused, it is what makes them one.
            options = None if self.fused is None else {"post_grad_custom_pre_pass": SharedGemms()}
            self.functions[key] = torch.compile(own_code(_run_layer, self.code_name), backend=self.backend,
                                                fullgraph=True, options=options)
        return self.functions[key](layer, hidden, mask, position_embeddings, position_ids, kv, keyword)

    def fusion_lost(self) -> bool:
        """Whether the model changed under the fused copies (cast or moved, a module or parameter replaced or wrapped:
        `FusedProjections.intact`): then the next layer view fuses again, and steps made before run the old ones."""
        if self.fused is None or self.fused.intact():
            return False
        self.fused = FusedProjections()
        return True

    def hooks_changed(self) -> None:
        """Hooks were added or removed: fused again (a slice runs none of its linear's hooks; a hooked linear is left
        unfused)."""
        if self.fused is not None:
            self.fused = FusedProjections()

    def layer(self, layer: nn.Module) -> nn.Module:
        """`layer` as these functions run it: its linears of one input fused, where they fuse."""
        return layer if self.fused is None else self.fused.layer(layer)


class RegionalLayer(nn.Module):
    """A decoder layer (or its draft copy) run by its kind's compiled function, with its own cache layer."""

    def __init__(self, layer: nn.Module, kind: LayerKind, kv, compiled: CompiledLayers, keyword: str):
        super().__init__()
        self.inner, self.kind, self.kv, self.compiled, self.keyword = layer, kind, kv, compiled, keyword

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, position_ids=None, **kwargs):
        return self.compiled(self.kind, self.inner, hidden_states, attention_mask, position_embeddings, position_ids,
                             self.kv, self.keyword)


def regional_view(model: nn.Module, skip: SkipSet | None, cache: SpeculativeCache, compiled: CompiledLayers
                  ) -> nn.Module:
    """The full model (`skip` None) or a draft path, every layer run through `compiled`."""
    skip = skip or SkipSet()
    layers = draft_layers(model, skip) if skip.size else decoder_layers(model)
    keyword = adapter.cache_keyword(decoder_layers(model)[0])
    return model_with_layers(model, nn.ModuleList(
        layer if isinstance(layer, SkippedLayer) else
        RegionalLayer(compiled.layer(layer), LayerKind(type(layer), cache.layer_types[i], i in skip.attn, i in skip.mlp,
                                                       layer_hooks(layer)), cache.layers[i], compiled, keyword)
        for i, layer in enumerate(layers)), skip.head)
