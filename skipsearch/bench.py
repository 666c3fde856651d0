"""Side-by-side decoding benchmark: HF greedy (the baseline), HF's training-free peers, and skipsearch.

One process, the same prompts for every method, a warm-up before timing, `repeats` timed
passes over all prompts and the median pass reported. Every output is compared with HF
greedy's, token for token.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm

from .config import SkipConfig, write_atomic
from .costs import CostProfile
from .decoding import DecodeStats, DraftPolicy, first_divergence, generate, reference_logits, synchronize
from .plots import save_figure
from .skipping import SkipSet

Decoder = Callable[[list[int]], tuple[list[int], DecodeStats | None]]


@dataclass
class BenchRow:
    method: str
    tokens_per_second: float
    speedup: float  # over HF greedy
    identical: bool  # every output equals HF greedy's
    acceptance_rate: float | None = None
    mean_accepted_tokens: float | None = None
    speedup_over_plain_loop: float | None = None  # over skipsearch's own plain decoding, decode time only
    predicted_speedup: float | None = None  # cost model, over skipsearch's own plain decoding
    identical_share: float | None = None  # prompts whose output equals HF greedy's
    divergence_gaps: list[float] | None = None  # top-2 logit gap at each differing output's first divergence


def hf_decoder(model: torch.nn.Module, max_new_tokens: int, eos: int | list[int] | None, **extra) -> Decoder:
    def decode(prompt: list[int]) -> tuple[list[int], None]:
        ids = torch.tensor([prompt], device=model.device)
        # An explicit mask: HF would otherwise infer one from pad tokens, which chat prompts may contain.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=eos if isinstance(eos, int) else None, **extra)
        return out[0, len(prompt):].tolist(), None

    return decode


def skipsearch_decoder(model: torch.nn.Module, max_new_tokens: int, eos: int | list[int] | None, skip: SkipSet | None,
                       policy: DraftPolicy, time_drafts: bool = False, compile: bool = False) -> Decoder:
    def decode(prompt: list[int]) -> tuple[list[int], DecodeStats]:
        out = generate(model, prompt, skip=skip, max_new_tokens=max_new_tokens, policy=policy, eos_token_id=eos,
                       time_drafts=time_drafts, compile=compile)
        return out.tokens, out.stats

    return decode


def timed_passes(
    decoders: dict[str, Decoder], prompts: list[list[int]], repeats: int, device: torch.device, show_progress: bool = False,
) -> dict[str, tuple[float, list[list[int]], DecodeStats]]:
    """Per decoder: (median seconds of a pass over all prompts, outputs, decode stats of one pass).

    Passes are interleaved, one of each decoder per repeat, so that drift of the machine
    (clock, heat, neighbours) lands on every method alike instead of on whichever ran last.
    """
    for decode in decoders.values():
        decode(prompts[0])  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in decoders}
    first: dict[str, tuple[list[list[int]], DecodeStats]] = {}
    for _ in tqdm(range(repeats), desc="timed passes", disable=not show_progress):
        for name, decode in decoders.items():
            outputs, stats = [], DecodeStats()
            synchronize(device)
            start = time.perf_counter()
            for prompt in prompts:
                tokens, one = decode(prompt)
                outputs.append(tokens)
                if one is not None:
                    stats.add(one)
            synchronize(device)
            seconds[name].append(time.perf_counter() - start)
            first.setdefault(name, (outputs, stats))
    return {name: (statistics.median(seconds[name]), *first[name]) for name in decoders}


def run_bench(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, eos: int | list[int] | None,
    config: SkipConfig | None = None, early_exit_layer: int | None = None, prompt_lookup_tokens: int = 10,
    repeats: int = 3, profile: CostProfile | None = None, show_progress: bool = True, compile: bool = False,
) -> list[BenchRow]:
    methods: dict[str, Decoder] = {"hf greedy": hf_decoder(model, max_new_tokens, eos)}
    if prompt_lookup_tokens:
        methods[f"hf prompt lookup ({prompt_lookup_tokens})"] = hf_decoder(
            model, max_new_tokens, eos, prompt_lookup_num_tokens=prompt_lookup_tokens)
    if early_exit_layer:
        methods[f"hf early exit (layer {early_exit_layer})"] = hf_decoder(
            model, max_new_tokens, eos, assistant_early_exit=early_exit_layer)
    methods["skipsearch plain"] = skipsearch_decoder(model, max_new_tokens, eos, None, DraftPolicy(), compile=compile)
    if config is not None:
        label = f"skipsearch {config.skip}" if config.skip.size else "skipsearch config (skips nothing)"
        methods[label] = skipsearch_decoder(model, max_new_tokens, eos, config.skip, config.draft, compile=compile)

    results = timed_passes(methods, prompts, repeats, model.device, show_progress)
    total_tokens = {name: sum(map(len, outputs)) for name, (_, outputs, _) in results.items()}
    baseline_tps = total_tokens["hf greedy"] / results["hf greedy"][0]
    reference = results["hf greedy"][1]
    plain_seconds, _, plain_stats = results["skipsearch plain"]
    rows = []
    for name, (seconds, outputs, stats) in results.items():
        row = BenchRow(method=name, tokens_per_second=total_tokens[name] / seconds,
                       speedup=total_tokens[name] / seconds / baseline_tps, identical=outputs == reference)
        if name.startswith("skipsearch"):
            row.identical_share = sum(o == r for o, r in zip(outputs, reference)) / len(reference)
            row.divergence_gaps = [first_divergence(r, o, reference_logits(model, p, r)).top2_gap
                                   for p, r, o in zip(prompts, reference, outputs) if o != r]
            # Decode time only, like the cost model's prediction: prefill is the same work in both.
            row.speedup_over_plain_loop = _decode_seconds(plain_seconds, plain_stats) / _decode_seconds(seconds, stats)
            if stats.drafted:
                row.acceptance_rate = stats.acceptance_rate
                row.mean_accepted_tokens = stats.mean_accepted_tokens
            if profile is not None and config is not None and name != "skipsearch plain":
                row.predicted_speedup = profile.predict_speedup(config.skip, stats)
        rows.append(row)
    return rows


def _decode_seconds(pass_seconds: float, stats: DecodeStats) -> float:
    return pass_seconds - stats.prefill_time_s


def bench_verdict(rows: list[BenchRow]) -> str | None:
    """A sentence when the skip config does not beat plain decoding; None when it does (or there is none)."""
    ours = [r for r in rows if r.method.startswith("skipsearch") and r.method != "skipsearch plain"]
    if not ours:
        return None
    row = ours[0]
    if row.acceptance_rate is None:
        return "the config skips nothing: it decodes plainly (no skip set paid off when it was searched)"
    if row.speedup <= 1.0:
        return f"no skip set beats plain decoding on this model and device: best {row.speedup:.2f}x"
    return None


def format_table(rows: list[BenchRow]) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = ["method", "tok/s", "speedup", "acceptance", "mean acc.", "identical", "decode vs plain", "predicted"]
    lines = [[r.method, fmt(r.tokens_per_second, ".1f"), fmt(r.speedup, ".2f") + "x", fmt(r.acceptance_rate, ".2f"),
              fmt(r.mean_accepted_tokens, ".2f"), "yes" if r.identical else "NO",
              fmt(r.speedup_over_plain_loop, ".2f"), fmt(r.predicted_speedup, ".2f")] for r in rows]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *lines)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in [header, *lines])


def write_outputs(rows: list[BenchRow], folder: Path, settings: dict) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    json_path, png_path = folder / "bench.json", folder / "bench.png"
    write_atomic(json_path, json.dumps({"settings": settings, "rows": [asdict(r) for r in rows],
                                        "verdict": bench_verdict(rows)}, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(rows) + 1.5), constrained_layout=True)
    ax.barh([r.method for r in rows][::-1], [r.speedup for r in rows][::-1], color="tab:blue")
    ax.axvline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("speedup over HF greedy (median of timed passes)")
    ax.set_title(f"{settings.get('model', '')} on {settings.get('device', '')}", fontsize=9)
    save_figure(fig, png_path)
    return json_path, png_path
