"""A static KV cache whose roll-back is a position.

Every layer holds the full capacity (prompt + new tokens + drafts), allocated once; a forward
writes its keys and values at the cache's one shared write position and reads the whole
buffer. Slots past the query are stale (a rejected draft, a previous call, an attention the
draft skipped) and the model's own causal mask hides them, so rolling back is moving the
position: no crop, no copy. Sliding-window layers are full-length too and the model's
sliding-window mask does the windowing: transformers' `StaticSlidingWindowLayer` keeps only the
window and rolls it, which cannot be rolled back.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer, get_layer_types_and_kwargs
from transformers.utils import is_torchdynamo_compiling

SUPPORTED_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


class PositionalLayer(StaticLayer):
    """A `StaticLayer` that writes at a position shared by all layers instead of counting its own writes.

    A shared position is what lets the draft skip attention layers: a skipped layer is not
    written, yet the mask and the next write are placed by the position, not by that layer.
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


class SpeculativeCache(Cache):
    """Full-length static layers (transformers' `StaticLayer`) sharing one write position; `seek` rolls back."""

    def __init__(self, config, capacity: int, device: torch.device | str):
        layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
        if unsupported:
            raise ValueError(f"unsupported attention layer types for the speculative cache: {unsupported}")
        self.capacity = capacity
        self.position = torch.zeros((), dtype=torch.long, device=device)
        if torch.device(device).type == "cuda" and not is_torchdynamo_compiling():
            # A fixed address, which CUDA graphs read in place. Not on a CPU: inductor's freezing (engine.py) would
            # fold a static-address tensor that the graph does not write into a constant, the position of the
            # compiling call; as an input it is read at every call.
            torch._dynamo.mark_static_address(self.position)
        super().__init__(layers=[PositionalLayer(capacity, self.position, SUPPORTED_LAYER_TYPES[t]) for t in layer_types])

    def seek(self, position: int) -> None:
        """Make `position` the next write position: later slots become stale, hidden by the causal mask."""
        if not 0 <= position <= self.capacity:
            raise ValueError(f"position {position} is outside the cache (capacity {self.capacity})")
        self.position.fill_(position)  # a kernel launch on CUDA, no host sync

    def matches(self, capacity: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this cache can serve a call needing `capacity` slots of `dtype` on `device`."""
        layer = self.layers[0]
        return (self.capacity >= capacity and self.position.device == device
                and (not layer.is_initialized or layer.dtype == dtype))
