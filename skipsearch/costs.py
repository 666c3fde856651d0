"""A device cost model: profile what drafting and verifying cost, and predict a skip set's speedup.

Costs are measured, not assumed, at several context lengths, since attention reads the whole
KV cache. At each length, one-token forwards with all attention skipped and with all MLPs
skipped, subtracted from the full forward, give the marginal time of one attention and one
MLP sublayer; the rest of the full forward (embeddings, final norm, lm_head, dispatch) is what
remains. A draft's cost is thus the full forward less what it skips, exact for the empty set
and closest for the sparse sets that matter. Verifying n tokens is timed directly for each n.
Draft mode is entered once around the timed forwards, so the mode switch does not bias the
marginal costs; what a round pays besides forwards (the switch, the host sync of the verified
tokens, adaptive drafting's softmax and sync) is measured on its own, in the real decoder.
Predictions interpolate every cost at each round's context length. A profile is JSON, so a
study on one machine can be scored with another machine's costs.
"""

from __future__ import annotations

import bisect
import contextlib
import datetime
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from . import adapter
from .decoding import DecodeStats, DraftPolicy, generate, synchronize
from .economics import sublayer_weights
from .engine import CompileSettings, engine_for, forward_at_position
from .files import read_json, write_atomic
from .kvcache import SpeculativeCache
from .skipping import SkipSet, draft_mode

PROFILE_FORMAT = "skipsearch/cost-profile"
PROFILE_VERSION = 3  # 3 added each layer's sublayer shares; 2 (no shares) reads as all alike
CPU_CONTEXTS = (128, 1024)
CUDA_CONTEXTS = (128, 512, 2048, 8192, 32768)


@dataclass(frozen=True)
class ContextCosts:
    """Forward costs with `context_tokens` already in the KV cache."""

    context_tokens: int
    attn_s: float  # one attention sublayer, one token
    mlp_s: float  # one MLP sublayer, one token
    rest_s: float  # the full forward less all sublayers: embeddings, final norm, lm_head, overhead
    verify_s: list[float]  # verify_s[n - 1]: one full forward of n tokens

    def verify_time(self, n_tokens: float) -> float:
        """Time to verify `n_tokens`: the cheapest measured width at least as wide (hardware prices widths in steps, and
        the loop pads to that width), interpolated between whole widths, extrapolated past the last."""
        envelope = self.envelope()
        if n_tokens <= 1:
            return envelope[0]
        low = min(int(n_tokens), len(envelope))
        if low == len(envelope):
            slope = envelope[-1] - envelope[-2] if len(envelope) > 1 else 0.0
            return envelope[-1] + max(0.0, slope) * (n_tokens - low)
        frac = n_tokens - low
        return envelope[low - 1] * (1 - frac) + envelope[low] * frac

    def envelope(self) -> list[float]:
        """envelope[n - 1]: the cheapest measured verification of n tokens or more; non-decreasing in n."""
        cheapest, out = float("inf"), []
        for cost in reversed(self.verify_s):
            cheapest = min(cheapest, cost)
            out.append(cheapest)
        return out[::-1]


@dataclass(frozen=True)
class Overheads:
    """What decoding pays besides forwards, in seconds (zero in profiles that did not measure it).

    `round_s` and `draft_token_s` are residuals of the real decoder's wall time over the profiled forwards, so they
    also absorb any difference between forwards in the loop and forwards timed alone; one below zero is clipped to 0
    (profiles of older versions may hold negatives). `adaptive_token_s` is the confidence read, timed directly.
    """

    round_s: float = 0.0  # every round, plain or speculative: cache roll-back, host transfer, bookkeeping
    switch_s: float = 0.0  # entering and leaving draft mode, once per speculative round
    switch_sublayer_s: float = 0.0  # ... plus this per skipped sublayer
    draft_token_s: float = 0.0  # per drafted token besides its forward: picking it, loop bookkeeping
    adaptive_token_s: float = 0.0  # per drafted token cut by confidence (a CPU's adaptive rounds): the softmax, its read


@dataclass(frozen=True)
class CostProfile:
    device: str
    dtype: str
    architecture: str
    num_hidden_layers: int
    contexts: tuple[ContextCosts, ...]  # sorted by context length
    overheads: Overheads = Overheads()
    provenance: dict = field(default_factory=dict)  # date, device name, versions, how the model was built
    # Each layer's attention and feed-forward block relative to the mean of its kind (whose cost `contexts` hold):
    # the weights a token reads in it (`economics.sublayer_weights`: a routed block by the experts it reads), so that
    # a model of dense and routed layers prices each right. Empty (profiles of older versions): all alike.
    attn_shares: tuple[float, ...] = ()
    mlp_shares: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.contexts:
            raise ValueError("a cost profile needs at least one context length")
        object.__setattr__(self, "contexts", tuple(sorted(self.contexts, key=lambda c: c.context_tokens)))
        for name in ("attn_shares", "mlp_shares"):
            shares = tuple(getattr(self, name))
            if shares and len(shares) != self.num_hidden_layers:
                raise ValueError(f"{name} has {len(shares)} entries for {self.num_hidden_layers} layers")
            object.__setattr__(self, name, shares)

    @property
    def context_lengths(self) -> list[int]:
        return [c.context_tokens for c in self.contexts]

    @property
    def forward_s(self) -> float:
        """One full one-token forward at the shortest profiled context."""
        return self.contexts[0].verify_s[0]

    def _at(self, context: float, cost: Callable[[ContextCosts], float]) -> float:
        """`cost` at `context` tokens: linear between profiled lengths, the nearest segment's slope beyond them."""
        lengths = self.context_lengths
        if len(lengths) == 1:
            return cost(self.contexts[0])
        i = min(max(bisect.bisect_right(lengths, context), 1), len(lengths) - 1)
        low, high = self.contexts[i - 1], self.contexts[i]
        frac = (context - low.context_tokens) / (high.context_tokens - low.context_tokens)
        return max(0.0, cost(low) + frac * (cost(high) - cost(low)))

    def attn_at(self, context: float) -> float:
        return self._at(context, lambda c: c.attn_s)

    def forward_at(self, context: float) -> float:
        return self._at(context, lambda c: c.verify_s[0])

    def draft_s(self, skip: SkipSet, context: float | None = None) -> float:
        """Predicted time of one draft forward with `skip` skipped (at the shortest profiled context by default)."""
        context = self.context_lengths[0] if context is None else context
        kept_attn, kept_mlp = self._kept(self.attn_shares, skip.attn), self._kept(self.mlp_shares, skip.mlp)
        return self._at(context, lambda c: c.rest_s + kept_attn * c.attn_s + kept_mlp * c.mlp_s)

    def _kept(self, shares: tuple[float, ...], skipped: tuple[int, ...]) -> float:
        """The sublayers of one kind a draft still runs, each counted by its share (1 each without shares)."""
        if not shares:
            return self.num_hidden_layers - len(skipped)
        return sum(shares) - sum(shares[i] for i in skipped)

    def verify_time(self, n_tokens: float, context: float | None = None) -> float:
        """Time to verify `n_tokens` with `context` tokens cached (the shortest profiled context by default)."""
        context = self.context_lengths[0] if context is None else context
        return self._at(context, lambda c: c.verify_time(n_tokens))

    def verify_measured(self, n_tokens: int, context: float | None = None) -> float:
        """A verification of exactly `n_tokens` as measured, out of order where widths step (`verify_time` prices it
        padded); past the measured widths, `verify_time`'s extrapolation."""
        context = self.context_lengths[0] if context is None else context
        return self._at(context, lambda c: c.verify_s[n_tokens - 1] if n_tokens <= len(c.verify_s)
                        else c.verify_time(n_tokens))

    def switch_time(self, skip: SkipSet) -> float:
        return self.overheads.switch_s + self.overheads.switch_sublayer_s * skip.size

    def predict_speedup(self, skip: SkipSet, stats: DecodeStats, adaptive: bool = False) -> float:
        """Plain-decoding time over self-speculative time for the decoding that `stats` describes.

        Each round drafts (verified tokens - 1) tokens at its context length, then verifies them;
        plain decoding spends one forward and one round per committed token, at the contexts
        those tokens had. `adaptive`: the drafts paid adaptive drafting's confidence check.
        """
        if stats.rounds == 0 or not skip.size:
            return 1.0
        rounds = stats.verify_contexts or {(n, self.context_lengths[0]): m for n, m in stats.verify_sizes.items()}
        o = self.overheads
        per_draft = o.draft_token_s + (o.adaptive_token_s if adaptive else 0.0)
        # Committed tokens per round (accepted + 1); the first token comes from the prefill in both.
        committed = (stats.accepted + stats.rounds) / stats.rounds
        speculative = plain = 0.0
        for (n_tokens, context), count in rounds.items():
            drafts = n_tokens - 1
            speculative += count * (drafts * (self.draft_s(skip, context) + per_draft)
                                    + self.verify_time(n_tokens, context) + o.round_s
                                    + (self.switch_time(skip) if drafts else 0.0))
            plain += count * committed * (self.forward_at(context + (committed - 1) / 2) + o.round_s)
        return plain / speculative

    def to_dict(self) -> dict:
        """The JSON form: version 2's where the profile has no sublayer shares (read from a version-2 file), so that a
        stored profile is written back as it was; version 3 with them."""
        data = {**asdict(self), "contexts": [asdict(c) for c in self.contexts]}
        if not self.attn_shares and not self.mlp_shares:
            del data["attn_shares"], data["mlp_shares"]
            return {"format": PROFILE_FORMAT, "version": 2, **data}
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **data}

    @classmethod
    def from_dict(cls, data: dict) -> CostProfile:
        """A profile from its JSON form; a version-1 (single context, no overheads) or version-2 (no sublayer shares)
        profile is read as is."""
        data = dict(data)
        data.pop("format", None)
        version = data.pop("version", 1)
        if version == 1:
            single = {k: data.pop(k) for k in ("context_tokens", "attn_s", "mlp_s", "rest_s", "verify_s")}
            return cls(**data, contexts=(ContextCosts(**single),))
        if version not in (2, PROFILE_VERSION):
            raise ValueError(f"cost profile version {version} is newer than this skipsearch reads ({PROFILE_VERSION})")
        contexts = tuple(ContextCosts(**c) for c in data.pop("contexts"))
        overheads = Overheads(**data.pop("overheads", {}))
        return cls(**data, contexts=contexts, overheads=overheads)

    def save(self, path: str | Path) -> None:
        write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        data = read_json(path, "cost profile")
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{path}: not a skipsearch cost profile (expected \"format\": \"{PROFILE_FORMAT}\")")
        try:
            return cls.from_dict(data)
        except (TypeError, KeyError, AttributeError) as error:
            raise ValueError(f"{path}: malformed cost profile ({error})") from None
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    def check_model(self, model: torch.nn.Module) -> None:
        if (self.architecture, self.num_hidden_layers) != (type(model).__name__, model.config.num_hidden_layers):
            raise ValueError(
                f"cost profile is for {self.architecture} with {self.num_hidden_layers} layers, not "
                f"{type(model).__name__} with {model.config.num_hidden_layers}"
            )

    def label(self) -> str:
        name = self.provenance.get("device_name")
        return f"{self.device}{f' ({name})' if name else ''}, {self.dtype}"


def study_compile_mode(device: torch.device) -> str | None:
    """What a profile times by default: on CUDA the regional steps as CUDA graphs, which studies and `--compile`
    run there (eager forwards on a GPU time the host's Python, not the GPU); on a CPU the eager forwards."""
    return "regional" if device.type == "cuda" else None


def default_contexts(model: torch.nn.Module, max_verify_tokens: int = 9) -> list[int]:
    """Context lengths to profile: modest on a CPU; on CUDA up to what the KV cache leaves of a quarter of free memory."""
    limit = (getattr(model.config, "max_position_embeddings", None) or 1 << 30) - max_verify_tokens - 1
    candidates = CPU_CONTEXTS
    if model.device.type == "cuda":
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize
        # The prefill's activations (an MLP's intermediate output is the largest) count too.
        per_token += 4 * config.intermediate_size * model.dtype.itemsize
        free, _ = torch.cuda.mem_get_info(model.device)
        candidates = [c for c in CUDA_CONTEXTS if c * per_token <= free // 4] or CUDA_CONTEXTS[:1]
    return sorted({min(c, limit) for c in candidates if min(c, limit) >= 1})


def contexts_for(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 max_verify_tokens: int = 9) -> list[int]:
    """The context lengths that decoding `prompts` spans: the shortest prompt and the longest one decoded
    (within the model's positions)."""
    lengths = [len(p) for p in prompts]
    limit = (getattr(model.config, "max_position_embeddings", None) or 1 << 30) - max_verify_tokens
    return sorted({min(min(lengths), limit), min(max(lengths) + max_new_tokens, limit)})


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _provenance(model: torch.nn.Module) -> dict:
    import transformers

    return {"created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device_name": device_name(model.device), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads()}


class NoisyMachine(ValueError):
    """The timings of a profile did not settle: the machine is too busy for its costs to mean anything."""


# How far a profile's figures may stray before they are taken for noise: repeats of one measurement agree when their
# median's 95% interval is at most TOLERANCE of it either way (judged from 5 runs on). That is the only refusal: costs
# out of order by width are the hardware's steps (priced as measured, `ContextCosts.envelope`), and a part or an
# overhead below zero is clipped to 0 and reported in the profile's provenance ("clipped").
TOLERANCE = 0.25
_MIN_RUNS_FOR_INTERVAL = 5


def median_interval(runs: Sequence[float]) -> tuple[float, float]:
    """The median of `runs` and the half-width of its 95% interval (normal approximation on the median absolute
    deviation, robust to the outliers a busy machine makes); the half-width is infinite below 5 runs."""
    median = statistics.median(runs)
    if len(runs) < _MIN_RUNS_FOR_INTERVAL:
        return median, math.inf
    mad = statistics.median(abs(r - median) for r in runs)
    return median, 1.96 * 1.2533 * 1.4826 * mad / math.sqrt(len(runs))


@dataclass
class _ContextRuns:
    """The timed runs of one context length, pooled over the profile's attempts."""

    context_tokens: int
    verify: list[list[float]]  # verify[n - 1]: runs of n tokens
    one_token: dict[str, list[float]]  # runs of one token: "full", "no_attn", "no_mlp"

    def costs(self, num_layers: int) -> ContextCosts:
        # A one-token forward is timed in the verify runs and among the draft-mode blocks alike: pooled, the same
        # figure prices verifying one token and a draft that skips nothing, and anchors the parts (the rest is what
        # no_attn + no_mlp count twice), so that no two independent medians' noise lands in a difference.
        forward = statistics.median(self.verify[0] + self.one_token["full"])
        no_attn, no_mlp = statistics.median(self.one_token["no_attn"]), statistics.median(self.one_token["no_mlp"])
        attn_s, mlp_s = max(0.0, (forward - no_attn) / num_layers), max(0.0, (forward - no_mlp) / num_layers)
        rest_s = max(0.0, forward - num_layers * (attn_s + mlp_s))
        # Widths as measured, out of order where the hardware's kernels step so (the envelope prices them).
        verify = [forward] + [statistics.median(runs) for runs in self.verify[1:]]
        return ContextCosts(context_tokens=self.context_tokens, attn_s=attn_s, mlp_s=mlp_s, rest_s=rest_s,
                            verify_s=verify)

    def problems(self) -> list[str]:
        """Why these runs are not a profile yet: repeats of a measurement that disagree (a median whose 95% interval
        is wider than TOLERANCE of it; judged from 5 runs on: fewer have no interval)."""
        found = []
        timed = {**{f"verify {n + 1}": runs for n, runs in enumerate(self.verify)}, **self.one_token}
        for name, runs in timed.items():
            median, half = median_interval(runs)
            if math.isfinite(half) and half > TOLERANCE * median:
                found.append(f"at context {self.context_tokens}, {name}'s 95% interval is +-{half / median:.0%} of it")
        return found

    def clipped(self, num_layers: int) -> list[str]:
        """Parts the medians put at or below zero, which `costs` clips to 0: facts of the device, reported."""
        forward = statistics.median(self.verify[0] + self.one_token["full"])
        attn = (forward - statistics.median(self.one_token["no_attn"])) / num_layers
        mlp = (forward - statistics.median(self.one_token["no_mlp"])) / num_layers
        found = [(part, value) for part, value in (("attention", attn), ("MLP", mlp),
                                                   ("rest", forward - num_layers * (max(0, attn) + max(0, mlp))))
                 if value <= 0]
        return [f"at context {self.context_tokens}, a {part} cost of {value * 1e3:.3f} ms, clipped to 0"
                for part, value in found]


@torch.inference_mode()
def profile_costs(
    model: torch.nn.Module, contexts: Sequence[int] | None = None, max_verify_tokens: int = 9, repeats: int = 20,
    calibrate: bool = True, show_progress: bool = False, clock: Callable[[], float] | None = None, attempts: int = 4,
    compile_mode: str | None = None, budget_s: float | None = None,
) -> CostProfile:
    """Time the pieces of a forward at each context length on the model's device and dtype (medians of
    `repeats` runs); with `calibrate`, also what the decoder pays besides forwards. With `compile_mode` (engine.py's
    modes: "regional" is what studies run, as CUDA graphs on CUDA) the profile times the compiled steps decoding then
    runs, and the decoding runs of the calibration are compiled alike; without, the eager forwards.

    Repetition decides noise: while repeats of a measurement disagree (`_ContextRuns.problems`), all are measured
    again and pooled with the runs before, up to `attempts` rounds or, after the first, `budget_s` seconds of wall
    time (default: `GPU_BUDGET_S` on CUDA, unbounded on a CPU), which also stops longer contexts from being begun
    (the profile then has fewer); then `NoisyMachine` says what did not settle. Costs
    out of order by width are priced as measured, and parts or overheads below zero are clipped to 0 and listed in
    the provenance ("clipped"). `clock` (default `time.perf_counter`) times the forwards.
    """
    clock = clock or time.perf_counter
    contexts = sorted(set(contexts or default_contexts(model, max_verify_tokens)))
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and contexts[-1] + max_verify_tokens > limit:
        raise ValueError(f"context {contexts[-1]} + {max_verify_tokens} verified tokens exceeds the model's "
                         f"{limit} positions")
    runs = [_ContextRuns(c, [[] for _ in range(max_verify_tokens)], {"full": [], "no_attn": [], "no_mlp": []})
            for c in contexts]
    budget_s = budget_s if budget_s is not None else GPU_BUDGET_S if model.device.type == "cuda" else math.inf
    started, problems = time.perf_counter(), []
    for attempt in range(attempts):
        _time_forwards(model, runs, repeats, clock, warm=attempt == 0, show_progress=show_progress,
                       compile_mode=compile_mode, deadline=started + budget_s)
        runs = [r for r in runs if r.verify[0]]  # past the budget, longer contexts were left out: fewer contexts
        problems = [p for r in runs for p in r.problems()]
        if not problems or time.perf_counter() - started > budget_s:
            break
    if problems:
        raise NoisyMachine(
            f"this machine is too noisy to profile: after {attempt + 1} rounds of {repeats} timed runs, repeats "
            f"disagree: {problems[0]}{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; profile again "
            "when it is idle (other programs closed), or profile a quiet machine of this kind and give its file with "
            "--cost-profile")
    profile = _profile(model, [r.costs(model.config.num_hidden_layers) for r in runs])
    clipped = [c for r in runs for c in r.clipped(model.config.num_hidden_layers)]
    if calibrate:
        overheads, more = _calibrated(model, profile, repeats, compile_mode, clock)
        profile, clipped = replace(profile, overheads=overheads), clipped + more
    return replace(profile, provenance={**profile.provenance, "clipped": clipped}) if clipped else profile


GPU_BUDGET_S = 60.0  # a profile's measuring again on a GPU stops after this: a shape's profile ends within minutes


def _calibrated(model: torch.nn.Module, profile: CostProfile, repeats: int, compile_mode: str | None,
                clock: Callable[[], float]) -> tuple[Overheads, list[str]]:
    """What a round pays besides its forwards: the draft-mode switch and the confidence read, timed directly; the
    rest, residuals of real decoding runs over the profiled forwards (`_overheads`), with what was clipped."""
    switches = replace(_switch_costs(model, clock), adaptive_token_s=_confidence_read_s(model, clock))
    decodes = _decoding_runs(model, replace(profile, overheads=switches), max(1, min(repeats, 5)), compile_mode)
    return _overheads(replace(profile, overheads=switches), decodes, model)


def _confidence_read_s(model: torch.nn.Module, clock: Callable[[], float], runs: int = 200) -> float:
    """What the cut inside a round pays per draft besides the draft: its confidence (a softmax over the vocabulary)
    read back to the host. Timed directly: a residual of two decodings' times would be a small difference of noise."""
    logits = torch.zeros((1, model.config.vocab_size), device=model.device, dtype=model.dtype)
    times = []
    for _ in range(runs):
        synchronize(model.device)
        start = clock()
        float(torch.softmax(logits.float(), -1).max())
        times.append(clock() - start)
    return statistics.median(times)


def _profile(model: torch.nn.Module, contexts: list[ContextCosts]) -> CostProfile:
    weights = sublayer_weights(model)
    return CostProfile(device=str(model.device), dtype=str(model.dtype).removeprefix("torch."),
                       architecture=type(model).__name__, num_hidden_layers=model.config.num_hidden_layers,
                       contexts=tuple(contexts), provenance=_provenance(model),
                       attn_shares=_shares(weights.attn), mlp_shares=_shares(weights.mlp))


def _shares(weights: Sequence[int]) -> tuple[float, ...]:
    """Each layer's weights relative to their mean."""
    mean = sum(weights) / len(weights)
    return tuple(w / mean for w in weights)


def _draft_kinds(num_layers: int) -> dict[str, SkipSet]:
    every = range(num_layers)
    return {"full": SkipSet(), "no_attn": SkipSet.of(every, (), num_layers), "no_mlp": SkipSet.of((), every, num_layers)}


def _compiled_forwards(model: torch.nn.Module, ids: torch.Tensor, context: int, max_verify_tokens: int, mode: str
                       ) -> tuple[SpeculativeCache, Callable[[int], None], dict[str, Callable[[], None]]]:
    """The engine's own compiled steps at one context, after an eager prefill: the cache, `verify(n_tokens)`, and
    one-token forwards of each draft kind (the full one is the plain step). Each step advances the position."""
    engine, settings = engine_for(model), CompileSettings(mode=mode)
    length = context + max_verify_tokens
    verify = {n: engine.prepare(length, None, settings, n).verify for n in range(1, max_verify_tokens + 1)}
    steps = {name: engine.prepare(length, skip, settings, 1).draft or verify[1]
             for name, skip in _draft_kinds(model.config.num_hidden_layers).items()}
    cache = engine.cache
    cache.seek(0)
    forward_at_position(model, cache, ids[:, :context], logits_to_keep=1)
    one = ids[:, context : context + 1]
    return (cache, lambda n: verify[n](ids[:, context : context + n]),
            {name: (lambda step=step: step(one)) for name, step in steps.items()})


def _time_forwards(model: torch.nn.Module, runs: list[_ContextRuns], repeats: int, clock: Callable[[], float],
                   warm: bool, show_progress: bool, compile_mode: str | None = None, deadline: float = math.inf
                   ) -> None:
    """Add `repeats` timed runs of every measurement, at every context length, to `runs`, from the shortest; past
    `deadline` (wall time) no further context is begun."""
    from tqdm.auto import tqdm

    device = model.device
    max_verify_tokens = len(runs[0].verify)
    longest = runs[-1].context_tokens + max_verify_tokens
    ids = torch.randint(0, model.config.vocab_size, (1, longest), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(longest, device=device).view(1, -1)
    drafts = _draft_kinds(model.config.num_hidden_layers)
    desc = "profiling contexts" if warm else "profiling contexts again (the timings did not settle)"
    for context_runs in tqdm(runs, desc=desc, disable=not show_progress):
        if context_runs is not runs[0] and time.perf_counter() > deadline:
            break
        context = context_runs.context_tokens
        if compile_mode:
            cache, forward, compiled_drafts = _compiled_forwards(model, ids, context, max_verify_tokens, compile_mode)
        else:
            # A cache sized as the decoder sizes it, per call: attention over a static cache reads every slot
            # (stale ones masked), so a cache sized for the longest context would price every context alike.
            cache = SpeculativeCache(model.config, context + max_verify_tokens, device)
            adapter.model_forward(model, ids[:, :context], None, None, cache, logits_to_keep=1)

            def forward(n_tokens: int) -> None:
                adapter.model_forward(model, ids[:, context : context + n_tokens],
                                      positions[:, context : context + n_tokens], None, cache,
                                      logits_to_keep=0 if n_tokens > 1 else 1)

        _time_context(model, context_runs, cache, forward, compiled_drafts if compile_mode else None, drafts,
                      repeats, clock, warm)


def _time_context(model: torch.nn.Module, context_runs: _ContextRuns, cache: SpeculativeCache,
                  forward: Callable[[int], None], compiled_drafts: dict[str, Callable[[], None]] | None,
                  drafts: dict[str, SkipSet], repeats: int, clock: Callable[[], float], warm: bool) -> None:
    """Time every measurement at one context: verifying 1..n tokens, then blocks of the one-token kinds."""
    device, context = model.device, context_runs.context_tokens

    def timed(run: Callable[[], None], count: int) -> list[float]:
        times = []
        for _ in range(count):
            cache.seek(context)  # roll back what the previous forward wrote
            synchronize(device)
            start = clock()
            run()
            synchronize(device)
            times.append(clock() - start)
        return times

    for n in range(1, len(context_runs.verify) + 1):
        timed(lambda: forward(n), 2 if warm else 1)  # warm-up
        context_runs.verify[n - 1] += timed(lambda: forward(n), repeats)
    # Eager drafts enter draft mode once per block, outside the timed forwards (compiled ones are steps of their
    # own); blocks of the three kinds alternate, so drift of the machine lands on each alike.
    blocks = 4 if repeats >= 8 else 1
    for block in range(blocks):
        for name, skip in drafts.items():
            one_token = compiled_drafts[name] if compiled_drafts else (lambda: forward(1))
            with contextlib.nullcontext() if compiled_drafts else draft_mode(model, skip):
                timed(one_token, 2 if warm and block == 0 else 1)  # warm-up
                context_runs.one_token[name] += timed(one_token, max(1, repeats // blocks))


def _switch_costs(model: torch.nn.Module, clock: Callable[[], float], runs: int = 200) -> Overheads:
    """Entering and leaving draft mode, timed directly (it costs no device time)."""
    num_layers = model.config.num_hidden_layers
    every = range(num_layers)

    def switch(skip: SkipSet) -> float:
        times = []
        for _ in range(runs):
            start = clock()
            with draft_mode(model, skip):
                pass
            times.append(clock() - start)
        return statistics.median(times)

    empty = switch(SkipSet())
    full = switch(SkipSet.of(every, every, num_layers))
    return Overheads(switch_s=empty, switch_sublayer_s=max(0.0, full - empty) / (2 * num_layers))


def _decode_seconds(stats: DecodeStats) -> float:
    return stats.wall_time_s - stats.prefill_time_s


_NEW_TOKENS, _DRAFT_TOKENS = 16, 4
NOISE_SLACK = 0.1  # a residual overhead less than this share of a forward below zero is noise, stored as 0 unreported


def _calibration(model: torch.nn.Module, profile: CostProfile) -> tuple[list[int], SkipSet, DraftPolicy]:
    """The prompt (at the shortest profiled context), skip set and policy that the overheads are measured with."""
    num_layers = model.config.num_hidden_layers
    limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    context = max(1, min(profile.context_lengths[0], limit - _NEW_TOKENS - _DRAFT_TOKENS - 1))
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    skip = SkipSet.of(range(1, num_layers - 1, 2), (), num_layers)  # any set will do: the switch is known
    # Fixed rounds, the guard off: the overheads are those of the rounds themselves.
    return prompt, skip, DraftPolicy(max_draft_tokens=_DRAFT_TOKENS, adaptive=False, guard=False)


def _decoding_runs(model: torch.nn.Module, profile: CostProfile, repeats: int,
                   compile_mode: str | None = None) -> list[tuple[DecodeStats, DecodeStats]]:
    """`repeats` pairs of real decoding runs: plain, and fixed drafting."""
    prompt, skip, fixed = _calibration(model, profile)

    def run(skip_set: SkipSet | None) -> DecodeStats:
        return generate(model, prompt, skip=skip_set, max_new_tokens=_NEW_TOKENS, policy=fixed,
                        compile=compile_mode is not None, compile_mode=compile_mode).stats

    run(None), run(skip)  # warm-up
    return [(run(None), run(skip)) for _ in range(repeats)]


def _overheads(profile: CostProfile, decodes: list[tuple[DecodeStats, DecodeStats]], model: torch.nn.Module
               ) -> tuple[Overheads, list[str]]:
    """What the real decoder pays besides the profiled forwards (residuals of `decodes` over them, at the shortest
    profiled context): plain decoding gives the per-round cost, fixed drafting the per-drafted-token cost. A residual
    below zero cannot be a cost: it is clipped to 0, and said (the second value) where beyond noise."""
    _, skip, _ = _calibration(model, profile)

    def forwards(stats: DecodeStats, skip_set: SkipSet) -> float:
        """The profiled forwards (and known switches) of the rounds in `stats`."""
        total = 0.0
        for (n_tokens, at), count in stats.verify_contexts.items():
            total += count * (profile.verify_time(n_tokens, at) + (n_tokens - 1) * profile.draft_s(skip_set, at)
                              + (profile.switch_time(skip_set) if n_tokens > 1 else 0.0))
        return total

    round_s, token_s = [], []
    for plain, drafted in decodes:
        round_s.append((_decode_seconds(plain) - forwards(plain, SkipSet())) / plain.rounds)
        if drafted.drafted:
            token_s.append((_decode_seconds(drafted) - forwards(drafted, skip) - drafted.rounds * round_s[-1])
                           / drafted.drafted)
    context = profile.context_lengths[0]
    scales = {"per round": profile.forward_at(context), "per drafted token": profile.draft_s(skip, context)}
    figures, clipped = [], []
    for (name, scale), values in zip(scales.items(), (round_s, token_s)):
        value = statistics.median(values) if values else 0.0
        if value < -NOISE_SLACK * scale:
            clipped.append(f"a negative decoding overhead {name} ({value * 1e3:.3f} ms), clipped to 0")
        figures.append(max(0.0, value))
    return replace(profile.overheads, round_s=figures[0], draft_token_s=figures[1]), clipped


def decode_stats(model: torch.nn.Module, prompts: Iterable[list[int]], skip: SkipSet, policy: DraftPolicy,
                 max_new_tokens: int, eos_token_id: int | list[int] | None) -> DecodeStats:
    """The rounds that decoding `prompts` with `skip` takes (greedy, so the same on any device; unguarded, since the
    guard's choices depend on this machine's timings)."""
    total, policy = DecodeStats(), replace(policy, guard=False)
    for prompt in prompts:
        total.add(generate(model, prompt, skip=skip, max_new_tokens=max_new_tokens, policy=policy,
                           eos_token_id=eos_token_id).stats)
    return total


def format_profile(profile: CostProfile) -> str:
    """A per-context table of the profile's costs, in milliseconds."""
    ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
    n = len(profile.contexts[0].verify_s)
    lines = [f"context  forward  attention  MLP  rest  verify {n} tokens   (ms; {profile.label()})"]
    for c in profile.contexts:
        lines.append(f"{c.context_tokens}  {ms(c.verify_s[0])}  {ms(c.attn_s)}  {ms(c.mlp_s)}  {ms(c.rest_s)}  "
                     f"{ms(c.verify_s[-1])}")
    o = profile.overheads
    lines.append(f"besides forwards: {ms(o.round_s)} per round; draft-mode switch {ms(o.switch_s)} + "
                 f"{ms(o.switch_sublayer_s)} per skipped sublayer; {ms(o.draft_token_s)} per drafted token, "
                 f"+{ms(o.adaptive_token_s)} when adaptive")
    widths = profile.contexts[0].envelope()
    padded = [n for n in range(1, len(widths) + 1) if widths[n - 1] < profile.contexts[0].verify_s[n - 1]]
    if padded:
        lines.append(f"at context {profile.context_lengths[0]}, verifying {', '.join(map(str, padded))} tokens is "
                     "padded to a cheaper width (priced by the envelope)")
    lines.extend(f"clipped: {note}" for note in profile.provenance.get("clipped", []))
    return "\n".join(lines)


def load_projections(paths: Sequence[str | Path], model: torch.nn.Module) -> list[tuple[str, CostProfile]]:
    """The profiles of `--project-with`, each labelled by its file and device, checked against `model`."""
    projections = []
    for path in paths:
        profile = CostProfile.load(path)
        try:
            profile.check_model(model)
        except ValueError as error:
            raise ValueError(f"--project-with {path}: {error}") from None
        projections.append((f"{path} [{profile.label()}]", profile))
    return projections


def projection_lines(projections: Sequence[tuple[str, CostProfile]],
                     measured: Sequence[tuple[str, SkipSet, DecodeStats]], adaptive: bool) -> list[str]:
    """Predicted speedups over plain decoding of each measured skip set on each projected device."""
    lines = []
    for label, profile in projections:
        lines.append(f"PREDICTION (cost model, not measured) on {label}:")
        for name, skip, stats in measured:
            lines.append(f"  {name}: predicted {profile.predict_speedup(skip, stats, adaptive=adaptive):.2f}x over "
                         f"plain decoding at this run's acceptance {stats.acceptance_rate:.2f}")
    return lines
