"""Whether skipsearch runs a decoder family right, checked on a tiny random-weight model of its config.

Identical greedy output alone proves nothing about the draft, since verification corrects any draft.
So a family is checked against the definition of a skip: a skipped sublayer adds nothing to the
residual stream. The draft's logits must equal those of the model itself with the skipped
sublayers' outputs zeroed by forward hooks on its own attention and feed-forward modules
(`zeroed_logits`), and with every sublayer zeroed the layers must pass the residual stream
through, whatever norms surround the sublayers. Then greedy self-speculative decoding, eager and
compiled, must equal transformers' greedy decoding token for token. `check_family` runs all of
it on any config (`python -m skipsearch check-family --model CONFIG`); tests/test_families.py runs
it on every tested family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from ..io.errors import first_line
from ..io.models import load_config
from . import adapter
from .loop import generate
from .policy import DraftPolicy
from .skipping import SkippedLayer, draft_model, model_with_layers, supported_layers
from .skipset import SkipSet

TINY_LAYERS = 4
# A tiny model of any family: each size its config has, made small (head_dim where a family sets it apart from
# hidden_size / heads, as Gemma does; the experts of a routed block; a window that decoding soon runs past).
TINY_SIZES = {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": TINY_LAYERS,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 96,
              "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}
TINY_TOKENS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}  # for ids a tiny vocabulary lacks
SKIP = SkipSet.of([1, 3], [2, 3], TINY_LAYERS)  # attention alone, feed-forward alone, both and neither skipped
PROMPT = [5, 9, 14, 3, 22, 7, 11, 2]
TOLERANCE = 1e-4  # on fp32 logits


def tiny_config(config: PretrainedConfig, **overrides: Any) -> PretrainedConfig:
    """`config`'s decoder, shrunk to a tiny model of the same family: every size it sets made small, its per-layer
    lists cut to the tiny layer count (each attention kind it has kept), special tokens inside the tiny vocabulary,
    quantization dropped; then `overrides`. A one-line ValueError where the family's config refuses the result."""
    config = config.get_text_config(decoder=True)
    data = config.to_dict()
    layers = data.get("num_hidden_layers")
    data.update({key: value for key, value in TINY_SIZES.items() if data.get(key) is not None})
    for key, value in data.items():
        if isinstance(value, list) and layers and len(value) == layers:
            kinds = list(dict.fromkeys(value))  # layer_types: keep each kind, as Gemma's alternation does
            data[key] = [kinds[i % len(kinds)] for i in range(TINY_LAYERS)] if key == "layer_types" else \
                value[:TINY_LAYERS]
    for key, value in TINY_TOKENS.items():
        ids = data.get(key) if isinstance(data.get(key), list) else [data.get(key)]
        if any(isinstance(i, int) and i >= data["vocab_size"] for i in ids):
            data[key] = value
    data.pop("quantization_config", None)  # random weights are not quantized
    rope = data.get("rope_parameters")
    if isinstance(rope, dict):  # longrope's per-frequency factors: one per pair of the tiny head's dimensions
        data["rope_parameters"] = {k: v[: TINY_SIZES["head_dim"] // 2] if k in ("short_factor", "long_factor") and
                                   isinstance(v, list) else v for k, v in rope.items()}
    data.update(overrides)
    try:
        return type(config).from_dict(data)
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"cannot make a tiny {adapter.family(config)} config: {first_line(error)}") from None


def tiny_model(config: PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A random-weight causal LM of `config` (shrink it with `tiny_config` first), its logits sharpened so that
    drafts and acceptance are not trivial and greedy ties practically impossible."""
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False).eval()
    except ValueError as error:  # a config of a model that is not a causal LM
        raise ValueError(f"cannot build a causal LM of {adapter.family(config)}: {first_line(error)}") from None
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


@torch.no_grad()
def zeroed_logits(model: PreTrainedModel, ids: torch.Tensor, skip: SkipSet) -> torch.Tensor:
    """The logits of `model` itself with the outputs of the sublayers in `skip` zeroed by forward hooks on its own
    attention and feed-forward modules: the definition the draft is checked against."""

    def zero(module: torch.nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, tuple):
            return (torch.zeros_like(out[0]), *out[1:])
        return torch.zeros_like(out)

    layers = supported_layers(model)
    modules = [getattr(layers[i], adapter.ATTENTION) for i in skip.attn]
    modules += [getattr(layers[i], adapter.FEED_FORWARD) for i in skip.mlp]
    hooks = [module.register_forward_hook(zero) for module in modules]
    try:
        return model(ids).logits
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def draft_logits(model: PreTrainedModel, ids: torch.Tensor, skip: SkipSet) -> torch.Tensor:
    """The logits of the draft path of `skip` (`skipping.draft_model`)."""
    return draft_model(model, skip)(ids).logits


@dataclass(frozen=True)
class FamilyCheck:
    """What `check_family` found: the largest logit differences from the definitions, and which decodings equal
    transformers' greedy output (by mode: "eager", "compiled")."""

    family: str
    draft_error: float  # draft path vs the model with the skipped sublayers zeroed by hooks
    passthrough_error: float  # every sublayer zeroed by hooks vs layers that pass the residual stream through
    greedy: dict[str, bool] = field(default_factory=dict)

    @property
    def problems(self) -> list[str]:
        found = []
        if not self.draft_error <= TOLERANCE:
            found.append(f"the draft's logits differ from the zeroed sublayers' by {self.draft_error:.2e}")
        if not self.passthrough_error <= TOLERANCE:
            found.append(f"with every sublayer zeroed, the layers add {self.passthrough_error:.2e} to the logits "
                         "(a norm with a bias around a sublayer?)")
        found += [f"{mode} self-speculative greedy output differs from transformers' greedy output"
                  for mode, same in self.greedy.items() if not same]
        return found


def check_family(config: PretrainedConfig | str, seed: int = 0, compile: bool = True) -> FamilyCheck:
    """Check skipsearch on a tiny random-weight model of `config`'s family (see the module's doc); `config` may be
    where to read it from (`load_config`: a folder, a .json file or a Hub name). A one-line ValueError where the
    family is not one the draft path and the cache can run."""
    if not isinstance(config, PretrainedConfig):
        config = load_config(config)
    model = tiny_model(tiny_config(config), seed=seed)
    layers = supported_layers(model)
    ids = torch.tensor([PROMPT])
    draft_error = (draft_logits(model, ids, SKIP) - zeroed_logits(model, ids, SKIP)).abs().max().item()
    every = range(len(layers))
    passing = model_with_layers(model, torch.nn.ModuleList(SkippedLayer() for _ in every))
    with torch.no_grad():
        passthrough = passing(ids).logits
    passthrough_error = (zeroed_logits(model, ids, SkipSet.of(every, every)) - passthrough).abs().max().item()
    expected = greedy_tokens(model, PROMPT, 24)
    modes = {"eager": {}, **({"compiled": dict(compile=True, compile_backend="aot_eager",
                                                compile_mode="regional")} if compile else {})}
    greedy = {mode: generate(model, PROMPT, skip=SKIP, max_new_tokens=24, eos_token_id=None,
                             policy=DraftPolicy(max_draft_tokens=3, guard=False), **options).tokens == expected
              for mode, options in modes.items()}
    return FamilyCheck(adapter.family(model), draft_error, passthrough_error, greedy)


def greedy_tokens(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding of `prompt` (no EOS): the reference output."""
    pad = model.generation_config.pad_token_id
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                         pad_token_id=0 if pad is None else pad)
    return out[0, len(prompt):].tolist()


def format_check(check: FamilyCheck) -> str:
    """The report `check-family` prints: one line per check, then the verdict."""
    lines = [f"{check.family}, a tiny random-weight model of its config ({TINY_LAYERS} layers, {SKIP} skipped):",
             f"  draft vs sublayers zeroed by hooks: max logit difference {check.draft_error:.2e} "
             f"(tolerance {TOLERANCE:g})",
             f"  every sublayer zeroed vs layers passed through: {check.passthrough_error:.2e}"]
    lines += [f"  greedy self-speculative decoding, {mode}: {'equals' if same else 'DIFFERS from'} transformers' "
              "greedy output" for mode, same in check.greedy.items()]
    lines.append("supported: every check passed" if not check.problems else
                 f"NOT supported: {'; '.join(check.problems)}")
    return "\n".join(lines)
