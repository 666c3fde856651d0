"""How tokens are sampled: greedy, or temperature / top-k / top-p, and the speculative rejection sampling that keeps the
full model's distribution when drafts are sampled."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..constants import MIN_TEMPERATURE


@dataclass(frozen=True)
class Sampling:
    """Greedy by default; with `do_sample`, temperature / top-k / top-p through transformers' logits warpers."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not MIN_TEMPERATURE <= self.temperature < math.inf:  # nan too
            raise ValueError(f"temperature must be a finite number >= {MIN_TEMPERATURE:g}, got {self.temperature!r}: "
                             "lower samples as greedy decoding does (use do_sample=False) and overflows float32 "
                             "logits")
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


def rejection_sample(
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
    accepts = (uniform * q_draft < p_draft).int()  # u in [0, 1): strict, or u = 0 accepted a token p gives 0
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
