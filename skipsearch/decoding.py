"""Self-speculative decoding: draft with sublayers skipped, verify all drafts in one full forward.

Invariant of the loop: the KV cache holds the full model's keys and values for every
committed token but the last one, which is fed at the start of the next round.
A round drafts up to k tokens in draft mode, rolls every cache layer back to the
committed length, verifies `[last, d1..dk]` in one forward of the full model, and keeps
the longest accepted prefix plus one token of the full model. Greedy verification gives
exactly the tokens of plain greedy decoding; sampling uses speculative rejection sampling,
which keeps the full model's distribution.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .skipping import SkipSet, draft_mode


@dataclass(frozen=True)
class DraftPolicy:
    """How many tokens to draft per round.

    With `adaptive`, drafting stops after a token whose draft top-1 probability is below
    `confidence_threshold`, and after every round the threshold moves by `threshold_step`
    toward keeping the (smoothed) acceptance rate at `target_acceptance` (Draft & Verify).
    `max_draft_tokens=0` is plain autoregressive decoding through the same loop.
    """

    max_draft_tokens: int = 8
    adaptive: bool = True
    confidence_threshold: float = 0.6
    target_acceptance: float = 0.7
    threshold_step: float = 0.05

    def __post_init__(self) -> None:
        if isinstance(self.max_draft_tokens, bool) or not isinstance(self.max_draft_tokens, int) or self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be an integer >= 0, got {self.max_draft_tokens!r}")
        for name in ("confidence_threshold", "target_acceptance", "threshold_step"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")


@dataclass(frozen=True)
class Sampling:
    """Greedy by default; with `do_sample`, temperature / top-k / top-p through transformers' logits warpers."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @functools.cached_property
    def warpers(self) -> LogitsProcessorList:
        """Built once per Sampling (a cached property works on frozen dataclasses): the loop calls it per token."""
        warpers = LogitsProcessorList()
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k is not None:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Next-token distributions, one per row of `logits` (rows, vocab); fp32 for sampling."""
        # The warpers read no input ids for temperature / top-k / top-p.
        return torch.softmax(self.warpers(None, logits.float()), dim=-1)


@dataclass
class DecodeStats:
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    wall_time_s: float = 0.0
    prefill_time_s: float = 0.0  # the prompt's forward and the first token, inside wall_time_s
    # Time spent in draft forwards alone, for cost accounting; measured only when asked (it syncs).
    draft_time_s: float = 0.0
    # Verification rounds by the number of tokens they verified: the cost model needs the sizes, not the mean.
    verify_sizes: collections.Counter = field(default_factory=collections.Counter)
    # Rounds by (tokens verified, tokens cached before the round): the cost model prices each at its context.
    verify_contexts: collections.Counter = field(default_factory=collections.Counter)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens; None when nothing was drafted (plain decoding has none)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_tokens(self) -> float:
        """Accepted draft tokens per verification round."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def add(self, other: DecodeStats) -> None:
        for name in ("new_tokens", "rounds", "drafted", "accepted", "wall_time_s", "prefill_time_s", "draft_time_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.verify_sizes.update(other.verify_sizes)
        self.verify_contexts.update(other.verify_contexts)

    def as_dict(self) -> dict[str, float]:
        return {
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "wall_time_s": self.wall_time_s,
            "prefill_time_s": self.prefill_time_s,
            "tokens_per_second": self.tokens_per_second,
        }


@dataclass
class GenerationOutput:
    tokens: list[int]  # the new tokens only, EOS included when it ended the generation
    stats: DecodeStats = field(default_factory=DecodeStats)
    final_threshold: float | None = None


class SkipAwareCache(DynamicCache):
    """A DynamicCache whose layers may hold different lengths while drafting.

    Attention layers the draft skips are not written, so they lag behind. transformers
    sizes attention masks and query offsets by one fixed layer (the first full-attention
    one), which may be a skipped one; this cache sizes them by the longest layer of the
    same kind instead, which is the length every attention that runs actually reads.
    """

    def _longest_like(self, layer_idx: int) -> int:
        sliding = self.layers[layer_idx].is_sliding
        same_kind = [i for i, layer in enumerate(self.layers) if layer.is_sliding == sliding]
        return max(same_kind, key=lambda i: self.layers[i].get_seq_length())

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx < len(self.layers):
            layer_idx = self._longest_like(layer_idx)
        return super().get_mask_sizes(query_length, layer_idx)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        if layer_idx < len(self.layers):
            layer_idx = self._longest_like(layer_idx)
        return super().get_query_offset(layer_idx)

    def truncate(self, length: int) -> None:
        """Roll every layer back to at most `length` positions (a view, no copy)."""
        for layer in self.layers:
            excess = layer.get_seq_length() - length
            if excess > 0:
                # DynamicLayer.crop takes the (negative) number of positions to drop.
                layer.crop(-excess)
            elif layer.is_sliding and layer.get_seq_length() >= layer.sliding_window:
                layer.crop(0)  # drop the recorded past that no longer falls in the window


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos_set(eos_token_id: int | Iterable[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset((eos_token_id,))
    return frozenset(int(t) for t in eos_token_id)


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    *,
    skip: SkipSet | None = None,
    max_new_tokens: int = 128,
    policy: DraftPolicy = DraftPolicy(),
    sampling: Sampling = Sampling(),
    eos_token_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    time_drafts: bool = False,
) -> GenerationOutput:
    """Decode `max_new_tokens` (or up to EOS) for one prompt with self-speculative decoding.

    `skip=None`, an empty skip set or `policy.max_draft_tokens == 0` decodes autoregressively
    through the same loop. `generator` seeds sampling; it must live on the model's device.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    device = model.device
    prompt = torch.as_tensor(input_ids, dtype=torch.long, device=device).view(1, -1)
    if prompt.shape[1] == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    # Drafting with nothing skipped is the full model twice over: an empty set means plain decoding.
    max_draft = policy.max_draft_tokens if skip is not None and skip.size else 0
    eos = _eos_set(eos_token_id)
    threshold = policy.confidence_threshold
    smoothed_acceptance = policy.target_acceptance
    cache = SkipAwareCache(config=model.config)
    # Sliding-window layers forget what left the window, so rolling back past it needs the recorded past.
    cache.activate_past_recording()
    # Position ids are views into one tensor, so a forward costs no extra allocation for them.
    positions = torch.arange(prompt.shape[1] + max_new_tokens + max_draft + 1, device=device).view(1, -1)
    stats = DecodeStats()

    def forward(ids: torch.Tensor, start: int, last_only: bool) -> torch.Tensor:
        out = model(
            input_ids=ids,
            position_ids=positions[:, start : start + ids.shape[1]],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        return out.logits[0]

    def pick(probs_or_logits: torch.Tensor) -> torch.Tensor:
        if sampling.do_sample:
            return torch.multinomial(probs_or_logits, 1, generator=generator).view(-1)
        return probs_or_logits.argmax(-1).view(-1)

    synchronize(device)
    start_time = time.perf_counter()
    logits = forward(prompt, 0, last_only=True)
    last = pick(sampling.probabilities(logits) if sampling.do_sample else logits)
    tokens: list[int] = [int(last)]  # a host sync: the prefill time below is exact on CUDA too
    stats.prefill_time_s = time.perf_counter() - start_time
    cached = prompt.shape[1]  # positions in the cache; `last` sits at position `cached`

    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        budget = min(max_draft, max_new_tokens - len(tokens) - 1)
        drafts: list[torch.Tensor] = []
        draft_probs: list[torch.Tensor] = []
        cache.truncate(cached)  # the last verify may have written past the accepted tokens
        if budget > 0:
            if time_drafts:
                synchronize(device)
                draft_start = time.perf_counter()
            with draft_mode(model, skip):
                token = last
                for j in range(budget):
                    logits = forward(token.view(1, 1), cached + j, last_only=True)[0]
                    probs = sampling.probabilities(logits.view(1, -1))[0] if sampling.do_sample else None
                    token = pick(probs if probs is not None else logits)
                    drafts.append(token)
                    if probs is not None:
                        draft_probs.append(probs)
                    # The unsure token is kept: its forward is already paid, and verifying one
                    # more token costs far less than a forward on memory-bound hardware.
                    if policy.adaptive:
                        confidence = probs.max() if probs is not None else torch.softmax(logits.float(), -1).max()
                        if float(confidence) < threshold:
                            break
            if time_drafts:
                synchronize(device)
                stats.draft_time_s += time.perf_counter() - draft_start
            cache.truncate(cached)

        verify_ids = torch.cat([last, *drafts]).view(1, -1)
        logits = forward(verify_ids, cached, last_only=False)
        n_drafted = len(drafts)
        if sampling.do_sample:
            accepted, new_tokens, next_last = _rejection_sample(
                verify_ids[0, 1:], torch.stack(draft_probs) if drafts else None,
                sampling.probabilities(logits), generator,
            )
        else:
            targets = logits.argmax(-1)
            # One host transfer per round: the drafts and the full model's choices side by side.
            host = torch.cat([verify_ids[0, 1:], targets]).tolist()
            drafted_ids, chosen = host[:n_drafted], host[n_drafted:]
            accepted = 0
            while accepted < n_drafted and drafted_ids[accepted] == chosen[accepted]:
                accepted += 1
            new_tokens = chosen[: accepted + 1]
            next_last = targets[accepted : accepted + 1]

        stats.rounds += 1
        stats.verify_sizes[n_drafted + 1] += 1
        stats.verify_contexts[n_drafted + 1, cached] += 1
        stats.drafted += n_drafted
        stats.accepted += accepted
        if policy.adaptive and n_drafted:
            smoothed_acceptance = 0.5 * smoothed_acceptance + 0.5 * accepted / n_drafted
            step = policy.threshold_step if smoothed_acceptance < policy.target_acceptance else -policy.threshold_step
            threshold = min(1.0, max(0.0, threshold + step))

        new_tokens = new_tokens[: max_new_tokens - len(tokens)]
        for i, t in enumerate(new_tokens):
            if t in eos:
                new_tokens = new_tokens[: i + 1]
                break
        tokens.extend(new_tokens)
        cached += accepted + 1
        last = next_last

    synchronize(device)
    stats.wall_time_s = time.perf_counter() - start_time
    stats.new_tokens = len(tokens)
    return GenerationOutput(tokens=tokens, stats=stats, final_threshold=threshold if policy.adaptive else None)


def _rejection_sample(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, list[int], torch.Tensor]:
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept draft i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
    sample from the residual max(0, p - q) renormalised, and after k acceptances from the
    full model's next distribution. Returns the accepted count, the committed tokens, and
    the last of them as a device tensor.
    """
    k = drafts.shape[0]
    if k == 0:
        token = torch.multinomial(target_probs[-1], 1, generator=generator)
        return 0, token.tolist(), token
    index = drafts.view(-1, 1)
    p_draft = target_probs[:-1].gather(1, index).view(-1)
    q_draft = draft_probs.gather(1, index).view(-1)
    uniform = torch.rand(k, device=drafts.device, generator=generator)
    accepts = (uniform * q_draft <= p_draft).int()
    n_accepted = accepts.cumprod(0).sum()
    residual = (target_probs[:-1] - draft_probs).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # Where p == q the residual is empty; a rejection cannot happen there, so any row will do.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs[:-1])
    candidates = torch.cat([residual, target_probs[-1:]])
    corrections = torch.multinomial(candidates, 1, generator=generator).view(-1)
    host = torch.cat([n_accepted.view(1), drafts, corrections]).tolist()
    accepted = host[0]
    return accepted, host[1 : 1 + accepted] + [host[1 + k + accepted]], corrections[accepted : accepted + 1]
