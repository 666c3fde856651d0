"""The profiler: time what drafting and verifying cost on this device, and fill a `CostProfile` (its data type,
decode/cost_profile.py).

Costs are measured, not assumed, at several context lengths, since attention reads the whole
KV cache. At each length, one-token forwards with all attention skipped and with all MLPs
skipped, subtracted from the full forward, give the marginal time of one attention and one
MLP sublayer; the rest of the full forward (embeddings, final norm, lm_head, dispatch) is what
remains. A draft's cost is thus the full forward less what it skips, exact for the empty set
and closest for the sparse sets that matter. Verifying n tokens is timed directly for each n.
Draft mode is entered once around the timed forwards, so the mode switch does not bias the
marginal costs; what a round pays besides forwards (the switch, the host sync of the verified
tokens, adaptive drafting's softmax and sync) is measured on its own, in the real decoder (calibration.py).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..decode import adapter
from ..decode.attention import attention_way
from ..decode.cost_profile import ContextCosts, CostProfile, model_shape
from ..decode.economics import sublayer_weights
from ..decode.engine import CACHE_BLOCK, CompileSettings, engine_for
from ..decode.kvcache import SpeculativeCache, cache_bytes
from ..decode.skipping import draft_mode
from ..decode.skipset import DraftHead, SkipSet
from ..decode.steps import forward_at_position, synchronize
from .calibration import calibrated

CPU_CONTEXTS = (128, 1024)
CUDA_CONTEXTS = (128, 512, 2048, 8192, 32768)


def study_compile_mode(device: torch.device) -> str | None:
    """What a profile times by default: on CUDA the regional steps as CUDA graphs, which studies and `--compile`
    run there (eager forwards on a GPU time the host's Python, not the GPU); on a CPU the eager forwards."""
    return "regional" if device.type == "cuda" else None


def default_contexts(model: torch.nn.Module, max_verify_tokens: int = 9) -> list[int]:
    """Context lengths to profile: modest on a CPU; on CUDA up to what the KV cache leaves of a quarter of free memory."""
    limit = (getattr(model.config, "max_position_embeddings", None) or 1 << 30) - max_verify_tokens - 1
    candidates = CPU_CONTEXTS
    if model.device.type == "cuda":
        # A token's keys and values, and the prefill's activations (an MLP's intermediate output is the largest).
        per_token = (cache_bytes(model.config, 1, model.dtype)
                     + 4 * model.config.intermediate_size * model.dtype.itemsize)
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


def _provenance(model: torch.nn.Module, compile_mode: str | None = None) -> dict:
    import transformers

    return {"created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device_name": device_name(model.device), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "attention": attention_way(model), "projections": projections_way(model, compile_mode)}


def projections_way(model: torch.nn.Module, compile_mode: str | None) -> str:
    """How the timed steps ran a layer's linears of one input, in words for a cost profile's provenance, read from
    the engine after they ran: fused (one GEMM a group, decode/fused.py) in inductor's regional steps, unless the
    engine's `fuse_projections` was off or nothing fused; else a GEMM a linear, or inductor's own concatenation."""
    if compile_mode == "frozen":
        return "not fused by the engine (frozen steps: inductor's freezing concatenates them where its pass applies)"
    compiled = engine_for(model).layers.get("inductor") if compile_mode == "regional" else None
    if compiled is not None and compiled.fused is not None and compiled.fused.groups:
        return (f"fused: {len(compiled.fused.groups)} groups of linears of one input (query, key, value; gate, up), "
                "one GEMM each (decode/fused.py)")
    why = (f"{compile_mode or 'eager'} steps" if compile_mode != "regional" else
           "the engine's fuse_projections off" if compiled is None or compiled.fused is None else "none fusible")
    return f"unfused: a GEMM a linear ({why})"


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
        one_row = self.one_token.get("one_row_head")  # absent where runs were made without it: the head unpriced
        head_s = min(rest_s, max(0.0, forward - statistics.median(one_row))) if one_row else 0.0
        # Widths as measured, out of order where the hardware's kernels step so (the envelope prices them).
        verify = [forward] + [statistics.median(runs) for runs in self.verify[1:]]
        return ContextCosts(context_tokens=self.context_tokens, attn_s=attn_s, mlp_s=mlp_s, rest_s=rest_s,
                            verify_s=verify, head_s=head_s)

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
        """Parts the medians put at or below zero, which `costs` clips to 0, and a head above the rest, which it caps
        there: facts of the device, reported."""
        forward = statistics.median(self.verify[0] + self.one_token["full"])
        attn = (forward - statistics.median(self.one_token["no_attn"])) / num_layers
        mlp = (forward - statistics.median(self.one_token["no_mlp"])) / num_layers
        rest = forward - num_layers * (max(0, attn) + max(0, mlp))
        parts = [("attention", attn), ("MLP", mlp), ("rest", rest)]
        one_row = self.one_token.get("one_row_head")
        head = forward - statistics.median(one_row) if one_row else None
        if head is not None:  # the full LM head's share of the rest: the full forward less one with a head of one row
            parts.append(("language-model head", head))
        found = [f"at context {self.context_tokens}, a {part} cost of {value * 1e3:.3f} ms, clipped to 0"
                 for part, value in parts if value <= 0]
        if head is not None and head > max(0.0, rest):  # the head is part of the rest, so `costs` caps it there
            found.append(f"at context {self.context_tokens}, a language-model head cost of {head * 1e3:.3f} ms, "
                         f"capped at the rest's {max(0.0, rest) * 1e3:.3f} ms")
        return found


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
    again and pooled with the runs before (`_measure`), up to `attempts` rounds or `budget_s` seconds of wall time
    after the first round, which measures every context whatever the budget (default: `GPU_BUDGET_S` on CUDA,
    unbounded on a CPU); then `NoisyMachine` says what did not settle. Fewer than 5 `repeats` give no interval to
    judge: the provenance says the noise was not checked ("noise"). Costs out of order by width are priced as
    measured, and parts or overheads below zero are clipped to 0 and listed in the provenance ("clipped"). `clock`
    (default `time.perf_counter`) times the forwards.
    """
    clock = clock or time.perf_counter
    contexts = sorted(set(contexts or default_contexts(model, max_verify_tokens)))
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and contexts[-1] + max_verify_tokens > limit:
        raise ValueError(f"context {contexts[-1]} + {max_verify_tokens} verified tokens exceeds the model's "
                         f"{limit} positions")
    kinds = _draft_kinds(model.config.num_hidden_layers)
    runs = [_ContextRuns(c, [[] for _ in range(max_verify_tokens)], {name: [] for name in kinds}) for c in contexts]
    budget_s = budget_s if budget_s is not None else GPU_BUDGET_S if model.device.type == "cuda" else math.inf
    _measure(model, runs, repeats, clock, attempts, budget_s, show_progress, compile_mode)
    profile = _profile(model, [r.costs(model.config.num_hidden_layers) for r in runs], compile_mode)
    clipped = [c for r in runs for c in r.clipped(model.config.num_hidden_layers)]
    if calibrate:
        overheads, more = calibrated(model, profile, repeats, compile_mode, clock, show_progress)
        profile, clipped = replace(profile, overheads=overheads), clipped + more
    notes = {"clipped": clipped} if clipped else {}
    if repeats < _MIN_RUNS_FOR_INTERVAL:
        notes["noise"] = (f"not checked ({repeats} repeat{'s' if repeats != 1 else ''}: telling noise takes "
                          f"{_MIN_RUNS_FOR_INTERVAL} or more)")
    return replace(profile, provenance={**profile.provenance, **notes}) if notes else profile


# A profile's measuring again on a GPU begins no context after this, counted from the end of its first round (which
# measures every context): a shape's profile ends within minutes.
GPU_BUDGET_S = 60.0


def _measure(model: torch.nn.Module, runs: list[_ContextRuns], repeats: int, clock: Callable[[], float],
             attempts: int, budget_s: float, show_progress: bool, compile_mode: str | None) -> None:
    """Time every measurement at every context into `runs`, then, while repeats disagree, all of them again, up to
    `attempts` rounds; past `budget_s` after the first round no context is begun again (those left keep the runs they
    have). A `NoisyMachine` where repeats still disagree."""
    deadline, problems = math.inf, []
    for attempt in range(attempts):
        with engine_for(model).exclusive():  # its compiled steps write the engine's cache; eager, it swaps layers
            _time_forwards(model, runs, repeats, clock, warm=attempt == 0, show_progress=show_progress,
                           compile_mode=compile_mode, deadline=deadline)
        if attempt == 0:
            deadline = time.perf_counter() + budget_s  # the budget is for measuring again
        problems = [p for r in runs for p in r.problems()]
        if not problems or time.perf_counter() > deadline:
            break
    if problems:
        raise NoisyMachine(
            f"this machine is too noisy to profile: after {attempt + 1} rounds of {repeats} timed runs, repeats "
            f"disagree: {problems[0]}{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; profile again "
            "when it is idle (other programs closed), or profile a quiet machine of this kind and give its file with "
            "--cost-profile")


def _profile(model: torch.nn.Module, contexts: list[ContextCosts], compile_mode: str | None = None) -> CostProfile:
    weights = sublayer_weights(model)
    return CostProfile(device=str(model.device), dtype=str(model.dtype).removeprefix("torch."),
                       architecture=type(model).__name__, num_hidden_layers=model.config.num_hidden_layers,
                       contexts=tuple(contexts), provenance=_provenance(model, compile_mode),
                       attn_shares=_shares(weights.attn), mlp_shares=_shares(weights.mlp),
                       vocab_size=adapter.output_head(model)[1].shape[0], hidden_size=model_shape(model)[3])


def _shares(weights: Sequence[int]) -> tuple[float, ...]:
    """Each layer's weights relative to their mean."""
    mean = sum(weights) / len(weights)
    return tuple(w / mean for w in weights)


def _draft_kinds(num_layers: int) -> dict[str, SkipSet]:
    """The one-token forwards whose differences price the parts: every attention skipped, every MLP, and a head of
    one row (what the rest of a forward owes to the LM head, which a trimmed head reads in part)."""
    every = range(num_layers)
    kinds = {"full": SkipSet(), "no_attn": SkipSet.of(every, (), num_layers), "no_mlp": SkipSet.of((), every, num_layers),
             "one_row_head": SkipSet(head=DraftHead((0,)))}
    return kinds


def _compiled_forwards(model: torch.nn.Module, ids: torch.Tensor, context: int, max_verify_tokens: int, mode: str
                       ) -> tuple[SpeculativeCache, Callable[[int], None], dict[str, Callable[[], None]]]:
    """The engine's own compiled steps at one context, after an eager prefill: the cache, `verify(n_tokens)`, and
    one-token forwards of each draft kind (the full one is the plain step). Each step advances the position."""
    engine, settings = engine_for(model), CompileSettings(mode=mode)
    length = context + max_verify_tokens
    if engine.cache is not None and engine.cache.capacity - length >= CACHE_BLOCK:
        # A step costs what its cache's slots cost: a context measured again (the noise's retries) after a longer one
        # is timed on a cache of its own length, as the first time.
        engine.release_cache()
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
    `deadline` (wall time) no further context is begun (the first always is)."""
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
            verifier = engine_for(model).eager_verifier()  # what eager verification runs (its head packed on a CPU)

            def forward(n_tokens: int) -> None:
                with engine_for(model).attention():  # as the eager steps attend (decode/attention.py)
                    adapter.model_forward(verifier if n_tokens > 1 else model, ids[:, context : context + n_tokens],
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


def format_profile(profile: CostProfile) -> str:
    """A per-context table of the profile's costs, in milliseconds."""
    ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
    n = len(profile.contexts[0].verify_s)
    header = ["context", "forward", "attention, a layer", "MLP, a layer", "rest", f"verify {n} tokens"]
    rows = [[str(c.context_tokens), ms(c.verify_s[0]), ms(c.attn_s), ms(c.mlp_s), ms(c.rest_s), ms(c.verify_s[-1])]
            for c in profile.contexts]
    column_widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [f"milliseconds, one token unless said ({profile.label()}):"]
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(row, column_widths)) for row in [header, *rows]]
    o = profile.overheads
    switch = (f"draft-mode switch {ms(o.switch_s)} + {ms(o.switch_sublayer_s)} per skipped sublayer (an older "
              "profile's); " if o.switch_s or o.switch_sublayer_s else "")
    lines.append(f"besides forwards: {ms(o.round_s)} per round; {switch}{ms(o.draft_token_s)} per drafted token, "
                 f"+{ms(o.adaptive_token_s)} when adaptive")
    widths = profile.contexts[0].envelope()
    # A lone token is a plain step, never padded.
    padded = [n for n in range(2, len(widths) + 1) if widths[n - 1] < profile.contexts[0].verify_s[n - 1]]
    if padded:
        lines.append(f"at context {profile.context_lengths[0]}, verifying {', '.join(map(str, padded))} tokens is "
                     "padded to a cheaper width (priced by the envelope)")
    lines.extend(f"clipped: {note}" for note in profile.provenance.get("clipped", []))
    if "noise" in profile.provenance:
        lines.append(f"noise: {profile.provenance['noise']}")
    return "\n".join(lines)


