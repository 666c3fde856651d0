"""Side-by-side decoding benchmark: HF greedy (the baseline), HF's training-free peers, and skipsearch.

One process, the same prompts for every method, a warm-up before timing. Each prompt is decoded
by every method back to back, in an order that rotates from prompt to prompt and repeat to repeat,
so machine drift lands on all of them alike; a method's speedup is the geometric mean of its
per-run ratios against HF greedy on the same prompt and repeat, with a 95% interval
(`measure.ratio_interval`). Every output is compared with HF greedy's, token for token.
"""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from matplotlib.container import BarContainer
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ..decode.config import SkipConfig
from ..decode.controller import DraftMemory
from ..decode.cost_profile import CostProfile
from ..decode.divergence import first_divergence, reference_logits
from ..decode.loop import cuts_rounds, generate
from ..decode.policy import DraftPolicy
from ..decode.skipset import SkipSet
from ..decode.stats import DecodeStats
from ..decode.steps import synchronize
from ..io.files import write_atomic, write_output
from ..search.measure import ratio_interval
from ..search.settings import MIN_STUDY_NEW_TOKENS
from .plots import render_png

Decoder = Callable[[list[int]], tuple[list[int], DecodeStats | None]]
BASELINE = "hf greedy"  # every speedup's baseline: plain autoregressive decoding, as Spec-Bench's
PLAIN_CONFIG = "skipsearch config (skips nothing)"  # the row of a config that decodes plainly by design


@dataclass
class BenchRow:
    method: str
    tokens_per_second: float
    speedup: float  # over HF greedy: geometric mean of paired per-run ratios
    identical: bool  # every output equals HF greedy's
    speedup_low: float | None = None  # its 95% interval
    speedup_high: float | None = None
    acceptance_rate: float | None = None
    mean_accepted_tokens: float | None = None
    speedup_over_plain_loop: float | None = None  # over skipsearch's own plain decoding, decode time only, paired
    speedup_over_plain_low: float | None = None  # its 95% interval
    speedup_over_plain_high: float | None = None
    predicted_speedup: float | None = None  # cost model, over skipsearch's own plain decoding
    projected_speedups: dict[str, float] | None = None  # the same, predicted with other devices' profiles
    identical_share: float | None = None  # prompts whose output equals HF greedy's
    divergence_gaps: list[float] | None = None  # top-2 logit gap at each differing output's first divergence
    guarded: bool | None = None  # a skip set's row: decoded with the run-time guard (as deployed) or without (as trials)


def hf_decoder(model: torch.nn.Module, max_new_tokens: int, eos: int | list[int] | None, **extra) -> Decoder:
    plain = plain_generation_config(model)

    def decode(prompt: list[int]) -> tuple[list[int], None]:
        ids = torch.tensor([prompt], device=model.device)
        own, model.generation_config = model.generation_config, plain
        try:  # An explicit mask: HF would otherwise infer one from pad tokens, which chat prompts may contain.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos,
                                 pad_token_id=eos if isinstance(eos, int) else None, **extra)
        finally:
            model.generation_config = own
        return out[0, len(prompt):].tolist(), None

    return decode


def plain_generation_config(model: torch.nn.Module) -> GenerationConfig:
    """The model's special tokens alone. generate fills every option it is not given from the model's own
    generation_config, where a model's author may set a repetition penalty, banned n-grams or suppressed tokens:
    the baseline is plain greedy decoding, as every other row decodes."""
    own = model.generation_config
    return GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=own.eos_token_id,
                            pad_token_id=own.pad_token_id)


def skipsearch_decoder(model: torch.nn.Module, max_new_tokens: int, eos: int | list[int] | None,
                       skip: SkipSet | Sequence[SkipSet] | None,
                       policy: DraftPolicy, time_drafts: bool = False, compile: bool = False,
                       compile_mode: str | None = None, compile_backend: str = "inductor") -> Decoder:
    # One memory across the decoder's calls, as a server keeps one per model: the guard's plain speed and back-off and
    # the set's acceptance carry from prompt to prompt instead of being learned again in every call.
    memory = DraftMemory()

    def decode(prompt: list[int]) -> tuple[list[int], DecodeStats]:
        out = generate(model, prompt, skip=skip, max_new_tokens=max_new_tokens, policy=policy, eos_token_id=eos,
                       time_drafts=time_drafts, compile=compile, compile_mode=compile_mode,
                       compile_backend=compile_backend, memory=memory)
        return out.tokens, out.stats

    return decode


@dataclass
class Runs:
    """One method's timed runs, in the same (repeat, prompt) order for every method."""

    seconds: list[float]
    tokens: list[int]
    prefill_seconds: list[float]  # 0 where the method does not report it
    outputs: list[list[int]]  # of the first repeat, one per prompt
    stats: DecodeStats  # of the first repeat, summed over prompts
    prompt_stats: list[DecodeStats | None] = field(default_factory=list)  # of the first repeat, one per prompt

    def subset(self, prompts: list[int], num_prompts: int) -> Runs:
        """These runs of the prompts at `prompts` alone (of `num_prompts`), in the same order: a category's."""
        picks = [r * num_prompts + i for r in range(len(self.seconds) // num_prompts) for i in prompts]
        stats = DecodeStats()
        for i in prompts:
            if self.prompt_stats[i] is not None:
                stats.add(self.prompt_stats[i])
        return Runs([self.seconds[k] for k in picks], [self.tokens[k] for k in picks],
                    [self.prefill_seconds[k] for k in picks], [self.outputs[i] for i in prompts], stats,
                    [self.prompt_stats[i] for i in prompts])

    def ratios_over(self, base: Runs, decode_only: bool = False) -> list[float]:
        """Per-run tokens/s over `base`'s tokens/s on the same prompt and repeat."""
        mine, theirs = self.seconds, base.seconds
        if decode_only:  # the prefill is the same work for both sides
            mine = [s - p for s, p in zip(self.seconds, self.prefill_seconds)]
            theirs = [s - p for s, p in zip(base.seconds, base.prefill_seconds)]
        return [(n / t) / (m / u) for n, t, m, u in zip(self.tokens, mine, base.tokens, theirs)]


def timed_runs(
    decoders: dict[str, Decoder], prompts: list[list[int]], repeats: int, device: torch.device,
    show_progress: bool = False,
) -> dict[str, Runs]:
    """Every decoder on every prompt, `repeats` times, back to back per prompt in a rotating order."""
    for decode in decoders.values():
        decode(prompts[0])  # warm-up
    names = list(decoders)
    runs = {name: Runs([], [], [], [], DecodeStats()) for name in names}
    for repeat in tqdm(range(repeats), desc="timed repeats", disable=not show_progress):
        for index, prompt in enumerate(prompts):
            shift = (repeat + index) % len(names)
            for name in names[shift:] + names[:shift]:
                synchronize(device)
                start = time.perf_counter()
                tokens, stats = decoders[name](prompt)
                synchronize(device)
                run = runs[name]
                run.seconds.append(time.perf_counter() - start)
                run.tokens.append(len(tokens))
                run.prefill_seconds.append(stats.prefill_time_s if stats is not None else 0.0)
                if repeat == 0:
                    run.outputs.append(tokens)
                    run.prompt_stats.append(stats)
                    if stats is not None:
                        run.stats.add(stats)
    # Each method's runs in (repeat, prompt) order, so that the i-th runs of two methods are a pair.
    return runs


@dataclass
class Measured:
    """Every method's timed runs of the same prompts, and whether each skip-set row ran with the guard."""

    prompts: list[list[int]]
    runs: dict[str, Runs]
    guarded: dict[str, bool | None]
    compiled: bool = False  # skipsearch's rows ran compiled steps

    def subset(self, prompts: list[int]) -> Measured:
        """The runs of the prompts at `prompts` alone (a category's), still paired run by run."""
        return Measured([self.prompts[i] for i in prompts],
                        {name: run.subset(prompts, len(self.prompts)) for name, run in self.runs.items()},
                        self.guarded, self.compiled)


def measure_methods(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, eos: int | list[int] | None,
    config: SkipConfig | None = None, early_exit_layer: int | None = None, prompt_lookup_tokens: int = 10,
    repeats: int = 3, show_progress: bool = True, compile: bool = False,
) -> Measured:
    """Every method's timed runs: HF greedy, its peers, skipsearch's plain loop and the config's rows."""
    methods: dict[str, Decoder] = {BASELINE: hf_decoder(model, max_new_tokens, eos)}
    if prompt_lookup_tokens:
        methods[f"hf prompt lookup ({prompt_lookup_tokens})"] = hf_decoder(
            model, max_new_tokens, eos, prompt_lookup_num_tokens=prompt_lookup_tokens)
    if early_exit_layer:
        methods[f"hf early exit (layer {early_exit_layer})"] = hf_decoder(
            model, max_new_tokens, eos, assistant_early_exit=early_exit_layer)
    methods["skipsearch plain"] = skipsearch_decoder(model, max_new_tokens, eos, None, DraftPolicy(), compile=compile)
    guarded = {}
    if config is not None:
        skip = config.skip_sets if config.others else config.skip  # several: the prefill chooses one per prompt
        for label, policy in config_decoders(config).items():
            methods[label] = skipsearch_decoder(model, max_new_tokens, eos, skip, policy, compile=compile)
            guarded[label] = policy.guard if config.skip.drafts or config.others else None
    return Measured(prompts, timed_runs(methods, prompts, repeats, model.device, show_progress), guarded, compile)


def bench_rows(model: torch.nn.Module, measured: Measured, config: SkipConfig | None = None,
               profile: CostProfile | None = None, project_with: Sequence[tuple[str, CostProfile]] = (),
               divergences: bool = True) -> list[BenchRow]:
    """A row per method, paired with HF greedy (and skipsearch's rows with its plain loop) run by run;
    `divergences`: also the top-2 logit gap where an output differs from HF greedy's (a forward per such output)."""
    runs, prompts = measured.runs, measured.prompts
    hf, plain = runs[BASELINE], runs["skipsearch plain"]
    predicts = config is not None and not config.others  # the cost model prices one skip set
    rows = []
    for name, run in runs.items():
        speedup = ratio_interval(run.ratios_over(hf))
        row = BenchRow(method=name, tokens_per_second=sum(run.tokens) / sum(run.seconds), speedup=speedup.estimate,
                       identical=run.outputs == hf.outputs, speedup_low=speedup.low,
                       speedup_high=_finite(speedup.high), guarded=measured.guarded.get(name))
        if name.startswith("skipsearch"):
            over_plain = ratio_interval(run.ratios_over(plain, decode_only=True))
            row.speedup_over_plain_loop = over_plain.estimate
            row.speedup_over_plain_low, row.speedup_over_plain_high = over_plain.low, _finite(over_plain.high)
            stats = run.stats
            row.identical_share = sum(o == r for o, r in zip(run.outputs, hf.outputs)) / len(hf.outputs)
            if divergences:
                row.divergence_gaps = [first_divergence(r, o, reference_logits(model, p, r)).top2_gap
                                       for p, r, o in zip(prompts, hf.outputs, run.outputs) if o != r]
            if stats.drafted:
                row.acceptance_rate = stats.acceptance_rate
                row.mean_accepted_tokens = stats.mean_accepted_tokens
            if profile is not None and predicts and name != "skipsearch plain":
                row.predicted_speedup = profile.predict_speedup(
                    config.skip, stats, adaptive=cuts_rounds(config.draft.adaptive, model.device),
                    max_draft_tokens=config.draft.max_draft_tokens, compiled=measured.compiled)
            # The guard chooses by this machine's timings: another device's projection prices the unguarded rounds
            # alone, with the confidence reads that device's adaptive rounds would pay.
            if project_with and predicts and row.guarded is False:
                adaptive, most = config.draft.adaptive, config.draft.max_draft_tokens
                row.projected_speedups = {
                    label: other.predict_speedup(config.skip, stats, adaptive=cuts_rounds(adaptive, other.device),
                                                 max_draft_tokens=most, compiled=other.compiled_steps)
                    for label, other in project_with}
        rows.append(row)
    return rows


def config_decoders(config: SkipConfig) -> dict[str, DraftPolicy]:
    """The config's rows, by label: its skip set as deployed (its own policy, the guard on unless the config turns it
    off) and, where the guard is on, also without it, which is what a study's trial measures: like with like."""
    if not config.skip.drafts and not config.others:
        return {PLAIN_CONFIG: config.draft}
    name = config.skip if not config.others else \
        f"{len(config.entries)} sets chosen per prompt ({', '.join(str(e.label) for e in config.entries)})"
    if not config.draft.guard:
        return {f"skipsearch {name} (unguarded)": config.draft}
    return {f"skipsearch {name} (guarded)": config.draft,
            f"skipsearch {name} (unguarded, as its study measured)": replace(config.draft, guard=False)}


def _finite(value: float) -> float | None:
    return value if value != float("inf") else None  # JSON has no infinity


def bench_verdict(rows: list[BenchRow], config: SkipConfig | None = None,
                  max_new_tokens: int | None = None) -> str | None:
    """What the run says about the config, against skipsearch's own plain decoding (paired, decode time),
    beside the figure its study confirmed; None without a config. `max_new_tokens`: the run's, which a config that
    drafted nothing may owe that to."""
    ours = [r for r in rows if r.method.startswith("skipsearch") and r.method != "skipsearch plain"]
    if not ours:
        return None
    row, unguarded = ours[0], next((r for r in ours if r.guarded is False), None)
    recorded = config.metrics.verdict if config is not None else None
    if row.acceptance_rate is None:
        text = _drafted_nothing(row, unguarded, config, max_new_tokens)
        return f"{text} (its study's verdict: {recorded})" if recorded else text
    figure = _figure(row)
    guard = {True: " with the run-time guard", False: " without the run-time guard", None: ""}[row.guarded]
    if row.speedup_over_plain_low > 1.0:
        text = f"in this run the config's skip set decodes{guard} {figure} as fast as plain decoding"
    else:
        text = f"in this run the config's skip set is not confirmed faster than plain decoding{guard}: {figure}"
    if row.guarded and unguarded is not None:
        text += f" (without it, as its study measures: {_figure(unguarded)})"
    plain = next((r for r in rows if r.method == "skipsearch plain"), None)
    if config is not None and config.others and plain is not None and row.speedup_low is not None:
        # Decode time leaves out the prefill, where choosing among several sets costs a draft forward per set.
        text += (f"; end to end, the prefill's choice among the sets included: {row.speedup:.2f}x HF greedy (95% "
                 f"interval {row.speedup_low:.2f}-{row.speedup_high or float('inf'):.2f}), our plain loop "
                 f"{plain.speedup:.2f}x")
    return f"{text}; its study recorded: {recorded}" if recorded else text


def _drafted_nothing(row: BenchRow, unguarded: BenchRow | None, config: SkipConfig | None,
                     max_new_tokens: int | None) -> str:
    """The verdict of a config whose row drafted nothing: plain decoding by design only where its sets skip nothing;
    a set that drafts can still draft nothing in a run, and the verdict says why where the run shows it."""
    if (row.method == PLAIN_CONFIG) if config is None else not config_drafts(config):
        return "the config skips nothing: it decodes plainly"
    subject = "the config's sets" if config is not None and config.others else "the config's skip set"
    if row.guarded and unguarded is not None and unguarded.acceptance_rate is not None:
        return (f"in this run {subject} drafted nothing with the run-time guard, which decoded every token plainly "
                f"(measuring plain speed, or judging drafting slower on this machine); without it, as its study "
                f"measures: {_figure(unguarded)}")
    if max_new_tokens is not None and max_new_tokens < MIN_STUDY_NEW_TOKENS:
        why = (f"--max-new-tokens {max_new_tokens} leaves no room for a draft (the prefill gives the first token, "
               "a round needs one for a draft and one for the full model's)")
    elif config is not None and config.draft.max_draft_tokens == 0:
        why = "its max_draft_tokens is 0"
    elif config is not None and config.others:
        why = "the prefill chose plain decoding for every prompt, or each prompt ended (at EOS) before a round drafted"
    else:
        why = "every prompt ended (at EOS) before a round could draft"
    return f"{subject} drafted nothing in this run: {why}"


def config_drafts(config: SkipConfig) -> bool:
    """Whether any of the config's sets drafts: one that skips nothing (and keeps the full head) decodes plainly."""
    return any(skip.drafts for skip in config.skip_sets)


def _figure(row: BenchRow) -> str:
    high = "unbounded" if row.speedup_over_plain_high is None else f"{row.speedup_over_plain_high:.2f}"
    return f"{row.speedup_over_plain_loop:.2f}x (95% interval {row.speedup_over_plain_low:.2f}-{high})"


def fmt(value: float | None, spec: str) -> str:
    """A table's cell: `value` in `spec`, or "-" where there is none."""
    return "-" if value is None else format(value, spec)


def times(value: float | None) -> str:
    """A table's ratio cell: "1.23x", or "-" where there is none."""
    return fmt(value, ".2f") + ("" if value is None else "x")


def span(low: float | None, high: float | None) -> str:
    """A table's interval cell: "low-high", "inf" for an unbounded high, "-" where there is none."""
    return "-" if low is None else f"{low:.2f}-{'inf' if high is None else format(high, '.2f')}"


def format_table(rows: list[BenchRow]) -> str:
    header = ["method", "tok/s", "vs HF greedy", "95% interval", "acceptance", "mean acc.", "identical",
              "vs our plain loop (decode)", "95% interval", "predicted vs plain"]
    lines = [[r.method, fmt(r.tokens_per_second, ".1f"), times(r.speedup), span(r.speedup_low, r.speedup_high),
              fmt(r.acceptance_rate, ".2f"),
              fmt(r.mean_accepted_tokens, ".2f"), "yes" if r.identical else "NO",
              times(r.speedup_over_plain_loop), span(r.speedup_over_plain_low, r.speedup_over_plain_high),
              times(r.predicted_speedup)] for r in rows]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *lines)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in [header, *lines])


def whiskers(rows: list[BenchRow]) -> list[list[float]] | None:
    """`rows`' 95% intervals as whiskers below and above each speedup, None unless every row has one. An unbounded
    interval (one paired run: low 0, no high) is NaN, which matplotlib draws no whisker for: one down to 0 and none
    up read as a measured interval reaching 0; `unbounded` says so in the bar's text instead."""
    if any(r.speedup_low is None for r in rows):
        return None
    return [[float("nan") if r.speedup_high is None else r.speedup - r.speedup_low for r in rows],
            [float("nan") if r.speedup_high is None else r.speedup_high - r.speedup for r in rows]]


def unbounded(row: BenchRow) -> str:
    """A bar's note that its interval bounds nothing (`ratio_interval` of one paired run), else ""."""
    return ", interval unbounded: 1 paired run" if row.speedup_low is not None and row.speedup_high is None else ""


def label_bars(ax: plt.Axes, bars: BarContainer, ends: list[float], labels: list[str]) -> list[plt.Annotation]:
    """Each bar's label right of `ends`, its whisker's end (at the bar's end it ran into the whisker and its cap), on
    white where the 1.0x line crosses it; `fit_labels` then widens the axis to hold them."""
    return [ax.annotate(label, (end, bar.get_y() + bar.get_height() / 2), xytext=(5, 0), textcoords="offset points",
                        va="center", fontsize=8, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
            for bar, end, label in zip(bars, ends, labels)]


def fit_labels(ax: plt.Axes, labels: list[plt.Annotation]) -> None:
    """Widen the x axis until every label ends inside it. A label's width is in pixels, whatever the axis' scale, so
    it is measured once the figure is laid out (twice: the wider axis may change the layout's tick labels)."""
    for _ in range(2):
        ax.figure.canvas.draw()
        width, (low, high) = ax.get_window_extent().width, ax.get_xlim()
        for label in labels:
            room = 1 - (label.get_window_extent().width + 10) / width  # the axis' share left to the data
            if room > 0.2:
                high = max(high, low + (label.xy[0] - low) / room)
        ax.set_xlim(low, high)


def write_outputs(rows: list[BenchRow], folder: Path, settings: dict, verdict: str | None = None,
                  categories: list[dict] | None = None,
                  figures: dict[str, plt.Figure] | None = None) -> tuple[Path, Path]:
    """bench.json (with `categories`, one entry per category), bench.png and `figures` (by file name; closed). Every
    chart is rendered before any file is written, and bench.json last: a chart that fails to draw leaves the earlier
    run's outputs whole, where a new bench.json beside its old charts would pass them for this run's."""
    json_path, png_path = folder / "bench.json", folder / "bench.png"
    try:
        charts = {png_path: render_png(bench_figure(rows, settings)),
                  **{folder / name: render_png(fig) for name, fig in (figures or {}).items()}}
    finally:
        for fig in (figures or {}).values():
            plt.close(fig)
    folder.mkdir(parents=True, exist_ok=True)
    for path, png in charts.items():
        write_output(path, lambda tmp, png=png: tmp.write_bytes(png))
    write_atomic(json_path, json.dumps({"settings": settings, "rows": [asdict(r) for r in rows], "verdict": verdict,
                                        **({"categories": categories} if categories else {})}, indent=2) + "\n")
    return json_path, png_path


def run_caption(settings: dict) -> str:
    """What a chart's title says of the run (bench.png's and bench_categories.png's alike): the model, the device,
    the prompts, tokens and repeats, and whether skipsearch's steps were compiled, which its timings depend on."""
    where, repeats = settings.get("device_name") or settings.get("device", ""), settings.get("repeats", "?")
    return (f"{settings.get('model', '')} on {where}, {settings.get('num_prompts', '?')} prompts x "
            f"{settings.get('max_new_tokens', '?')} new tokens x {repeats} repeat{'' if repeats == 1 else 's'}"
            f"{', skipsearch compiled' if settings.get('compile') else ''}")


def bench_figure(rows: list[BenchRow], settings: dict) -> plt.Figure:
    """bench.png's chart: each method's speedup over HF greedy, its interval as whiskers."""
    ordered = rows[::-1]
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 0.25 * sum(len(r.method) // 28 for r in rows) + 1.5),
                           constrained_layout=True)
    errors = whiskers(ordered)
    # Long method names (a skip set's sublayers) wrapped: unwrapped, they squeeze the bars into a strip.
    names = [textwrap.fill(r.method, 28) for r in ordered]
    bars = ax.barh(names, [r.speedup for r in ordered], color="tab:blue", xerr=errors,
                   error_kw={"capsize": 3, "elinewidth": 1})
    # The number on each bar, and the token/s it comes from: readers compare bars by their values.
    numbers = label_bars(ax, bars, [(r.speedup_high or r.speedup) if errors else r.speedup for r in ordered],
                        [f"{r.speedup:.2f}x ({r.tokens_per_second:.1f} tok/s)"
                         + ("" if r.identical else ", output differs") + unbounded(r) for r in ordered])
    ax.set_xlim(0, max(r.speedup_high or r.speedup for r in rows) * 1.1)  # then widened for the labels
    ax.axvline(1.0, color="gray", linestyle="--", linewidth=1, label="HF greedy (1.0x)", zorder=0)
    ax.set_xlabel("speedup over HF greedy (x; geometric mean of paired runs, bars: 95% interval)")
    ax.set_ylabel("decoding method")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)  # beside the bars, never over one
    ax.set_title(f"Decoding speed: {run_caption(settings)}", fontsize=9)
    fit_labels(ax, numbers)
    return fig
