"""The benchmark per category, as Spec-Bench reports it: each category's prompts alone and all together, every
figure still paired run by run with HF greedy (Spec-Bench's baseline, plain autoregressive decoding) and with
skipsearch's own plain loop; a table, JSON entries and a chart with a bar per category and its interval."""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch

from ..decode.config import SkipConfig
from .bench import (BASELINE, BenchRow, Measured, bench_rows, fit_labels, fmt, label_bars, span, times,
                    unbounded, whiskers)

OVERALL = "overall"


@dataclass(frozen=True)
class CategoryRows:
    """A category's rows (or all prompts': `OVERALL`), over its `num_prompts` prompts."""

    category: str
    num_prompts: int
    rows: list[BenchRow]

    def to_json(self) -> dict:
        return {"category": self.category, "num_prompts": self.num_prompts, "rows": [asdict(r) for r in self.rows]}


def category_rows(model: torch.nn.Module, measured: Measured, categories: list[str | None], order: list[str],
                  config: SkipConfig | None = None) -> list[CategoryRows]:
    """Each category's rows, in `order`, from the runs of its prompts alone (no divergence gaps: the overall rows
    carry them)."""
    grouped = []
    for category in order:
        indices = [i for i, c in enumerate(categories) if c == category]
        if indices:
            rows = bench_rows(model, measured.subset(indices), config, divergences=False)
            grouped.append(CategoryRows(category, len(indices), rows))
    return grouped


def format_category_table(groups: list[CategoryRows]) -> str:
    """One line per category and method (HF greedy, the baseline, left out): tok/s, speedup over HF greedy with its
    interval, acceptance, mean accepted tokens, and skipsearch's rows over its own plain loop."""
    header = ["category", "prompts", "method", "tok/s", "vs HF greedy", "95% interval", "acceptance", "mean acc.",
              "vs our plain loop (decode)", "95% interval"]
    lines = [[g.category, str(g.num_prompts), r.method, fmt(r.tokens_per_second, ".1f"), times(r.speedup),
              span(r.speedup_low, r.speedup_high), fmt(r.acceptance_rate, ".2f"), fmt(r.mean_accepted_tokens, ".2f"),
              times(r.speedup_over_plain_loop), span(r.speedup_over_plain_low, r.speedup_over_plain_high)]
             for g in groups for r in g.rows if r.method != BASELINE]
    widths = [max(len(x) for x in column) for column in zip(header, *lines)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [header, *lines])


def category_figure(groups: list[CategoryRows], title: str) -> plt.Figure:
    """Speedup over HF greedy per category (a bar per category for each method, its 95% interval as whiskers), drawn
    and not yet written: `write_outputs` writes it with bench's other outputs."""
    methods = [r.method for r in groups[0].rows if r.method != BASELINE]
    labels = [f"{g.category} ({g.num_prompts})" for g in groups][::-1]
    height = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(groups) * len(methods) ** 0.5 + 2), constrained_layout=True)
    positions = np.arange(len(groups))
    numbers = []
    for k, method in enumerate(methods):
        rows = [next(r for r in g.rows if r.method == method) for g in groups][::-1]
        # The first method on top in each category, as the legend lists it.
        bars = ax.barh(positions + ((len(methods) - 1) / 2 - k) * height, [r.speedup for r in rows], height=height,
                       xerr=whiskers(rows), error_kw={"capsize": 2, "elinewidth": 1}, label=textwrap.fill(method, 40))
        numbers += label_bars(ax, bars, [r.speedup_high or r.speedup for r in rows],
                              [f"{r.speedup:.2f}x{unbounded(r)}" for r in rows])
    ax.set_xlim(0, max(r.speedup_high or r.speedup for g in groups for r in g.rows) * 1.1)  # then widened for labels
    ax.set_yticks(positions, labels)
    ax.axvline(1.0, color="gray", linestyle="--", linewidth=1, zorder=0, label="HF greedy (1.0x)")
    ax.set_xlabel("speedup over HF greedy (x; geometric mean of paired runs, whiskers: 95% interval)")
    ax.set_ylabel("category (prompts)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title, fontsize=9)
    fit_labels(ax, numbers)
    return fig
