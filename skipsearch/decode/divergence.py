"""Where two greedy decodings first differ, for reports of outputs that should be identical (bench, tests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Divergence:
    """Where two greedy decodings first differ, and how close the full model's top two choices were there."""

    position: int  # index into the new tokens
    top2_gap: float  # top-1 minus top-2 logit of the reference forward at that position (nan past its logits)


def first_divergence(reference: Sequence[int], candidate: Sequence[int], logits: torch.Tensor) -> Divergence | None:
    """The first position where `candidate` leaves `reference`, with the top-2 logit gap there.

    `logits` (len(reference), vocab) are the full model's logits predicting each reference token
    (`reference_logits`). In bf16 / fp16 a batched verify forward rounds differently from a
    one-token forward, so a near-tie (a small gap) can flip; a large gap points at a bug.
    """
    common = min(len(reference), len(candidate))
    position = next((i for i in range(common) if reference[i] != candidate[i]), common)
    if position == common and len(reference) == len(candidate):
        return None
    if position >= logits.shape[0]:
        return Divergence(position, float("nan"))
    top2 = logits[position].float().topk(2).values
    return Divergence(position, float(top2[0] - top2[1]))


@torch.inference_mode()
def reference_logits(model: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """The model's logits predicting each of `tokens` after `prompt`, teacher-forced in one forward."""
    ids = torch.tensor([list(prompt) + list(tokens)], device=model.device)
    return model(ids[:, :-1]).logits[0, len(prompt) - 1 :]
