"""How far a round may draft, and which skip sets draft under it. Kept apart from the decode loop, so that configs,
the command line and plots read it without importing torch."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, fields

from .skipset import SkipSet

# Fields added after configs and studies were first written, with the values files without them mean: written only
# when they differ, so that what an earlier release wrote reads back, and is written again, key for key.
LATER_FIELDS = {"guard": True}
# Fields of the rules the draft controller replaced (issue 27): accepted for one release, with a warning, and ignored.
DEPRECATED_FIELDS = ("confidence_threshold", "target_acceptance", "threshold_step", "stop_rule")


def deprecation(names: list[str], where: str) -> str:
    """The one line that says old policy fields were given and are ignored."""
    return (f"{where} {', '.join(names)}: no longer used (one draft controller decides how far to draft, "
            "controller.py); ignored, and refused in a later release")


@dataclass(frozen=True)
class DraftPolicy:
    """How far a round may draft, and whether drafting may give way to plain decoding.

    `max_draft_tokens`: the largest draft; 0 is plain autoregressive decoding through the same loop. With `adaptive`,
    the draft controller (controller.py) plans each round's length, up to that, from the acceptance it sees and the
    price of a round; without, every round drafts `max_draft_tokens` (what studies and fixed-length benchmarks run).
    `guard` lets the controller decode plainly while drafting measures slower than plain decoding; studies turn it
    off in their trials, which measure the skip set itself. The old rules' fields (`DEPRECATED_FIELDS`) are accepted
    for one release with a warning, and ignored.
    """

    max_draft_tokens: int = 8
    adaptive: bool = True
    guard: bool = True
    confidence_threshold: InitVar[float | None] = None
    target_acceptance: InitVar[float | None] = None
    threshold_step: InitVar[float | None] = None
    stop_rule: InitVar[str | None] = None

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> DraftPolicy:
        """A policy that a study stored (`as_dict`): the old rules' fields of earlier studies are dropped unsaid."""
        return cls(**{k: v for k, v in values.items() if k not in DEPRECATED_FIELDS})

    def as_dict(self) -> dict[str, object]:
        """The policy's fields for a file: those added later only where they differ from what their absence means."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in values.items() if k not in LATER_FIELDS or v != LATER_FIELDS[k]}

    def __post_init__(self, *old: object) -> None:
        given = [name for name, value in zip(DEPRECATED_FIELDS, old) if value is not None]
        if given:
            warnings.warn(deprecation(given, "DraftPolicy"), FutureWarning, stacklevel=3)
        if not isinstance(self.guard, bool):
            raise ValueError(f"guard must be true or false, got {self.guard!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if isinstance(self.max_draft_tokens, bool) or not isinstance(self.max_draft_tokens, int) or self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be an integer >= 0, got {self.max_draft_tokens!r}")


def drafting_skip(skip: SkipSet | None, policy: DraftPolicy) -> SkipSet | None:
    """The skip set to draft with, or None for plain decoding: no set, an empty set (drafting with nothing skipped
    is the full model twice over) or no draft tokens. The one place that decides what plain decoding is."""
    return skip if skip is not None and skip.drafts and policy.max_draft_tokens else None


def drafting_sets(skip: SkipSet | Sequence[SkipSet] | None, policy: DraftPolicy) -> tuple[SkipSet, ...]:
    """The distinct skip sets among `skip` (one, several or None) that draft (`drafting_skip`), in their order:
    with two or more, decoding chooses among them and plain decoding at each prompt's prefill (choice.py)."""
    given = (skip,) if skip is None or isinstance(skip, SkipSet) else tuple(skip)
    return tuple(dict.fromkeys(s for s in given if drafting_skip(s, policy) is not None))
