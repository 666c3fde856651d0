"""One controller decides whether and how far to draft.

Before each round, `DraftController.plan` says how many tokens to draft, 0 meaning a plain step; after it, `observe`
takes what happened (drafted, accepted, committed, and the round's wall time where it was read). Every decision comes
from two estimates of the skip set being drafted with:
- `economics.Acceptance`, a draft's chance of being accepted (seeded by the prefill's agreement where several sets
  were chosen among, choice.py);
- `economics.PriceFit`, the seconds of a round of k drafts: at first the profile's (or the weights') shape, then fit
  from the rounds' times, which the loop has anyway (each iteration ends in its one host read).
The length planned is the one that commits the most tokens per second (Leviathan et al.'s optimal length, priced).
The guard is that choice with 0 on the menu and plain decoding's speed measured: every `ROUNDS_PER_CHECK` timed
rounds, when the planned length's expected speed is below `KEEP_ABOVE` of plain speed, the controller decodes plainly
for a stretch, then probes drafting again, each failed probe doubling the stretch (back-off). Where plain speed is not
known yet it is measured first (`PLAIN_SAMPLE_TOKENS`). CPU and CUDA run the same plan; where a draft's confidence can
be read for free (a CPU), `cut` lets the round stop early inside it, by the chance of acceptance that drafts of
that confidence have had (`economics.ConfidenceBins`).

What the controller learns across calls (plain speed, each set's back-off and acceptance) lives in a `DraftMemory`
that the caller holds: a server keeps one per model and passes it to every call, as bench does; a study's trial keeps
one across its prompts, so that it measures what they deliver. Without one, each call starts from the prior.

Switching between drafting and plain steps changes no token: greedy output is plain greedy output either way, and
sampling keeps the full model's distribution either way.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..io.files import read_json, write_atomic

from .economics import Acceptance, ConfidenceBins, Cut, PriceFit, RoundCosts, best_draft_length, committed_tokens
from .policy import DraftPolicy
from .skipset import SkipSet

ROUNDS_PER_CHECK = 4  # timed rounds between verdicts: a few tokens' worth, enough above timer noise
KEEP_ABOVE = 0.97  # keep drafting above this fraction of plain speed: losses under 3% are within noise
FIRST_BACKOFF_TOKENS = 32  # plain tokens after a first failed verdict; doubled after each failed probe
MAX_BACKOFF_TOKENS = 1024
PLAIN_SAMPLE_TOKENS = 8  # plain tokens decoded to measure plain speed when none is known yet
PLAIN_FADE = 0.8  # per plain token: plain speed follows the last few tokens


@dataclass
class GuardStats:
    """What the controller decoded plainly in a call, and why."""

    plain_tokens: int = 0  # tokens decoded plainly because drafting was losing
    sample_tokens: int = 0  # tokens decoded plainly to measure plain speed
    fallbacks: int = 0  # verdicts that stopped drafting
    last_ratio: float | None = None  # drafting's expected speed over plain speed at the last verdict

    def add(self, other: GuardStats) -> None:
        self.plain_tokens += other.plain_tokens
        self.sample_tokens += other.sample_tokens
        self.fallbacks += other.fallbacks
        self.last_ratio = other.last_ratio if other.last_ratio is not None else self.last_ratio

    def reason(self) -> str | None:
        """One line for people: how many tokens went plain and why; None when the guard never intervened."""
        if not self.fallbacks:
            return None
        times = "once" if self.fallbacks == 1 else f"{self.fallbacks} times"
        return (f"the guard decoded {self.plain_tokens} tokens plainly: drafting fell below {KEEP_ABOVE}x of plain "
                f"decoding's speed {times}, last measured at {self.last_ratio:.2f}x")


@dataclass
class Backoff:
    """When a skip set drafts again."""

    plain_left: int = 0  # tokens to decode plainly before drafting again
    sampling: bool = False  # the plain stretch measures plain speed, it is no fallback
    stretch: int = FIRST_BACKOFF_TOKENS  # the next failed verdict's plain stretch


@dataclass
class DraftMemory:
    """What drafting learned across calls, held by the caller: plain decoding's seconds per token by how the steps run
    (`plain_s`), each skip set's back-off (`backoffs`) and acceptance rate (`acceptance`: a call starts from it rather
    than from the prior), keyed by strings (`DraftController.key`). One per model: pass it to every call of a server
    (`generate(memory=...)`); `reset` forgets; `as_dict` / `from_dict` persist (files without `acceptance` read as
    having none)."""

    plain_s: dict[str, float] = field(default_factory=dict)
    backoffs: dict[str, Backoff] = field(default_factory=dict)
    acceptance: dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.plain_s.clear()
        self.backoffs.clear()
        self.acceptance.clear()

    def as_dict(self) -> dict:
        return {"plain_s": dict(self.plain_s), "backoffs": {k: asdict(v) for k, v in self.backoffs.items()},
                "acceptance": dict(self.acceptance)}

    @classmethod
    def from_dict(cls, data: dict) -> DraftMemory:
        """The memory from `as_dict`'s form; a ValueError of one line where a value is not what it must be."""
        if not isinstance(data, dict):
            raise ValueError("a draft memory is a JSON object")
        plain_s, backoffs, acceptance = data.get("plain_s", {}), data.get("backoffs", {}), data.get("acceptance", {})
        if not isinstance(plain_s, dict) or not all(type(v) in (int, float) and 0 < v < math.inf
                                                    for v in plain_s.values()):
            raise ValueError("plain_s must map step kinds to seconds per token, positive and finite")
        if not isinstance(backoffs, dict):
            raise ValueError("backoffs must map skip sets to back-offs")
        if not isinstance(acceptance, dict) or not all(type(v) in (int, float) and 0 <= v <= 1
                                                       for v in acceptance.values()):
            raise ValueError("acceptance must map skip sets to rates from 0 to 1")
        return cls({str(k): float(v) for k, v in plain_s.items()},
                   {str(k): _backoff(k, v) for k, v in backoffs.items()},
                   {str(k): float(v) for k, v in acceptance.items()})

    def save(self, path: str | Path, learned_by: str) -> None:
        """Persist to `path` (JSON, replaced atomically); `learned_by` names the model and device it was learned on."""
        write_atomic(path, json.dumps({"format": MEMORY_FORMAT, "version": MEMORY_VERSION, "learned_by": learned_by,
                                       **self.as_dict()}, indent=2) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> tuple[DraftMemory, str]:
        """The memory `save` wrote at `path`, and what it was learned by; a ValueError of one line naming the file
        where it is no such memory."""
        data, name = read_json(path, "draft memory"), repr(str(path))
        if not isinstance(data, dict) or data.get("format") != MEMORY_FORMAT:
            raise ValueError(f"{name}: not a skipsearch draft memory (expected \"format\": \"{MEMORY_FORMAT}\")")
        if data.get("version") != MEMORY_VERSION:
            raise ValueError(f"draft memory {name} is of version {data.get('version')!r}; this skipsearch reads "
                             f"version {MEMORY_VERSION}")
        if not isinstance(data.get("learned_by"), str):
            raise ValueError(f"draft memory {name} does not say what it was learned by")
        try:
            return cls.from_dict(data), data["learned_by"]
        except ValueError as error:
            raise ValueError(f"draft memory {name}: {error}") from None

    @classmethod
    def load(cls, path: str | Path, learned_by: str) -> DraftMemory:
        """`read`, refusing a memory learned by another model or device than `learned_by` (`check_learned_by`)."""
        memory, stored_by = cls.read(path)
        check_learned_by(path, stored_by, learned_by)
        return memory


MEMORY_FORMAT, MEMORY_VERSION = "skipsearch-draft-memory", 1


def check_learned_by(path: str | Path, stored_by: str, learned_by: str) -> None:
    """A ValueError of one line where the memory at `path` was learned by another model or device: its plain speed
    and back-offs would misjudge this one's rounds."""
    if stored_by != learned_by:
        raise ValueError(f"draft memory {str(path)!r} was learned by {stored_by!r}, not {learned_by!r}: its speeds "
                         "would misjudge this one's rounds; give another file, or delete this one")


def _backoff(key: str, fields: object) -> Backoff:
    """A back-off from its JSON form, each value in the range the controller gives it."""
    if not isinstance(fields, dict) or set(fields) != {"plain_left", "sampling", "stretch"}:
        raise ValueError(f"the back-off of {key!r} must have plain_left, sampling and stretch, and nothing else")
    plain_left, sampling, stretch = fields["plain_left"], fields["sampling"], fields["stretch"]
    if not (type(plain_left) is int and type(sampling) is bool and type(stretch) is int
            and 0 <= plain_left <= MAX_BACKOFF_TOKENS and FIRST_BACKOFF_TOKENS <= stretch <= MAX_BACKOFF_TOKENS):
        raise ValueError(f"the back-off of {key!r} is out of range (plain_left {plain_left!r}, sampling {sampling!r}, "
                         f"stretch {stretch!r})")
    return Backoff(plain_left, sampling, stretch)


class DraftController:
    """Decides each round's drafts for one call (module doc). `use` says which skip set drafts (None: plain
    decoding) and how its rounds are priced; `plan`, `cut` and `width` decide; `observe` learns."""

    def __init__(self, policy: DraftPolicy, memory: DraftMemory | None = None, steps_key: str = "eager"):
        self.policy, self.memory, self.steps_key = policy, memory if memory is not None else DraftMemory(), steps_key
        self.stats = GuardStats()
        self.skip: SkipSet | None = None
        self.skip_key = ""  # the memory's key of the set drafting now (`key`)
        self.acceptance: dict[SkipSet, Acceptance] = {}  # one estimate per skip set
        self.by_confidence: dict[SkipSet, ConfidenceBins] = {}  # and its drafts' acceptance by confidence (the cut)
        self.fit = PriceFit(RoundCosts(draft=1.0))
        self.backoff: Backoff | None = None  # None: no guard
        self.timed_rounds = 0  # timed drafting rounds since the last verdict
        self.guarding_plain = False  # the latest plan was a plain stretch of the guard's

    def key(self, skip: SkipSet | None = None) -> str:
        """The memory's key of plain speed (no `skip`) or of a skip set's back-off and acceptance, with these steps."""
        if skip is None:
            return self.steps_key
        head = f" {skip.head.digest[:16]}" if skip.head is not None else ""  # heads of one size differ by their rows
        return f"{self.steps_key} {skip}{head}"

    def use(self, skip: SkipSet | None, shape: RoundCosts | None = None, agreement: float | None = None) -> None:
        """Draft with `skip` (None: plain decoding), its rounds shaped as `shape`; `agreement` seeds its acceptance."""
        self.skip = skip
        if skip is None:
            return
        self.skip_key = self.key(skip)  # made once: observe stores the acceptance under it every round
        learned = self.memory.acceptance.get(self.skip_key) if skip not in self.acceptance else None
        estimate = self.acceptance.setdefault(skip, Acceptance())
        if agreement is not None or learned is not None:  # this prompt's agreement says more than earlier calls
            estimate.seed(agreement if agreement is not None else learned)
        self.fit = PriceFit(shape or RoundCosts(draft=1.0))
        self.backoff = self.memory.backoffs.setdefault(self.skip_key, Backoff()) if self.policy.guard else None

    @property
    def rate(self) -> float:
        """The acceptance estimate of the set drafting now."""
        return self.acceptance[self.skip].rate

    def plan(self, room: int) -> int:
        """Drafts for the next round, with `room` tokens left to decode; 0: plain steps."""
        most = min(self.policy.max_draft_tokens, room - 1) if self.skip is not None else 0
        self.guarding_plain = self.backoff is not None and self.backoff.plain_left > 0
        if most <= 0 or self.guarding_plain:
            return 0
        drafts = best_draft_length(self.rate, self._round_cost, most) if self.policy.adaptive else most
        if self.backoff is not None and self.timed_rounds >= ROUNDS_PER_CHECK:
            drafts = self._verdict(drafts)
            self.guarding_plain = drafts == 0
        return drafts

    def _round_cost(self, drafts: int) -> float:
        seconds = self.fit.round_s(drafts)
        return self.fit.shape.round(drafts) if seconds is None else seconds

    def _verdict(self, drafts: int) -> int:
        """`drafts`, or 0 where plain decoding is faster (the menu with 0 on it, losses within noise forgiven)."""
        plain_s = self.memory.plain_s.get(self.key())
        if plain_s is None:  # the rounds timed so far stay: the verdict comes after the plain sample
            self.backoff.plain_left, self.backoff.sampling = PLAIN_SAMPLE_TOKENS, True
            return 0
        self.timed_rounds = 0
        ratio = committed_tokens(self.rate, drafts) / self._round_cost(drafts) * plain_s
        self.stats.last_ratio = ratio
        if ratio >= KEEP_ABOVE:
            self.backoff.stretch = FIRST_BACKOFF_TOKENS
            return drafts
        self.stats.fallbacks += 1
        self.backoff.plain_left = self.backoff.stretch
        self.backoff.stretch = min(2 * self.backoff.stretch, MAX_BACKOFF_TOKENS)
        self.acceptance[self.skip].seed(self.rate)  # the probe after the stretch is judged mostly on its own rounds
        return 0

    def cut(self) -> Cut | None:
        """For a cut inside the round where a draft's confidence is free to read: the acceptance estimate, the price
        of a draft in plain steps, and the chance of acceptance that drafts of each confidence have had. The next
        token is drafted only while its chance of being accepted with every draft before it is above its price
        (`rounds.draft_round`). None: drafting runs the planned length (fixed-length policies, plain decoding)."""
        if not self.policy.adaptive or self.skip is None:
            return None
        bins = self.by_confidence.setdefault(self.skip, ConfidenceBins())
        return Cut(self.rate, self.fit.draft_price(), bins.chances(self.rate))

    def width(self, n_tokens: int, widest: int | None = None) -> int:
        """The width to verify `n_tokens` at: the cheapest priced width at least as wide, within the largest round
        (and `widest`, where a bound ahead allows no wider: `loop._widest`)."""
        most = self.policy.max_draft_tokens + 1
        return self.fit.shape.width(n_tokens, most if widest is None else min(most, widest))

    def observe(self, drafted: int, accepted: int, tokens: int, seconds: float | None,
                confidences: list[float] | None = None, draft_seconds: float | None = None) -> None:
        """A round (or a batch of plain steps) that drafted `drafted`, kept `accepted` of them and committed `tokens`
        in `seconds` of wall time (None: untimed, as a compiled step's first call is); `confidences` and
        `draft_seconds`: each draft's confidence and the drafts' part of `seconds`, where they were read (the cut)."""
        if confidences and self.skip is not None:
            self.by_confidence.setdefault(self.skip, ConfidenceBins()).observe(confidences, accepted)
        if drafted:
            self.acceptance[self.skip].observe(accepted, drafted)
            self.memory.acceptance[self.skip_key] = self.rate
            if seconds is not None:
                self.fit.observe(drafted, seconds, draft_seconds)
                self.timed_rounds += 1
        elif self.guarding_plain:
            self._observe_plain(tokens, seconds)

    def _observe_plain(self, tokens: int, seconds: float | None) -> None:
        backoff = self.backoff
        if backoff.sampling:
            self.stats.sample_tokens += tokens
        else:
            self.stats.plain_tokens += tokens
        backoff.plain_left = max(backoff.plain_left - tokens, 0)  # a batch of plain steps may overrun the stretch
        if backoff.plain_left <= 0:
            backoff.sampling = False
        if tokens and seconds:
            per_token, known = seconds / tokens, self.memory.plain_s.get(self.key())
            weight = 1.0 - PLAIN_FADE**tokens  # a batch of 8 steps counts as 8 single steps would
            self.memory.plain_s[self.key()] = per_token if known is None else (1 - weight) * known + weight * per_token
