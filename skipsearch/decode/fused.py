"""One GEMM for the linears of a layer that read one input, in the regional steps that inductor compiles.

transformers' layers call a layer's query, key and value projections (and its gate and up projections) one after
the other on the same input: 7 GEMMs a layer, each a kernel on CUDA. In a regional step each projection of such a
group is a `ProjectionSlice` instead: its own columns of one GEMM over the group's weights concatenated. Each slice
computes the whole GEMM as dynamo traces it, and `SharedGemms`, a pass inductor runs over the layer's graph, keeps one
GEMM of each operand pair: 4 GEMMs a layer, 5 kernels fewer on a CPU (BENCHMARKS.md, "Twenty-sixth session").
Memory: none more. The projections' own weights become views of the concatenated one, made once per model (same
values, same parameters: the model's own forward, a saved model and training see no difference). Outside inductor
(eager, other backends) a slice would compute its group's whole GEMM: only inductor's regional steps get them.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import adapter

aten = torch.ops.aten
# Pure ops, merged where one is computed again from the same operands: the GEMMs and the views feeding them.
_MERGED = frozenset({aten.mm, aten.addmm, aten.permute, aten.t, aten.view, aten.reshape, aten._unsafe_view})


class SharedGemms(CustomGraphPass):
    """Inductor's post-grad pass (`post_grad_custom_pre_pass`): a node of `_MERGED` computed again from the same
    operands is replaced by the first. It stops at the graph's first op that writes a tensor in place, after which
    equal operands need not hold equal values (inductor's graphs at this point write in place only at their end)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict[tuple, torch.fx.Node] = {}
        for node in list(graph.nodes):
            schema = getattr(node.target, "_schema", None)
            if schema is not None and schema.is_mutable:
                return
            if node.op != "call_function" or getattr(node.target, "overloadpacket", None) not in _MERGED:
                continue
            key = (node.target, _hashable(node.args), _hashable(node.kwargs))
            try:
                hash(key)
            except TypeError:  # an operand that cannot be compared by value (a symbolic size object): left alone
                continue
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
            else:
                seen[key] = node

    def uuid(self) -> bytes:  # inductor's compile caches key on it: this file's code
        return get_hash_for_files((__file__,))


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((key, _hashable(item)) for key, item in value.items()))
    return value


class FusedLinear(nn.Module):
    """The weights (and biases) of a group of linears of one input, concatenated by output."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)


class ProjectionSlice(nn.Module):
    """One linear of a fused group: its columns of the group's GEMM."""

    def __init__(self, fused: FusedLinear, start: int, stop: int):
        super().__init__()
        self.fused, self.start, self.stop = fused, start, stop

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.fused.weight, self.fused.bias)[..., self.start : self.stop]


def _fusible(linears: list[nn.Module]) -> bool:
    """Plain linears of one input size, dtype and device, all with a bias or none, each weight owning its storage
    (nothing else of the model can alias it)."""
    if not linears or any(type(linear) is not nn.Linear for linear in linears):
        return False
    first = linears[0].weight
    return all(linear.in_features == linears[0].in_features and linear.weight.dtype == first.dtype
               and linear.weight.device == first.device and (linear.bias is None) == (linears[0].bias is None)
               and linear.weight.untyped_storage().nbytes() == linear.weight.numel() * linear.weight.element_size()
               for linear in linears) and first.device.type != "meta"


class FusedProjections:
    """A model's fused groups, made once per sublayer module and shared by every layer view that holds it (the model's
    layers and the draft paths' copies); `intact` says whether the model's weights are still the fused ones."""

    def __init__(self):
        self.sublayers: dict[int, tuple[nn.Module, nn.Module]] = {}  # id(sublayer) -> (sublayer, its fused copy)
        self.groups: list[tuple[list[nn.Linear], FusedLinear]] = []

    def layer(self, layer: nn.Module) -> nn.Module:
        """`layer` with the fusible groups of its attention and feed-forward block fused: a shallow copy, sharing
        every parameter (the layer itself where nothing fuses)."""
        swaps = {name: self._sublayer(getattr(layer, name), names)
                 for name, names in adapter.FUSIBLE_PROJECTIONS.items() if isinstance(getattr(layer, name, None), nn.Module)}
        swaps = {name: sub for name, sub in swaps.items() if sub is not getattr(layer, name)}
        if not swaps:
            return layer
        view = copy.copy(layer)
        view._modules = {**layer._modules, **swaps}
        return view

    def intact(self) -> bool:
        """Whether every fused group's linears still read the concatenated weights (a model moved, cast or given new
        parameters has linears of its own again)."""
        return all(linear.weight.data_ptr() == fused.weight.data_ptr() + start * fused.weight.stride(0)
                   * fused.weight.element_size()
                   for linears, fused in self.groups for linear, start in zip(linears, _offsets(linears)))

    def _sublayer(self, sublayer: nn.Module, groups: tuple[tuple[str, ...], ...]) -> nn.Module:
        """`sublayer` with its fusible groups fused, made once (kept only where something fused: the draft paths'
        skipped sublayers come and go with their skip sets)."""
        if id(sublayer) in self.sublayers:
            return self.sublayers[id(sublayer)][1]
        swaps = {}
        for names in groups:
            linears = [sublayer._modules.get(name) for name in names]
            if _fusible(linears):
                swaps.update(zip(names, self._slices(linears)))
        if not swaps:
            return sublayer
        fused = copy.copy(sublayer)
        fused._modules = {**sublayer._modules, **swaps}
        self.sublayers[id(sublayer)] = (sublayer, fused)
        return fused

    def _slices(self, linears: list[nn.Linear]) -> list[ProjectionSlice]:
        # Made in the weights' own mode (normal weights stay usable for autograd outside inference mode, a model made
        # in inference mode keeps inference tensors); the originals are freed as the parameters take views of it.
        with torch.inference_mode(linears[0].weight.is_inference()), torch.no_grad():
            weight = torch.cat([linear.weight for linear in linears])
            bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
            fused = FusedLinear(weight, bias)
            starts = _offsets(linears)
            for linear, start in zip(linears, starts):
                stop = start + linear.out_features
                linear.weight.data = weight[start:stop]
                if bias is not None:
                    linear.bias.data = bias[start:stop]
        self.groups.append((linears, fused))
        return [ProjectionSlice(fused, start, start + linear.out_features) for linear, start in zip(linears, starts)]


def _offsets(linears: list[nn.Linear]) -> list[int]:
    """Each linear's first row in its group's concatenation (rows: `torch.cat`'s offsets over the out features)."""
    starts, row = [], 0
    for linear in linears:
        starts.append(row)
        row += linear.out_features
    return starts
