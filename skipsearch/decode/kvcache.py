"""A static KV cache whose roll-back is a position, and the attention masks for it, built on the device.

Every layer holds the full capacity (prompt + new tokens + drafts), allocated up front; a forward
writes its keys and values at the cache's one write position and reads the whole buffer. Slots
past the query are stale (a rejected draft, a previous call, an attention the draft skipped) and
the attention mask hides them, so rolling back is moving the position: no crop, no copy.
Sliding-window layers are full-length too and the mask does the windowing: transformers'
`StaticSlidingWindowLayer` keeps only the window and rolls it, which cannot be rolled back.

`position` is where the cache writes next: a device scalar that each step advances on the device
(`advance`), so a step needs no position from the host. The decoding loop sets it from the
committed length it keeps anyway (`seek`: back to the round's start before verifying, past the
accepted tokens after), as gpt-fast passes `input_pos`. The masks
are built from it on the device too (`attention_mask`), which spares transformers' mask code, and
with it a host read of the position per multi-token forward on CUDA.
"""

from __future__ import annotations

import torch

from ..io.resources import check_memory
from . import adapter

SUPPORTED_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}  # the kinds it holds: is it sliding


def check_layer_types(config) -> list[str]:
    """The attention kind of each decoder layer of `config`; a one-line ValueError naming the family where one is a
    kind this cache cannot hold (linear attention, chunked attention, a layer reading another's keys)."""
    layer_types = adapter.layer_types(config)
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise ValueError(f"{adapter.family(config)} is not supported: its layers of kind {', '.join(unsupported)} "
                         f"need a cache that skipsearch's speculative cache is not (it holds "
                         f"{' and '.join(SUPPORTED_LAYER_TYPES)} layers)")
    return layer_types


class PositionalLayer(adapter.static_layer_class()):
    """A `StaticLayer` that writes at a position shared by all layers instead of counting its own writes.

    A shared position is what lets the draft skip attention layers: a skipped layer is not
    written, yet the mask and the next write are placed by the position, not by that layer.
    `update` ignores the layer index that attention passes, so a layer can also be handed its
    own `PositionalLayer` as its cache: then no compiled code depends on which layer it runs
    (engine.py shares one compiled function among all layers that way).
    """

    def __init__(self, max_cache_len: int, position: torch.Tensor, is_sliding: bool):
        super().__init__(max_cache_len=max_cache_len)
        self.position = position
        self.is_sliding = is_sliding

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        index = self.position + torch.arange(key_states.shape[-2], device=self.device)
        self.keys.index_copy_(2, index, key_states)
        self.values.index_copy_(2, index, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> torch.Tensor:
        # A tensor, like StaticLayer's: the mask reads it as the query offset without a host sync.
        return self.position


CACHE_ADVICE = "decode fewer new tokens (--max-new-tokens) or give a shorter prompt"


def kv_shape(text_config) -> tuple[int, int]:
    """Key/value heads and head size per layer."""
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return heads, head_dim


def cache_bytes(config, capacity: int, dtype: torch.dtype) -> int:
    """The bytes a `SpeculativeCache` of `capacity` slots allocates: keys and values of every layer, full length."""
    text_config = config.get_text_config(decoder=True)
    heads, head_dim = kv_shape(text_config)
    return 2 * text_config.num_hidden_layers * heads * head_dim * capacity * dtype.itemsize


def check_cache_memory(model, capacity: int) -> None:
    """A ResourceExhausted, before any work, when `model`'s device cannot hold a cache of `capacity` slots."""
    check_memory(cache_bytes(model.config, capacity, model.dtype), model.device, f"the KV cache for {capacity} tokens",
                 CACHE_ADVICE)


class SpeculativeCache(adapter.cache_class()):
    """Full-length static layers (transformers' `StaticLayer`) sharing one write position on the device."""

    def __init__(self, config, capacity: int, device: torch.device | str, dtype: torch.dtype | None = None):
        text_config = config.get_text_config(decoder=True)
        layer_types = check_layer_types(text_config)
        self.capacity = capacity
        self.layer_types = list(layer_types)
        self.sliding_window = getattr(text_config, "sliding_window", None)
        self.text_config = text_config  # its attention implementation is read at each mask: it can be changed
        if self.attn_implementation not in ("sdpa", "eager", adapter.ENGINE_ATTENTION):
            # Others (flash attention) take no mask of ours, and theirs would let a query see the stale slots.
            raise ValueError(f"the speculative cache needs sdpa or eager attention, not {self.attn_implementation!r}: "
                             "load the model with attn_implementation='sdpa'")
        self.position = torch.zeros((), dtype=torch.long, device=device)
        if torch.device(device).type == "cuda" and not torch.compiler.is_compiling():
            # A fixed address, which CUDA graphs read in place. Not on a CPU: inductor's freezing (engine.py) would
            # fold a static-address tensor that the graph does not write into a constant, the position of the
            # compiling call; as an input it is read at every call. (Frozen steps on CUDA keep it an input all the
            # same, because every step writes it: freezing folds only what no graph writes. Tested on a CPU.)
            torch._dynamo.mark_static_address(self.position)
        self.slots = torch.arange(capacity, device=device)
        super().__init__(layers=[PositionalLayer(capacity, self.position, SUPPORTED_LAYER_TYPES[t]) for t in layer_types])
        if dtype is not None:
            # Allocated now, not at the first write: a CUDA graph must not capture the allocation. Checked first: a
            # cache the device cannot hold is one line, not the allocator's traceback.
            check_memory(cache_bytes(config, capacity, dtype), torch.device(device),
                         f"the KV cache for {capacity} tokens", CACHE_ADVICE)
            heads, head_dim = kv_shape(text_config)
            self.early_initialization(1, heads, head_dim, dtype, torch.device(device))

    def seek(self, position: int) -> None:
        """Make `position` the next write position: later slots become stale, hidden by the mask."""
        if not 0 <= position <= self.capacity:
            raise ValueError(f"position {position} is outside the cache (capacity {self.capacity})")
        self.position.fill_(position)  # a kernel launch on CUDA, no host sync

    def advance(self, tokens: int | torch.Tensor) -> None:
        """Move the write position by `tokens` (negative rolls back), on the device: no host sync."""
        self.position.add_(tokens)

    def positions(self, width: int) -> torch.Tensor:
        """Position ids (1, width) of a forward of `width` tokens at the write position."""
        return (self.position + self.slots[:width]).view(1, -1)

    @property
    def attn_implementation(self) -> str:
        return adapter.attn_implementation(self.text_config)

    def attention_mask(self, width: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """The mask for a forward of `width` tokens at the write position, in the form the model's forward takes
        as prepared (a 4D tensor; a mapping by layer type for models with both kinds)."""
        query = self.positions(width).view(-1, 1)
        causal = self.slots <= query  # (width, capacity): a token sees itself and what precedes it
        masks = {"full_attention": causal}
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = causal & (self.slots > query - self.sliding_window)
        dtype = adapter.cache_dtype(self.layers[0]) or torch.float32
        return adapter.masks_by_layer_type({kind: adapter.prepared_mask(mask, self.attn_implementation, dtype)
                                            for kind, mask in masks.items() if kind in self.layer_types})

    def matches(self, capacity: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this cache can serve a call needing `capacity` slots of `dtype` on `device`."""
        stored = adapter.cache_dtype(self.layers[0])
        return self.capacity >= capacity and self.position.device == device and stored in (None, dtype)
