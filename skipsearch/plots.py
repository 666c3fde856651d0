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

from .config import follow_umask
from .export import fastest_skip_trial
from .search import STUDY_ATTR, best_trial


def save_figure(fig: plt.Figure, path: Path) -> None:
    """Write `fig` as PNG atomically (a temp file renamed over `path`) and close it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        follow_umask(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
        plt.close(fig)


def _score(trial: optuna.trial.FrozenTrial) -> float:
    return trial.values[0] if len(trial.values) == 1 else trial.user_attrs["speedup"] * trial.user_attrs["acceptance_rate"]


def skip_map(study: optuna.Study, top_fraction: float = 0.2) -> plt.Figure:
    """Layers x {attn, mlp}: the best trial's skip set, and how often each sublayer is skipped among the top trials."""
    num_layers = study.user_attrs[STUDY_ATTR]["model"]["num_hidden_layers"]
    skipping = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.user_attrs.get("skipped", 0) > 0]
    shown = best_trial(study)
    label = "best trial"
    if shown is None or shown.user_attrs.get("skipped", 0) == 0:
        shown, label = fastest_skip_trial(study), "plain decoding is best; fastest skipping trial"
    best_map = np.zeros((2, num_layers))
    if shown is not None:
        best_map[0, shown.user_attrs["skip_attn"]] = 1
        best_map[1, shown.user_attrs["skip_mlp"]] = 1
    top = sorted(skipping, key=_score, reverse=True)[: max(5, round(top_fraction * len(skipping)))]
    frequency = np.zeros((2, num_layers))
    for trial in top:
        frequency[0, trial.user_attrs["skip_attn"]] += 1 / len(top)
        frequency[1, trial.user_attrs["skip_mlp"]] += 1 / len(top)
    fig, axes = plt.subplots(2, 1, figsize=(max(6, num_layers * 0.3), 3.6), constrained_layout=True)
    for ax, data, title in (
        (axes[0], best_map, f"{label} ({shown.number if shown else 'none'}): skipped sublayers"),
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
    completed = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "speedup" in t.user_attrs]
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    fractions = [t.user_attrs["skipped_fraction"] for t in completed]
    speedups = [t.user_attrs["speedup"] for t in completed]
    acceptance = [t.user_attrs["acceptance_rate"] for t in completed]
    points = ax.scatter(fractions, speedups, c=acceptance, cmap="viridis", vmin=0, vmax=1)
    fig.colorbar(points, ax=ax, label="acceptance rate")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="plain decoding")
    ax.set_xlabel("skipped fraction of sublayers")
    ax.set_ylabel("measured speedup")
    ax.set_title(f"{study.study_name}: speedup vs skipped fraction")
    ax.legend(loc="best")
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
