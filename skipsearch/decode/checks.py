"""What the Python API is handed, checked before any work: a model this loop decodes, one prompt of integer token
ids inside the vocabulary, a skip set, draft policy and sampling of the right types, and room in the model's context
for what was asked. Each problem is one TypeError (a wrong kind of value) or ValueError (a wrong value) that says
what is wrong and, where it can, what to pass instead; without these checks they surface deep inside torch, or not
at all (a float id truncated, two prompts decoded joined as one, a cache of 64 TB allocated)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..io.models import check_context
from . import adapter
from .adapter import decoder_layers
from .config import SkipConfig
from .cost_profile import CostProfile
from .kvcache import check_cache_memory
from .policy import DraftPolicy, drafting_sets
from .sampling import Sampling
from .skipping import check_model
from .skipset import SkipSet


def check_prompt(model: nn.Module, input_ids: Any) -> torch.Tensor:
    """One prompt of integer token ids, each inside the model's vocabulary, as a (1, n) long tensor on its device.

    Accepts a sequence of ints, a 1-D tensor or array, and one row of either (a batch of one); refuses a batch of
    several prompts, floats, bools, text and the empty prompt."""
    check_model(model)
    if not isinstance(input_ids, torch.Tensor) and hasattr(input_ids, "__array__"):  # numpy's arrays and the like
        input_ids = torch.as_tensor(input_ids)
    if isinstance(input_ids, torch.Tensor):
        ids = _tensor_ids(input_ids)
    elif isinstance(input_ids, Sequence) and not isinstance(input_ids, (str, bytes)):
        ids = _listed_ids(input_ids)
    else:
        hint = ": tokenize it first (skipsearch.encode_prompt)" if isinstance(input_ids, (str, bytes)) else ""
        raise TypeError(f"input_ids must be token ids (a list of ints or a tensor), got {type(input_ids).__name__}"
                        f"{hint}")
    if ids.numel() == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    vocabulary = model.get_input_embeddings().num_embeddings
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocabulary:
        raise ValueError(f"token id {low if low < 0 else high} is outside the model's vocabulary "
                         f"(0..{vocabulary - 1}): were the ids made by this model's tokenizer?")
    return ids.to(model.device).view(1, -1)


def _tensor_ids(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"token ids must be integers, got a tensor of {str(tensor.dtype).removeprefix('torch.')}: "
                        "cast it with .long() only if its values are ids")
    if tensor.dim() == 2 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 1:
        raise ValueError(_batch_message(tensor.shape[0]) if tensor.dim() == 2 else
                         f"input_ids must be one prompt (1-D, or 2-D with one row), got shape {tuple(tensor.shape)}")
    return tensor.long()


def _listed_ids(ids: Sequence[Any]) -> torch.Tensor:
    if ids and all(_is_row(row) for row in ids):
        if len(ids) != 1:
            raise ValueError(_batch_message(len(ids)))
        return _row_ids(ids[0])
    return _row_ids(ids)


def _is_row(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _row_ids(row: Any) -> torch.Tensor:
    if isinstance(row, torch.Tensor):
        return _tensor_ids(row)
    row = [value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value for value in row]
    for position, value in enumerate(row):
        # bool is an Integral: True as a token id is a bug, not id 1. numpy's integers are Integrals too.
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"token ids must be integers, got {value!r} ({type(value).__name__}) at position "
                            f"{position}")
    return torch.tensor([int(value) for value in row], dtype=torch.long)


def _batch_message(rows: int) -> str:
    return f"generate decodes one prompt at a time, got a batch of {rows}: call it once per prompt"


def check_generate_args(model: nn.Module, prompt_tokens: int, skip: Any, max_new_tokens: Any, policy: Any,
                        sampling: Any, cost_profile: Any = None) -> None:
    """The options of `loop.generate`: their types, skip sets that fit the model, a cost profile made for its
    kind, and a prompt plus `max_new_tokens` plus drafts within the model's context (bounded before the cache is
    allocated)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    for one in skip if isinstance(skip, (list, tuple)) else (skip,):
        _check_skip(model, one, several=isinstance(skip, (list, tuple)))
    for name, value, kind in (("policy", policy, DraftPolicy), ("sampling", sampling, Sampling)):
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    if cost_profile is not None:
        if not isinstance(cost_profile, CostProfile):
            raise TypeError(f"cost_profile must be a CostProfile (CostProfile.load(path)), got "
                            f"{type(cost_profile).__name__}")
        cost_profile.check_model(model)
    check_room(model, prompt_tokens, max_new_tokens, skip, policy)


def check_room(model: nn.Module, prompt_tokens: int, max_new_tokens: int, skip: SkipSet | Sequence[SkipSet] | None,
               policy: DraftPolicy, flag: str = "max_new_tokens") -> None:
    """A ValueError unless the prompt and `max_new_tokens` (`flag` names it) fit the model's context; a
    ResourceExhausted when their cache, with a round's drafts when drafting, does not fit the device's free memory.

    A speculative round's verification (padded to the full draft width when compiled) reaches up to
    `max_draft_tokens` positions past the committed ones, so the cache holds those slots; but no forward reaches past
    the context (`forward_bounds`): near its end the rounds draft fewer tokens, or none."""
    drafts = policy.max_draft_tokens if drafting_sets(skip, policy) else 0
    check_context(model, prompt_tokens, max_new_tokens, flag=flag)
    check_cache_memory(model, prompt_tokens + max_new_tokens + drafts)  # the context allows it; the device may not


def forward_bounds(model: nn.Module) -> tuple[int, ...]:
    """The forward lengths (last position + 1) a verification must not cross, where plain decoding's one-token steps
    never do inside a forward: a rotary embedding's switch (`adapter.rope_switches`), past which every position of the
    forward would take other frequencies, and the model's context, past which no position exists."""
    context = getattr(model.config, "max_position_embeddings", None)
    return tuple(sorted({*adapter.rope_switches(model.config), *([context] if context else [])}))


def _check_skip(model: nn.Module, skip: Any, several: bool) -> None:
    """One skip set of `generate`'s `skip`: a SkipSet that fits the model (or, alone, None)."""
    if isinstance(skip, SkipConfig):
        raise TypeError("skip must be a SkipSet, got a SkipConfig: pass skip=config.skip (config.skip_sets for a "
                        "config of several sets), policy=config.draft")
    if skip is None and not several:
        return
    if not isinstance(skip, SkipSet):
        raise TypeError(f"skip must be a SkipSet (SkipSet.of(attn, mlp, num_layers)), a list of them or None, got "
                        f"{'a list holding ' if several else ''}{type(skip).__name__}")
    skip.check_fits(len(decoder_layers(model)))
