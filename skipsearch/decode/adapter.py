"""Every assumption skipsearch makes about transformers beyond its documented API, one function per touchpoint.

transformers moves monthly and renames what it does not document (5.24 renamed the cache keyword and stopped giving
static cache layers a `dtype`). So the rest of the package imports transformers only for public names
(`AutoModelForCausalLM`, configs, `GenerationConfig`, logits processors) and reaches everything else through here.
Each touchpoint is named in `TOUCHPOINTS` and tested by name (tests/test_adapter.py); when one fails on a release
outside the tested window, the error is an `AdapterError` naming the touchpoint and the window in one line, not an
AttributeError from inside a forward. `.ci/check-releases` runs those tests against the newest releases and the
oldest tested ones.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers import AttentionInterface, GenerationMixin, StopStringCriteria
from transformers import cache_utils
from transformers.generation import configuration_utils as generation_configuration
from transformers.generation import utils as generation_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# The minor releases CI tests: constraints.txt pins the newest, .ci/run checks the oldest with tests/test_adapter.py.
TESTED_TRANSFORMERS = ("5.23", "5.24")

TOUCHPOINTS = {
    "cache keyword": "the keyword under which a model's, a decoder layer's and an attention's forward take the KV "
                     "cache ('cache' from 5.24, 'past_key_values' before)",
    "static cache layer": "transformers.cache_utils.StaticLayer and Cache: a static layer's `keys`/`values` buffers, "
                          "`is_initialized`, `lazy_initialization` and `early_initialization`",
    "layer types": "the attention kind of each decoder layer, from the config (cache_utils.get_layer_types_and_kwargs)",
    "prepared mask": "a 4D mask given to the model's forward is used as prepared: boolean for sdpa, additive for "
                     "eager; a mapping by layer type where a model has several kinds",
    "logits to keep": "a model's forward takes `logits_to_keep` as a count of last rows or a tensor of row indices "
                      "(the compiled prefill keeps the row of a padded chunk's last real token)",
    "attention implementation": "config._attn_implementation names the attention kernel, read by every attention "
                                "module (which holds the text config) at each forward from the AttentionInterface, "
                                "where a function registered by name runs as transformers' SDPA does; "
                                "integrations.sdpa_attention.sdpa_attention_forward is that SDPA",
    "decoder layers": "model.get_decoder().layers: decoder layers, each with its attention as `self_attn` and its "
                      "feed-forward block (dense or routed) as `mlp`, whose outputs reach the residual stream only "
                      "through the layer's own forward",
    "sublayer norms": "the names of the norms in a decoder layer that feed only its attention or only its feed-forward "
                      "block, or take only its output (per tested layer class)",
    "attention output": "an attention module returns a tuple whose first item is its output",
    "feed forward output": "a feed-forward block returns its output, or a tuple whose first item is its output "
                           "(GPT-OSS: with its router scores)",
    "routed experts": "a routed feed-forward block keeps its experts as `experts`, their weights stacked by expert on "
                      "the first dimension, and a token reads the config's `num_experts_per_tok` of them",
    "custom_generate call": "generate calls a callable custom_generate like its `_sample`, with the prepared model "
                            "inputs as keywords; its streamer is a local of generate's frame",
    "generation mode": "GenerationMode and GenerationConfig.get_generation_mode()",
    "fusible projections": "a decoder layer's attention calls each of `q_proj`, `k_proj` and `v_proj` once a forward, "
                           "on one input, and its feed-forward block `gate_proj` and `up_proj` alike, and reads their "
                           "outputs only (not their weights): fused.py runs them as slices of one GEMM",
    "rope switches": "longrope reads `rope_parameters` (per layer type where there are several) and gives all of a "
                     "forward's positions its long factors when its last is past `original_max_position_embeddings`",
    "output head": "a causal LM holds its LM head (get_output_embeddings(), a 2-D weight) as a direct submodule and "
                   "computes its logits by calling it on the final hidden states",
}


class AdapterError(RuntimeError):
    """A transformers internal that skipsearch relies on is not what the tested releases have."""

    def __init__(self, touchpoint: str, detail: str):
        self.touchpoint = touchpoint
        super().__init__(f"transformers {transformers.__version__} breaks skipsearch's assumption '{touchpoint}' "
                         f"({detail}); tested: transformers {TESTED_TRANSFORMERS[0]} to {TESTED_TRANSFORMERS[-1]}")


def within_tested_window(version: str = transformers.__version__) -> bool:
    """Whether `version`'s minor release is in the tested window (a patch or pre-release counts as its minor)."""
    low, high = (Version(v).release[:2] for v in TESTED_TRANSFORMERS)
    return low <= Version(version).release[:2] <= high


def warn_if_untested(version: str = transformers.__version__) -> None:
    """Say that transformers is outside the tested window (once, at import); the tool runs on regardless."""
    if not within_tested_window(version):
        warnings.warn(f"transformers {version} is outside skipsearch's tested window ({TESTED_TRANSFORMERS[0]} to "
                      f"{TESTED_TRANSFORMERS[-1]}); `bash .ci/check-releases {version}` in its repository checks that "
                      "release", UserWarning, stacklevel=2)


# --- cache keyword -------------------------------------------------------------------------------------------------

@functools.cache
def _cache_keyword_of(cls: type) -> str:
    # inspect.signature follows the __wrapped__ that transformers' deprecate_kwarg leaves, to the real parameters.
    parameters = inspect.signature(cls.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise AdapterError("cache keyword", f"{cls.__name__}.forward takes neither 'cache' nor 'past_key_values'")


# A constant to compiled code: dynamo calls it while tracing and keeps the result, instead of tracing through the
# cache (which it warns of on every compile) or guarding on the cache's contents (a dict's length: each new model
# class looked up would recompile every compiled step). It takes the class, not the module: dynamo passes it only
# constants, and torch 2.11 does not take a whole compiled step's model for one (2.13 does).
@torch.compiler.assume_constant_result
def _constant_cache_keyword_of(cls: type) -> str:
    return _cache_keyword_of(cls)


def cache_keyword(module: nn.Module) -> str:
    """The keyword under which `module`'s forward (a model, a decoder layer or an attention) takes the KV cache."""
    return _constant_cache_keyword_of(type(module))


def model_forward(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor | None, mask: Any, cache: Any,
                  logits_to_keep: int = 0) -> torch.Tensor:
    """Logits (1, width or logits_to_keep, vocab) of one forward writing `cache` with a prepared `mask` (None:
    transformers makes the positions and the mask from the cache's length)."""
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                logits_to_keep=logits_to_keep, **{cache_keyword(model): cache})
    return out.logits


def run_decoder_layer(layer: nn.Module, hidden: torch.Tensor, mask: Any, position_embeddings: Any,
                      position_ids: torch.Tensor, cache: Any, keyword: str) -> torch.Tensor:
    """One decoder layer's forward as the decoder calls it (`keyword`: `cache_keyword(layer)`, resolved outside so
    that compiled code sees a constant)."""
    out = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids,
                use_cache=True, **{keyword: cache})
    return out[0] if isinstance(out, tuple) else out



def output_head(model: nn.Module) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """The LM head as a draft may replace it: the name under which `model` holds it as a direct submodule, its
    weight (vocab, hidden) and bias. Every tested family computes its logits as `self.<name>(hidden)` after the final
    norm (a soft cap, where a family has one, applies after it)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = [name for name, child in model._modules.items() if head is not None and child is head]
    weight = getattr(head, "weight", None)
    if not names or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise AdapterError("output head", f"{type(model).__name__}: the LM head is not a direct submodule with a 2-D "
                                          "weight")
    return names[0], weight, getattr(head, "bias", None)

# --- static cache layer, layer types, masks ------------------------------------------------------------------------

def static_layer_class() -> type:
    """transformers' StaticLayer, which `kvcache.PositionalLayer` extends."""
    layer = getattr(cache_utils, "StaticLayer", None)
    if layer is None or not all(hasattr(layer, name) for name in ("lazy_initialization", "update")):
        raise AdapterError("static cache layer", "cache_utils.StaticLayer with lazy_initialization is gone")
    return layer


def cache_class() -> type:
    """transformers' Cache, made of layers, which `kvcache.SpeculativeCache` extends."""
    cache = getattr(cache_utils, "Cache", None)
    if cache is None or not hasattr(cache, "early_initialization"):
        raise AdapterError("static cache layer", "cache_utils.Cache with early_initialization is gone")
    return cache


def cache_dtype(layer: Any) -> torch.dtype | None:
    """The dtype a static layer stores (None until it is allocated). Read from its buffer: 5.24's layers have no
    `dtype` field."""
    if not getattr(layer, "is_initialized", False):
        return None
    keys = getattr(layer, "keys", None)
    if not isinstance(keys, torch.Tensor):
        raise AdapterError("static cache layer", f"{type(layer).__name__}.keys is not a tensor once initialized")
    return keys.dtype


def layer_types(config: Any) -> list[str]:
    """The attention kind of each decoder layer ("full_attention", "sliding_attention", ...)."""
    read = getattr(cache_utils, "get_layer_types_and_kwargs", None)
    if read is not None:
        return list(read(config)[0])
    given = getattr(config, "layer_types", None)
    if given is not None:
        return list(given)
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * config.num_hidden_layers
    return ["full_attention"] * config.num_hidden_layers


def rope_switches(config: Any) -> tuple[int, ...]:
    """The forward lengths at which a rotary embedding switches all of a forward's positions' frequencies: longrope's
    original context (dynamic NTK's is the model's whole context, which no forward passes)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    kinds = parameters.values() if all(isinstance(kind, dict) for kind in parameters.values()) else (parameters,)
    return tuple(sorted({kind["original_max_position_embeddings"] for kind in kinds
                         if kind.get("rope_type") == "longrope" and kind.get("original_max_position_embeddings")}))


def attn_implementation(config: Any) -> str:
    """The attention kernel a model runs ("sdpa", "eager", "flash_attention_2", ...)."""
    return getattr(config, "_attn_implementation", None) or "sdpa"


# The engine's own attention function (attention.py), registered under this name and switched to only while the
# engine's steps run (`attention_switched`); it takes the masks SDPA takes.
ENGINE_ATTENTION = "skipsearch_sdpa"


def register_attention(name: str, function: Any) -> None:
    """Make `function` an attention implementation by `name`, with SDPA's masks where transformers makes them."""
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


def sdpa_attention(*args, **kwargs) -> tuple[torch.Tensor, Any]:
    """transformers' own SDPA attention function."""
    return sdpa_attention_forward(*args, **kwargs)


_SWITCHED: dict[int, list] = {}  # id(config) -> [config, how many callers are inside `attention_switched`]
_SWITCHED_LOCK = threading.Lock()


@contextlib.contextmanager
def attention_switched(config: Any, name: str) -> Iterator[None]:
    """While inside, a model whose attention modules hold `config` (its text config) and run SDPA runs the attention
    function registered as `name` instead; any other implementation (eager) is left as it is. Callers inside at once
    (threads decoding on one model, nested calls) share the switch: the last one out switches back."""
    key = id(config)
    with _SWITCHED_LOCK:
        entry = _SWITCHED.get(key)
        if entry is not None:
            entry[1] += 1
        elif getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation = name
            entry = _SWITCHED[key] = [config, 1]
    if entry is None:
        yield
        return
    try:
        yield
    finally:
        with _SWITCHED_LOCK:
            entry[1] -= 1
            if not entry[1]:
                del _SWITCHED[key]
                config._attn_implementation = "sdpa"


def prepared_mask(allowed: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """A (width, capacity) boolean mask of allowed slots in the 4D form the model's forward takes as prepared."""
    allowed = allowed.view(1, 1, *allowed.shape)
    if implementation in ("sdpa", ENGINE_ATTENTION):
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def masks_by_layer_type(masks: dict[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
    """What the forward takes for `masks` (one per layer type the model has): a mapping only where there are several."""
    return masks if len(masks) > 1 else next(iter(masks.values()))


# --- decoder structure ---------------------------------------------------------------------------------------------

ATTENTION, FEED_FORWARD = "self_attn", "mlp"  # a decoder layer's sublayers, by attribute name
# The linears of a sublayer that read one input, by attribute name (fused.py fuses each group where it finds it).
FUSIBLE_PROJECTIONS = {ATTENTION: (("q_proj", "k_proj", "v_proj"),), FEED_FORWARD: (("gate_proj", "up_proj"),)}


def family(model_or_config: Any) -> str:
    """A model's family as users name it: its config's `model_type` ("gemma2") and its class."""
    config = getattr(model_or_config, "config", model_or_config)
    name = getattr(config, "model_type", None) or type(config).__name__
    return f"{name} ({type(model_or_config).__name__})" if config is not model_or_config else name


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM, each with its attention and its feed-forward block as separate submodules;
    a one-line ValueError naming the family for other decoders (a linear-attention hybrid, a fused block)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"{family(model)} is not a supported decoder: its decoder keeps no `layers` list of decoder "
                         "layers")
    for i, layer in enumerate(layers):
        missing = [name for name in (ATTENTION, FEED_FORWARD) if not isinstance(getattr(layer, name, None), nn.Module)]
        if missing:
            raise ValueError(f"{family(model)} is not a supported decoder: layer {i} ({type(layer).__name__}) has no "
                             f"separable {' or '.join(f'`{name}`' for name in missing)} sublayer to skip")
    return layers


def decoder_attribute(model: nn.Module) -> str:
    """The name under which `model` holds its decoder as a direct submodule."""
    decoder = model.get_decoder()
    names = [name for name, child in model._modules.items() if child is decoder]
    if not names:
        raise AdapterError("decoder layers", f"{type(model).__name__}: the decoder is not a direct submodule")
    return names[0]


@dataclass(frozen=True)
class SublayerNorms:
    """Norms of a decoder layer that touch one sublayer alone: `before` feed only it, `after` take only its output."""

    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class LayerNorms:
    attn: SublayerNorms
    mlp: SublayerNorms


# The tested layer classes (tests/test_families.py checks each entry against the definition of a skip). Llama's
# `post_attention_layernorm` feeds the MLP; Gemma's and OLMo 2's norms the attention's output: the names alone do
# not say, so an untested class gets no entry and keeps every norm.
_PRE_NORM = LayerNorms(SublayerNorms(before=("input_layernorm",)), SublayerNorms(before=("post_attention_layernorm",)))
_SANDWICH = LayerNorms(SublayerNorms(("input_layernorm",), ("post_attention_layernorm",)),
                       SublayerNorms(("pre_feedforward_layernorm",), ("post_feedforward_layernorm",)))
_POST_NORM = LayerNorms(SublayerNorms(after=("post_attention_layernorm",)),
                        SublayerNorms(after=("post_feedforward_layernorm",)))
SUBLAYER_NORMS = {
    **dict.fromkeys(("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                     "Qwen3MoeDecoderLayer", "MixtralDecoderLayer", "Phi3DecoderLayer", "SmolLM3DecoderLayer",
                     "GptOssDecoderLayer"), _PRE_NORM),
    **dict.fromkeys(("Gemma2DecoderLayer", "Gemma3DecoderLayer"), _SANDWICH),
    "Olmo2DecoderLayer": _POST_NORM,
}


def sublayer_norms(layer: nn.Module) -> LayerNorms | None:
    """The norms of `layer` that touch its attention alone and its feed-forward block alone; None for a layer class
    not tested (the draft path then keeps all its norms)."""
    cls = type(layer)
    if not cls.__module__.startswith("transformers.models."):
        return None  # remote code may reuse a name for another layer
    norms = SUBLAYER_NORMS.get(cls.__name__)
    if norms is not None:
        for name in (*norms.attn.before, *norms.attn.after, *norms.mlp.before, *norms.mlp.after):
            if not isinstance(getattr(layer, name, None), nn.Module):
                raise AdapterError("sublayer norms", f"{cls.__name__} has no norm `{name}`")
    return norms


def attention_output(out: Any) -> torch.Tensor:
    """An attention module's output tensor (its forward returns (output, weights))."""
    return out[0] if isinstance(out, tuple) else out


def skipped_attention_output(hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
    """What a skipped attention returns in place of (output, weights): zeros, no weights."""
    return torch.zeros_like(hidden_states), None


def feed_forward_output(out: Any) -> torch.Tensor:
    """A feed-forward block's output tensor (GPT-OSS's comes with its router scores)."""
    return out[0] if isinstance(out, tuple) else out


def feed_forward_extras(block: nn.Module, hidden_size: int) -> int:
    """How many items a feed-forward block returns besides its output (0: it returns the tensor alone), from one
    forward of one token of zeros (its own forward: hooks on it are not run)."""
    parameter = next(block.parameters(), None)
    probe = torch.zeros(1, 1, hidden_size, dtype=getattr(parameter, "dtype", None),
                        device=getattr(parameter, "device", None))
    with torch.no_grad():
        out = block.forward(probe)
    if isinstance(out, torch.Tensor):
        return 0
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return len(out) - 1
    raise AdapterError("feed forward output", f"{type(block).__name__} returns a {type(out).__name__}")


def skipped_feed_forward_output(hidden_states: torch.Tensor, extras: int) -> Any:
    """What a skipped feed-forward block returns: zeros, in the structure the block itself returns."""
    zeros = torch.zeros_like(hidden_states)
    return (zeros, *(None,) * extras) if extras else zeros


def feed_forward_parameters_read(block: nn.Module, config: Any) -> int:
    """The parameters of a feed-forward block that one token reads: all of a dense block's; of a routed block, its
    router, shared experts and the `num_experts_per_tok` experts the router picks, not the other experts."""
    total = sum(p.numel() for p in block.parameters())
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module):
        return total
    stacked = [p for p in experts.parameters() if p.dim() >= 2]
    count = getattr(experts, "num_experts", None) or (stacked[0].shape[0] if stacked else None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not count or not top_k or any(p.shape[0] != count for p in experts.parameters()):
        raise AdapterError("routed experts", f"{type(block).__name__}.experts are not stacked by expert, or the "
                                             "config has no num_experts_per_tok")
    expert_parameters = sum(p.numel() for p in experts.parameters())
    return total - expert_parameters + expert_parameters * min(top_k, count) // count


# --- generate() and custom_generate --------------------------------------------------------------------------------

GenerationMode = generation_configuration.GenerationMode
GenerateDecoderOnlyOutput = generation_utils.GenerateDecoderOnlyOutput
_GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__

# Model inputs that generate prepares for every decoder-only call and that our loop replaces with its own.
PREPARED_GENERATE_INPUTS = frozenset({"attention_mask", "position_ids", "logits_to_keep", "past_key_values", "cache",
                                      "use_cache", "cache_position"})


def generate_cache_input(model_kwargs: dict[str, Any]) -> Any:
    """The cache generate hands a custom_generate (None when it made none)."""
    return model_kwargs.get("cache", model_kwargs.get("past_key_values"))


def generate_argument(name: str, depth: int) -> Any:
    """The argument `name` given to `generate` (None where it was not, or the caller is not generate), read from its
    frame `depth` frames up. transformers (5.x) passes a callable `custom_generate` only the parameters that its own
    `_sample` lacks, so the streamer never arrives as an argument (generate still puts the prompt into it; without
    this, the new tokens would never be streamed and `end()` never called), nor an `assistant_model` (which the
    callable must refuse rather than ignore)."""
    caller = sys._getframe(depth + 1)
    return caller.f_locals.get(name) if caller.f_code is _GENERATE_CODE else None


def stop_string_criteria(tokenizer: Any, stop_strings: str | list[str]) -> Any:
    """transformers' stopping criterion for `stop_strings`, which generate builds only for its own loops."""
    return StopStringCriteria(tokenizer, stop_strings)


def check_touchpoints(model: nn.Module) -> None:
    """Raise AdapterError, naming the touchpoint, where `model` lacks what the decoding loop relies on: checked once
    per model before its first forward, so that a release that moved something fails in one line, not inside one."""
    layer = decoder_layers(model)[0]
    keywords = {cache_keyword(module) for module in (model, layer, layer.self_attn)}
    if len(keywords) > 1:
        raise AdapterError("cache keyword", f"the model, its layers and their attention differ: {sorted(keywords)}")
    static_layer_class()
    cache_class()


warn_if_untested()
