"""How many tokens a round drafts. Kept apart from the decode loop, so that configs, the command line and plots
read it without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, fields


STOP_RULES = ("threshold", "cost")
# Fields added after configs and studies were first written, with the values files without them mean: written only
# when they differ, so that what an earlier release wrote reads back, and is written again, key for key.
LATER_FIELDS = {"stop_rule": "threshold", "guard": True}


@dataclass(frozen=True)
class DraftPolicy:
    """How many tokens to draft per round.

    With `adaptive`, drafting stops early by `stop_rule`:
    - "threshold" (Draft & Verify): after a token whose draft top-1 probability is below
      `confidence_threshold`; after every round the threshold moves by `threshold_step` toward
      keeping the (smoothed) acceptance rate at `target_acceptance`.
    - "cost": after a token when the chance that the drafts so far and the next are all accepted
      (the product of their top-1 probabilities, times the smoothed acceptance for the next) is
      below what one more drafted token costs in plain steps, measured as the call goes
      (`economics.MarginalCost`): the next token is drafted only while it is expected to pay.
    Both stop at a token only after reading its confidence back. Where that read would stall the device
    (CUDA: `decoding.host_reads_stall`), adaptive drafting instead chooses each round's length before it,
    from the acceptance rate seen so far and the measured price of a draft
    (`economics.best_draft_length`), and verifies every draft it ran.
    `guard` keeps drafting only while it measurably beats plain decoding (guard.py); studies turn
    it off in their trials, which measure the skip set itself.
    `max_draft_tokens=0` is plain autoregressive decoding through the same loop.
    """

    max_draft_tokens: int = 8
    adaptive: bool = True
    confidence_threshold: float = 0.6
    target_acceptance: float = 0.7
    threshold_step: float = 0.05
    stop_rule: str = "threshold"
    guard: bool = True

    def as_dict(self) -> dict[str, object]:
        """The policy's fields for a file: those added later only where they differ from what their absence means."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in values.items() if k not in LATER_FIELDS or v != LATER_FIELDS[k]}

    def __post_init__(self) -> None:
        if self.stop_rule not in STOP_RULES:
            raise ValueError(f"stop_rule must be one of {', '.join(STOP_RULES)}, got {self.stop_rule!r}")
        if not isinstance(self.guard, bool):
            raise ValueError(f"guard must be true or false, got {self.guard!r}")
        if isinstance(self.max_draft_tokens, bool) or not isinstance(self.max_draft_tokens, int) or self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be an integer >= 0, got {self.max_draft_tokens!r}")
        for name in ("confidence_threshold", "target_acceptance", "threshold_step"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
