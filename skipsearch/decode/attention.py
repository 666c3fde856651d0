"""The engine's attention: transformers' SDPA without copying the keys and values out to every query head.

With a mask (the engine always gives its prepared one), transformers' SDPA (5.24) repeats each
key/value head for all its query heads (`repeat_kv`) except for a one-token query outside
torch.compile: so every compiled step, and every eager verification, copies the whole cache's
keys and values at every layer. Without the copy the default model's one-token steps ran 1.02-1.06x
as fast at 256 cache slots and 1.13-1.14x at 1,024 on a 2-core Intel Xeon (BENCHMARKS.md, "Fifteenth
session"; benchmarks/attention_speed.py). `grouped_sdpa` attends without it:
- SDPA's own grouped-query attention (`enable_gqa`) where a kernel takes it with a mask: a CPU's does, and on
  CUDA cuDNN's, in fp16 and bf16 (pytorch/pytorch#139586), where it was measured: Hopper (compute capability 9.0),
  head sizes up to 128;
- elsewhere, the query heads of one key/value head folded into the query length, each fold seeing the
  same mask rows, which every kernel takes. Of SDPA's other CUDA kernels, flash takes a grouped query but no
  mask, the memory-efficient one (torch 2.11) a mask but no grouped query, and the math kernel repeats the keys.
On an H200 (bf16, torch 2.11) the folded way read a long grouped cache at 42-210 GB/s a layer, the grouped query
given to cuDNN at up to 2,758: one layer's one-token attention 6.5-24x as fast at 4,096-16,384 slots, 1.2-1.3x
at 256, a verification's 1.00-1.25x; a whole compiled one-token step of Qwen2.5-1.5B's shape 1.84x as fast at
4,096 slots and 0.99x at 256 (BENCHMARKS.md, "Twenty-fifth session"; benchmarks/attention_kernels.py and
step_variants.py, which time both ways: `fold`).
Anything transformers' SDPA does beyond that (no mask, a soft cap, a position bias, dropout, attention
weights asked for) goes to transformers' SDPA itself, so the function is SDPA wherever it does not
fold. The engine switches a model to it only while its steps run (`adapter.attention_switched`, shared
by threads decoding on one model at once), and only from "sdpa": a model loaded with eager attention
keeps it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import adapter
from .kvcache import kv_shape

# What transformers' SDPA reads from its keywords besides the scaling; with any of them set, it runs instead.
_SDPA_ONLY = ("softcap", "position_bias")


# Where SDPA's own grouped query with a mask was measured to run as cuDNN's kernel (an H200, 2026-11-28): compute
# capability 9.0 exactly, where torch tries cuDNN's kernel first (elsewhere its math kernel, which copies the keys,
# comes before it), head sizes of 64 and 128 (larger ones only newer cuDNN releases take), fp16 and bf16.
_CUDNN_CAPABILITY = (9, 0)
_CUDNN_MAX_HEAD_DIM = 128
_CUDNN_DTYPES = (torch.float16, torch.bfloat16)


# Asked while a step compiles, its answer a constant of the graph: a step compiled with cuDNN's attention on keeps the
# grouped query if it is switched off later (the engine never switches it).
@torch.compiler.assume_constant_result
def _cudnn_attention_enabled(device_index: int | None) -> bool:
    index = torch.cuda.current_device() if device_index is None else device_index
    return (torch.version.hip is None and torch.backends.cudnn.is_available()
            and torch.backends.cuda.cudnn_sdp_enabled() and not torch.are_deterministic_algorithms_enabled()
            and torch.cuda.get_device_capability(index) == _CUDNN_CAPABILITY)


def _native_grouped_query(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether SDPA's own grouped-query attention takes a mask on `device` in `dtype` without falling back to a
    kernel that repeats the keys and values: a CPU's does; on CUDA cuDNN's, where it was measured (above)."""
    if device.type == "cpu":
        return True
    return (device.type == "cuda" and dtype in _CUDNN_DTYPES and head_dim <= _CUDNN_MAX_HEAD_DIM
            and _cudnn_attention_enabled(device.index))


def attention_way(model: nn.Module) -> str:
    """How the engine's steps attend on `model`'s device and dtype, in words for a cost profile's provenance: a
    profile timed one way prices a long context's attention wrongly for the other (module doc)."""
    config = model.config.get_text_config(decoder=True)
    kv_heads, head_dim = kv_shape(config)
    if config._attn_implementation != "sdpa":
        return f"the model's own ({config._attn_implementation})"
    if kv_heads == config.num_attention_heads:
        return "SDPA, no grouped query"
    if getattr(config, "attn_logit_softcapping", None):
        return "transformers' SDPA, its keys repeated (a soft cap)"
    if _native_grouped_query(model.device, model.dtype, head_dim):
        return "SDPA's own grouped query"
    return "query heads folded into the query's rows, then SDPA"


def grouped_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, fold: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention output (batch, query length, heads, head dim) as transformers' SDPA gives it, with query heads
    grouped over shared key/value heads without repeating the keys and values: folded into the query's rows
    (`fold` True) or given to SDPA's own grouped-query attention (False); None, as the device's kernels need (module
    doc). On CUDA the choice sets which kernel reads a long cache, and how fast (`benchmarks/attention_kernels.py`)."""
    groups = getattr(module, "num_key_value_groups", 1)
    shared_mask = attention_mask is not None and attention_mask.shape[1] == 1  # one mask for every head
    if (groups == 1 or not shared_mask or dropout or kwargs.get("output_attentions")
            or any(kwargs.get(name) is not None for name in _SDPA_ONLY)):
        return adapter.sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if fold is None:
        fold = not _native_grouped_query(query.device, query.dtype, query.shape[-1])
    batch, heads, width, dim = query.shape
    if fold:
        folded = query.reshape(batch, heads // groups, groups * width, dim)
        mask = attention_mask.unsqueeze(2).expand(-1, -1, groups, -1, -1).flatten(2, 3)  # rows: fold, then token
        out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
    return out.reshape(batch, heads, width, value.shape[-1]).transpose(1, 2).contiguous(), None


def engine_attention(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """A context to enter around each of the engine's forwards of `model`: inside, an SDPA model attends through
    `grouped_sdpa`."""
    return functools.partial(adapter.attention_switched, model.config.get_text_config(decoder=True),
                             adapter.ENGINE_ATTENTION)


adapter.register_attention(adapter.ENGINE_ATTENTION, grouped_sdpa)
