"""How many tokens a round drafts. Kept apart from the decode loop, so that configs, the command line and plots
read it without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


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
