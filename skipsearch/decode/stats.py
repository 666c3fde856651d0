"""What a decoding call reports: its tokens and statistics (rounds, acceptance, times, the guard's plain tokens,
the choices among skip sets)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from .choice import Choice
from .controller import GuardStats


@dataclass
class DecodeStats:
    new_tokens: int = 0
    rounds: int = 0
    # As verification judged them: a round's drafts past an EOS or a stopping criterion count, though not committed
    # (their acceptance is the draft's quality all the same; the one round per call they end changes a mean little).
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
    # Time of first calls of compiled steps during this call (tracing and compiling), inside wall_time_s.
    compile_time_s: float = 0.0
    guard: GuardStats = field(default_factory=GuardStats)  # tokens the controller decoded plainly, and why
    # The choice among several skip sets made at each prompt's prefill (choice.py); empty when none was made.
    choices: list[Choice] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens; None when nothing was drafted (plain decoding has none)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        """Accepted draft tokens per round that verified drafts (the guard's plain steps verify none, and counting them
        made a guarded run's mean look far below its acceptance); None when nothing was drafted."""
        drafting_rounds = sum(count for size, count in self.verify_sizes.items() if size > 1)
        return self.accepted / drafting_rounds if self.drafted and drafting_rounds else None

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of decoding: a first compiled call's compile time is reported apart, not in here."""
        seconds = self.wall_time_s - self.compile_time_s
        return self.new_tokens / seconds if seconds > 0 else 0.0

    def add(self, other: DecodeStats) -> None:
        for name in ("new_tokens", "rounds", "drafted", "accepted", "wall_time_s", "prefill_time_s",
                     "draft_time_s", "compile_time_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.verify_sizes.update(other.verify_sizes)
        self.verify_contexts.update(other.verify_contexts)
        self.guard.add(other.guard)
        self.choices.extend(other.choices)

    def as_dict(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "wall_time_s": self.wall_time_s,
            "prefill_time_s": self.prefill_time_s,
            "compile_time_s": self.compile_time_s,  # inside wall_time_s: a first compiled call is slow for this
            "tokens_per_second": self.tokens_per_second,
            "guard_plain_tokens": self.guard.plain_tokens,
            "guard_sample_tokens": self.guard.sample_tokens,
            "guard_fallbacks": self.guard.fallbacks,
            "choices": [choice.as_dict() for choice in self.choices],
        }


@dataclass
class GenerationOutput:
    tokens: list[int]  # the new tokens only, EOS included when it ended the generation
    stats: DecodeStats = field(default_factory=DecodeStats)
