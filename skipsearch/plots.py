"""Study plots as PNG files: Optuna's matplotlib visualizations plus a skip map and speedup vs skipped fraction."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import optuna
from optuna.trial import TrialState

from .export import decide, speedup_key
from .search import CONFIRM_ATTR, STUDY_ATTR, distinct_trials


def save_figure(fig: plt.Figure, path: Path) -> None:
    """Write `fig` as PNG atomically (a temp file renamed over `path`) and close it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
        plt.close(fig)


def _score(trial: optuna.trial.FrozenTrial) -> float:
    if len(trial.values) == 1:
        return trial.values[0]
    acceptance = trial.user_attrs.get("acceptance_rate")
    return (trial.user_attrs.get("speedup") or 0.0) * (1.0 if acceptance is None else acceptance)


def _highlight(study: optuna.Study) -> tuple[dict | None, str]:
    """The skip set every surface shows: the exported one, else the best confirmed one, with its figure."""
    decision = decide(study)
    key = speedup_key(study)
    shown = decision.chosen or decision.best
    if shown is None:
        return None, "plain decoding exported: no skip set was confirmed"
    figure = f"{shown[key]:.2f}x ({shown[key + '_low']:.2f}-{shown[key + '_high']:.2f})"
    if decision.pays:
        return shown, f"exported: trial {shown['trial']}, {figure} as fast as plain decoding"
    return shown, f"plain decoding exported; best confirmed skip set (not exported): trial {shown['trial']}, {figure}"


def skip_map(study: optuna.Study, top_fraction: float = 0.2) -> plt.Figure:
    """Layers x {attn, mlp}: the exported (or best confirmed) skip set, and how often each sublayer is skipped
    among the top trials."""
    num_layers = study.user_attrs[STUDY_ATTR]["model"]["num_hidden_layers"]
    skipping = [t for t in distinct_trials(study) if t.state == TrialState.COMPLETE and t.user_attrs.get("skipped", 0)]
    shown, label = _highlight(study)
    best_map = np.zeros((2, num_layers))
    if shown is not None:
        best_map[0, shown["skip_attn"]] = 1
        best_map[1, shown["skip_mlp"]] = 1
    top = sorted(skipping, key=_score, reverse=True)[: max(5, round(top_fraction * len(skipping)))]
    frequency = np.zeros((2, num_layers))
    for trial in top:
        frequency[0, trial.user_attrs["skip_attn"]] += 1 / len(top)
        frequency[1, trial.user_attrs["skip_mlp"]] += 1 / len(top)
    fig, axes = plt.subplots(2, 1, figsize=(max(6, num_layers * 0.3), 3.6), constrained_layout=True)
    for ax, data, title in (
        (axes[0], best_map, f"{label}: skipped sublayers"),
        (axes[1], frequency, f"share of the top {len(top)} skipping trials that skip each sublayer"),
    ):
        image = ax.imshow(data, aspect="auto", cmap="Reds", vmin=0, vmax=1)
        ax.set_yticks([0, 1], ["attn", "mlp"])
        ax.set_xticks(range(num_layers))
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(False)  # Optuna's ggplot style would draw lines through the cells
        fig.colorbar(image, ax=ax, fraction=0.02)
    axes[1].set_xlabel("layer")
    return fig


def speedup_vs_skipped(study: optuna.Study) -> plt.Figure:
    """Every decoded skip set's speedup from its trial, and the confirmed candidates with their intervals."""
    key = speedup_key(study)
    decoded = [t for t in distinct_trials(study) if t.user_attrs.get(key) is not None]
    fig, ax = plt.subplots(figsize=(6.5, 4.2), constrained_layout=True)
    acceptance = [t.user_attrs.get("acceptance_rate") for t in decoded]
    points = ax.scatter([t.user_attrs["skipped_fraction"] for t in decoded], [t.user_attrs[key] for t in decoded],
                        c=[1.0 if a is None else a for a in acceptance], cmap="viridis", vmin=0, vmax=1, s=22,
                        label="trial (search estimate)")
    fig.colorbar(points, ax=ax, label="acceptance rate (plain decoding: 1)")
    record = study.user_attrs.get(CONFIRM_ATTR) or {"candidates": []}
    confirmed = [c for c in record["candidates"] if c.get(key) is not None]
    if confirmed:
        x = [c["skipped_fraction"] for c in confirmed]
        y = [c[key] for c in confirmed]
        errors = [[c[key] - c[key + "_low"] for c in confirmed], [c[key + "_high"] - c[key] for c in confirmed]]
        ax.errorbar(x, y, yerr=errors, fmt="o", mfc="none", color="black", capsize=3,
                    label="confirmed (95% interval)")
    shown, label = _highlight(study)
    if shown is not None:
        ax.plot([shown["skipped_fraction"]], [shown[key]], marker="*", markersize=14, color="tab:red",
                linestyle="none", label=label.split(":")[0])
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="plain decoding")
    ax.set_xlabel("skipped share of sublayers")
    ax.set_ylabel(("predicted" if key == "predicted_speedup" else "measured") + " speedup over plain decoding (x)")
    ax.set_title(f"{study.study_name}: speedup vs skipped share\n{label}", fontsize=9)
    ax.legend(loc="best", fontsize=8)
    return fig


def write_plots(study: optuna.Study, folder: Path) -> list[Path]:
    """Write every plot that the study's trials allow; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    multi = len(study.directions) > 1
    target = (lambda t: t.values[0]) if multi else None
    target_name = "speedup" if multi else "score"
    vis = optuna.visualization.matplotlib
    figures = {
        "history": lambda: vis.plot_optimization_history(study, target=target, target_name=target_name).figure,
        "importances": lambda: vis.plot_param_importances(
            study, target=target, target_name=target_name,
            evaluator=optuna.importance.PedAnovaImportanceEvaluator(),
        ).figure,
        "skip_map": lambda: skip_map(study),
        "speedup_vs_skipped": lambda: speedup_vs_skipped(study),
    }
    if multi:
        figures["pareto"] = lambda: vis.plot_pareto_front(study, target_names=["speedup", "acceptance rate"]).figure
    written = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
        for name, make in figures.items():
            path = folder / f"{name}.png"
            save_figure(make(), path)
            written.append(path)
    return written
