"""One GEMM for the linears of a layer that read one input, in the regional steps that inductor compiles.

transformers' layers call a layer's query, key and value projections (and its gate and up projections) one after
the other on the same input: 7 GEMMs a layer, each a kernel on CUDA. In a regional step each projection of such a
group is a `ProjectionSlice` instead: its own columns of one GEMM over the group's weights concatenated. Each slice
computes the whole GEMM as dynamo traces it, and `SharedGemms`, a pass inductor runs over the layer's graph, keeps one
GEMM of each operand pair: 4 GEMMs a layer, 5 kernels fewer on a CPU (BENCHMARKS.md, "Twenty-sixth session").
Memory: none more. The projections' own weights become views of the concatenated one, made once per model: the same
values and parameters, so the model's own forward, `save_pretrained`, `torch.save` and training see no difference.
safetensors' own `save_model` does: it refuses tensors that share storage (set `engine_for(model).fuse_projections =
False` before decoding to keep them apart). The engine fuses again where the model changed under the copies (cast,
moved, a module replaced or wrapped: `FusedProjections.intact`). Outside inductor (eager, other backends) a slice would
compute its group's whole GEMM: only inductor's regional steps get them.
"""

from __future__ import annotations

import copy
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import adapter

aten = torch.ops.aten
# Pure ops, merged where one is computed again from the same operands: the GEMMs and the views feeding them.
_MERGED = frozenset({aten.mm, aten.addmm, aten.permute, aten.t, aten.view, aten.reshape, aten._unsafe_view})


def _writes(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


class SharedGemms(CustomGraphPass):
    """Inductor's post-grad pass (`post_grad_custom_pre_pass`): a node of `_MERGED` computed again from the same
    operands is replaced by the first. Only in graphs whose writes in place all go to the graph's inputs (inductor's
    graphs at this point are functional but for the inputs they update), so that no merged node is written; and only
    before the first write, after which equal operands need not hold equal values."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        if any(_writes(node) and node.args and getattr(node.args[0], "op", None) != "placeholder"
               for node in graph.nodes):
            return
        seen: dict[tuple, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if _writes(node):
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


class FusedGroup(NamedTuple):
    """A group of linears of one input and the concatenation of their weights (and biases) they are views of."""

    linears: tuple[nn.Linear, ...]
    fused: FusedLinear


class Snapshot(NamedTuple):
    """A module's children when a fused copy of it was made: the copy runs those."""

    module: nn.Module
    children: dict[str, nn.Module]

    def current(self) -> bool:
        return _same_children(self.module, self.children)


def _same_children(module: nn.Module, children: dict[str, nn.Module]) -> bool:
    return module._modules.keys() == children.keys() and all(
        module._modules[name] is child for name, child in children.items())


def _plain_linear(module: nn.Module | None) -> bool:
    """A linear that runs as `nn.Linear` does: nothing hooked on it, plain strided weights (no quantized or
    distributed tensor subclass)."""
    return (type(module) is nn.Linear and not _hooked(module)
            and all(type(p.data) is torch.Tensor and p.layout == torch.strided and p.device.type != "meta"
                    for p in (module.weight, module.bias) if p is not None))


def _fusible(linears: list[nn.Module | None]) -> bool:
    """Distinct plain linears of one input size, dtype and device, all with a bias or none, whose weights (and biases)
    each own their storage or together are one storage, in order (`_in_order`): nothing else can alias them."""
    if not linears or not all(map(_plain_linear, linears)) or len({id(linear) for linear in linears}) < len(linears):
        return False
    first = linears[0]
    if not all(linear.in_features == first.in_features and linear.weight.dtype == first.weight.dtype
               and linear.weight.device == first.weight.device and (linear.bias is None) == (first.bias is None)
               for linear in linears):
        return False
    return all(_in_order(tensors) or all(map(_owns_storage, tensors)) for tensors in _tensors(linears))


def _tensors(linears) -> list[list[torch.Tensor]]:
    """The group's weights, and its biases where it has them."""
    biases = [[linear.bias for linear in linears]] if linears[0].bias is not None else []
    return [[linear.weight for linear in linears], *biases]


def _owns_storage(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def _row_pointer(whole: torch.Tensor, row: int) -> int:
    return whole.data_ptr() + row * whole.stride(0) * whole.element_size()


def _in_order(tensors: list[torch.Tensor]) -> bool:
    """Whether the tensors already are one storage, theirs alone, concatenated by rows in this order (a model fused
    before, then saved and loaded, or fused by an earlier engine)."""
    first, rows = tensors[0], sum(tensor.shape[0] for tensor in tensors)
    return (all(tensor.is_contiguous() for tensor in tensors)
            and first.untyped_storage().nbytes() == rows * first.stride(0) * first.element_size()
            and all(tensor.data_ptr() == _row_pointer(first, start)
                    for tensor, start in zip(tensors, _offsets(tensors))))


def _offsets(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's first row in its group's concatenation."""
    starts, row = [], 0
    for tensor in tensors:
        starts.append(row)
        row += tensor.shape[0]
    return starts


class FusedProjections:
    """A model's fused groups, made once per sublayer module and shared by every layer view that holds it (the model's
    layers and the draft paths' copies); `intact` says whether the model still is what they were made from."""

    def __init__(self):
        self.sublayers: dict[int, tuple[Snapshot, nn.Module]] = {}  # id(sublayer) -> its snapshot, its fused copy
        # layer -> its children when copied; held weakly, the children too (a draft path's copy of a layer dies with
        # its skip set, and its entry with it: a value that held the layer kept every copy alive, `intact` walking all)
        self.layers: weakref.WeakKeyDictionary[nn.Module, dict[str, nn.Module]] = weakref.WeakKeyDictionary()
        self.groups: list[FusedGroup] = []

    def layer(self, layer: nn.Module) -> nn.Module:
        """`layer` with the fusible groups of its attention and feed-forward block fused: a shallow copy, sharing
        every parameter (the layer itself where nothing fuses)."""
        if _hooked(layer):
            return layer
        swaps = {name: self._sublayer(getattr(layer, name), groups) for name, groups in
                 adapter.FUSIBLE_PROJECTIONS.items() if isinstance(getattr(layer, name, None), nn.Module)}
        swaps = {name: sub for name, sub in swaps.items() if sub is not getattr(layer, name)}
        if not swaps:
            return layer
        self.layers[layer] = dict(layer._modules)
        view = copy.copy(layer)
        view._modules = {**layer._modules, **swaps}
        return view

    def intact(self) -> bool:
        """Whether the model still is what the fused copies were made from: the same children in every layer and
        sublayer copied (none replaced or wrapped since), and every group's linears reading the concatenated weights
        and biases (a model moved or cast has tensors of its own again)."""
        return (all(snapshot.current() for snapshot, _ in self.sublayers.values())
                and all(_same_children(layer, children) for layer, children in list(self.layers.items()))
                and all(_reads(group) for group in self.groups))

    def _sublayer(self, sublayer: nn.Module, groups: tuple[tuple[str, ...], ...]) -> nn.Module:
        """`sublayer` with its fusible groups fused, made once (kept only where something fused: the draft paths'
        skipped sublayers come and go with their skip sets)."""
        if id(sublayer) in self.sublayers:
            return self.sublayers[id(sublayer)][1]
        swaps = {}
        for names in groups if not _hooked(sublayer) else ():
            linears = [sublayer._modules.get(name) for name in names]
            if _fusible(linears):
                swaps.update(zip(names, self._slices(linears)))
        if not swaps:
            return sublayer
        fused = copy.copy(sublayer)
        fused._modules = {**sublayer._modules, **swaps}
        self.sublayers[id(sublayer)] = (Snapshot(sublayer, dict(sublayer._modules)), fused)
        return fused

    def _slices(self, linears: list[nn.Linear]) -> list[ProjectionSlice]:
        # Made in the weights' own mode (normal weights stay usable for autograd outside inference mode, a model made
        # in inference mode keeps inference tensors); the originals are freed as the parameters take views of it.
        with torch.inference_mode(linears[0].weight.is_inference()), torch.no_grad():
            whole = []
            for tensors in _tensors(linears):
                first, rows = tensors[0], sum(tensor.shape[0] for tensor in tensors)
                whole.append(first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                                     (rows, *first.shape[1:])) if _in_order(tensors)
                             else torch.cat(tensors))
                for tensor, start in zip(tensors, _offsets(tensors)):
                    tensor.data = whole[-1][start : start + tensor.shape[0]]
            fused = FusedLinear(whole[0], whole[1] if len(whole) > 1 else None)
        self.groups.append(FusedGroup(tuple(linears), fused))
        weights = [linear.weight for linear in linears]
        return [ProjectionSlice(fused, start, start + weight.shape[0])
                for weight, start in zip(weights, _offsets(weights))]


def _hooked(module: nn.Module) -> bool:
    """Whether a module runs something besides its class's forward (hooks, an instance's own forward, as
    accelerate's offloading gives it): a shallow copy would not run that."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def _reads(group: FusedGroup) -> bool:
    """Whether each linear of `group` still reads its rows of the concatenated weights and biases."""
    return all(tensor.data_ptr() == _row_pointer(whole, start)
               for tensors, whole in zip(_tensors(group.linears), (group.fused.weight, group.fused.bias))
               for tensor, start in zip(tensors, _offsets(tensors)))
