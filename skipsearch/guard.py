"""The run-time guard: drafting continues only while it measurably beats plain decoding.

A skip set chosen on calibration prompts can lose on other prompts, contexts or load (its acceptance
collapses). The guard times what the loop does anyway, with no extra host read: each loop iteration
ends in the round's one read-back, so the wall time between iterations is the iteration's true cost,
launches and Python included. Over every `ROUNDS_PER_CHECK` drafted rounds it compares tokens per second
with plain decoding's, over the drafted rounds since drafting last (re)started, the older ones fading
(`FADE`: acceptance comes in stretches, and one bad stretch is no verdict on a set that pays); when
drafting is slower than `KEEP_ABOVE` of plain speed it decodes plainly for a while, then probes
drafting again, each failed probe doubling the plain stretch (back-off). Plain
decoding's speed is measured when first needed (`PLAIN_SAMPLE_TOKENS` plain tokens) and then kept on
the model's engine across calls, refreshed whenever the guard decodes plainly. So is each skip set's
schedule (`Schedule`): a set that was losing when a call ended starts the next call where the back-off
left it, rather than paying a new verdict's drafted rounds per call.

Switching between drafting and plain steps changes no token: greedy output is plain greedy output either
way, and sampling keeps the full model's distribution either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROUNDS_PER_CHECK = 4  # drafted rounds timed between verdicts: a few tokens' worth, enough above timer noise
FADE = 0.9  # per drafted round: the verdict weighs about the last ten rounds since drafting (re)started
KEEP_ABOVE = 0.97  # keep drafting above this fraction of plain speed: losses under 3% are within noise
FIRST_BACKOFF_TOKENS = 32  # plain tokens after a first failed verdict; doubled after each failed probe
MAX_BACKOFF_TOKENS = 1024
PLAIN_SAMPLE_TOKENS = 8  # plain tokens decoded to measure plain speed when none is known yet


@dataclass
class PlainSpeed:
    """Plain decoding's measured seconds per token (None: not yet), kept per model and compile mode across calls."""

    seconds_per_token: float | None = None


@dataclass
class Schedule:
    """When the guard drafts again, kept per skip set across calls (on the engine, as `PlainSpeed` is)."""

    plain_left: int = 0  # tokens to decode plainly before drafting again
    sampling_plain: bool = False  # the plain stretch measures plain speed, it is no fallback
    backoff: int = FIRST_BACKOFF_TOKENS  # the next failed verdict's plain stretch


@dataclass
class GuardStats:
    """What the guard did in a call: tokens it decoded plainly, and why."""

    plain_tokens: int = 0  # tokens decoded plainly because drafting was losing
    sample_tokens: int = 0  # tokens decoded plainly to measure plain speed
    fallbacks: int = 0  # verdicts that stopped drafting
    last_ratio: float | None = None  # drafting's speed over plain speed at the last verdict

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
class Guard:
    """The guard's state for one call; `plain` and `schedule` are shared with the calls before and after it."""

    plain: PlainSpeed = field(default_factory=PlainSpeed)
    schedule: Schedule = field(default_factory=Schedule)
    stats: GuardStats = field(default_factory=GuardStats)
    drafted_rounds: int = 0  # timed rounds since the last verdict
    drafted_tokens: float = 0.0  # faded sums since drafting (re)started
    drafted_s: float = 0.0

    def drafting(self) -> bool:
        """Whether the next iteration drafts (True) or decodes plainly."""
        return self.schedule.plain_left <= 0

    def observe(self, tokens: int, seconds: float | None, drafted: bool) -> None:
        """Account one loop iteration: `tokens` committed in `seconds` of wall time (None: untimed, as a compiled
        step's first call is), by drafting or by plain steps."""
        if not drafted:
            self._observe_plain(tokens, seconds)
        elif seconds is not None:
            self.drafted_rounds += 1
            self.drafted_tokens = FADE * self.drafted_tokens + tokens
            self.drafted_s = FADE * self.drafted_s + seconds
            if self.drafted_rounds >= ROUNDS_PER_CHECK:
                self._verdict()

    def _observe_plain(self, tokens: int, seconds: float | None) -> None:
        if self.schedule.sampling_plain:
            self.stats.sample_tokens += tokens
        else:
            self.stats.plain_tokens += tokens
        self.schedule.plain_left -= tokens
        if self.schedule.plain_left <= 0:
            self.schedule.sampling_plain = False
        if tokens and seconds:
            per_token = seconds / tokens
            # A moving average weighted by tokens: a batch of 8 steps counts as 8 single steps would.
            weight = 1.0 - 0.8**tokens
            known = self.plain.seconds_per_token
            self.plain.seconds_per_token = per_token if known is None else (1 - weight) * known + weight * per_token

    def _verdict(self) -> None:
        plain_s = self.plain.seconds_per_token
        if plain_s is None:
            self.schedule.plain_left, self.schedule.sampling_plain = PLAIN_SAMPLE_TOKENS, True
            return  # the rounds timed so far stay: the verdict comes after the plain sample
        ratio = self.drafted_tokens / self.drafted_s * plain_s if self.drafted_s > 0 else float("inf")
        self.stats.last_ratio = ratio
        self.drafted_rounds = 0
        if ratio >= KEEP_ABOVE:
            self.schedule.backoff = FIRST_BACKOFF_TOKENS
            return
        self.drafted_tokens, self.drafted_s = 0.0, 0.0  # a probe after the plain stretch is judged on its own
        self.stats.fallbacks += 1
        self.schedule.plain_left = self.schedule.backoff
        self.schedule.backoff = min(2 * self.schedule.backoff, MAX_BACKOFF_TOKENS)
