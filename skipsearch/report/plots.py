"""Study plots as PNG files: Optuna's matplotlib visualizations plus a skip map and speedup vs skipped fraction."""

from __future__ import annotations

import collections
import io
import math
import textwrap
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import optuna
from matplotlib.collections import PathCollection
from matplotlib.ticker import MaxNLocator
from optuna.trial import TrialState

from ..io.files import write_output
from ..search.ranking import quoted_speedup, ranked
from ..search.records import (ConfirmedCandidate, Ratio, StudyLabel, TrialRecord, decoded_trials, read_confirmation,
                              study_label)
from ..search.space import HEAD_PARAM
from .export import dataset_choices, decide


def save_figure(fig: plt.Figure, path: Path) -> None:
    """Write `fig` as PNG (atomically, or through to a stream: files.py's `write_output`) and close it."""
    png = render_png(fig)
    write_output(path, lambda tmp: tmp.write_bytes(png))


def render_png(fig: plt.Figure) -> bytes:
    """`fig` as PNG bytes, closed: rendered in memory, so that a command writing several files can render every
    figure before it writes any, and a figure that fails leaves the earlier outputs whole."""
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return buffer.getvalue()


def _highlight(study: optuna.Study, scored: bool = False) -> tuple[ConfirmedCandidate | None, str]:
    """The skip set every surface shows: the exported one (of several, one per dataset: the first, with its figure
    on that dataset's prompts), else the best confirmed one, with its figure. `scored`: for a plot that draws it at
    its score, where that score is speedup x acceptance, the figure is the score and the two it comes from."""
    choices = dataset_choices(study)
    decision = choices[0][1] if choices else decide(study)
    shown = decision.chosen or decision.best
    if shown is None:
        return None, "plain decoding exported: no skip set was confirmed"
    speedup = quoted_speedup(shown.figures, study_label(study).objective)
    if _has_interval(speedup):
        figure = f"{speedup.estimate:.2f}x ({speedup.low:.2f}-{speedup.high:.2f})"
    else:
        figure = f"{speedup.estimate:.2f}x (one paired run: no interval)"
    fast = " as fast as plain decoding" + (", predicted" if study_label(study).objective == "modeled" else "")
    if scored and study_label(study).objective == "speed_x_acceptance":
        # A star at the score labelled with the speedup alone reads as a speedup that the axis does not show.
        acceptance = 1.0 if shown.figures.acceptance_rate is None else shown.figures.acceptance_rate  # as scored
        figure, fast = f"score {shown.score:.2f} = {figure} x acceptance {acceptance:.2f}", ""
    if choices:
        return shown, (f"exported skip set for {choices[0][0]} (1 of {len(choices)}, one per dataset), trial "
                       f"{shown.trial}: {figure}{fast} there")
    if decision.pays:
        return shown, f"exported skip set, trial {shown.trial}: {figure}{fast}"
    return shown, f"best confirmed skip set, trial {shown.trial} (not exported, plain decoding is): {figure}"


def _has_interval(ratio: Ratio) -> bool:
    """Whether a confirmed speedup has an interval: one paired run bounds nothing (its high is unbounded)."""
    return ratio.low is not None and ratio.high is not None


def skip_map(study: optuna.Study, top_fraction: float = 0.2) -> plt.Figure:
    """Layers x {attn, mlp}: the exported (or best confirmed) skip set, and how often each sublayer is skipped
    among the top trials."""
    num_layers = study_label(study).model.num_hidden_layers
    skipping = ranked(study)  # decoded only: pre-screen values are estimates
    shown, label = _highlight(study)
    best_map = np.zeros((2, num_layers))
    if shown is not None:
        best_map[0, list(shown.skip.attn)] = 1
        best_map[1, list(shown.skip.mlp)] = 1
    top = skipping[: max(5, round(top_fraction * len(skipping)))]
    frequency = np.zeros((2, num_layers))
    for trial in top:
        frequency[0, list(trial.skip.attn)] += 1 / len(top)
        frequency[1, list(trial.skip.mlp)] += 1 / len(top)
    fig, axes = plt.subplots(2, 1, figsize=(max(6, num_layers * 0.3), 3.9), constrained_layout=True)
    head = "" if shown is None or shown.skip.head is None else f" (its draft head: {shown.skip.head.rows} rows)"
    fig.suptitle(f"{study.study_name}: which sublayers the draft skips", fontsize=11)
    label += head
    for ax, data, title, bar_label in (
        (axes[0], best_map, label, "this skip set"),
        (axes[1], frequency, f"share of the top {len(top)} skipping trials that skip each sublayer" if top
         else "no decoded trial skipped anything", "share of trials"),
    ):
        image = ax.imshow(data, aspect="auto", cmap="Reds", vmin=0, vmax=1)
        ax.set_yticks([0, 1], ["attn", "mlp"])
        ax.set_xticks(range(num_layers))
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(False)  # Optuna's ggplot style would draw lines through the cells
        ax.set_ylabel("sublayer")
        bar = fig.colorbar(image, ax=ax, fraction=0.02)
        bar.set_label(bar_label, fontsize=8)
        if data is best_map:
            bar.set_ticks([0, 1], labels=["kept", "skipped"])
    if top and not frequency.any():  # as empty as the map of a set that skips nothing: say why
        axes[1].text(0.5, 0.5, "none of them skips a sublayer: they only trim the LM head", transform=axes[1].transAxes,
                     ha="center", va="center", fontsize=9, bbox={"facecolor": "white", "edgecolor": "gray"})
    if shown is None or not shown.skip.size:  # an all-kept map reads as an empty plot: say that it is none
        note = "plain decoding" if shown is None else "no sublayer skipped" + (
            ": the draft only reads fewer rows of the LM head" if shown.skip.head is not None else "")
        axes[0].text(0.5, 0.5, note, transform=axes[0].transAxes, ha="center", va="center", fontsize=9,
                     bbox={"facecolor": "white", "edgecolor": "gray"})
    axes[1].set_xlabel("decoder layer (0-based)")
    return fig


def _where(label: StudyLabel) -> str:
    """Where the speedups a study plots hold: the device it decoded on, or a modeled study's cost profile's."""
    if label.objective != "modeled":
        return f"on {label.device_name or label.device or ''}"
    return f"predicted for {label.predicted_for}" if label.predicted_for else "predicted by a cost profile"


def speedup_vs_skipped(study: optuna.Study) -> plt.Figure:
    """Every decoded skip set's speedup from its trial, and the confirmed candidates with their intervals."""
    label = study_label(study)

    def speedup(record: TrialRecord | ConfirmedCandidate) -> Ratio | None:  # the figure the verdict quotes
        return quoted_speedup(record.figures, label.objective)

    # Plain decoding's trial is 1.0 by definition, not a search estimate: the dashed line draws it.
    decoded = [t for t in decoded_trials(study) if speedup(t) is not None]
    fig, ax = plt.subplots(figsize=(6.5, 4.2), constrained_layout=True)
    points = None
    for (rows, marker), group in _by_head(decoded):
        points = ax.scatter([t.skipped_fraction for t in group], [speedup(t).estimate for t in group],
                            c=[1.0 if t.figures.acceptance_rate is None else t.figures.acceptance_rate for t in group],
                            cmap="viridis", vmin=0, vmax=1, s=26, marker=marker,
                            label=f"trial (search estimate), {'full head' if rows is None else f'head of {rows} rows'}")
    if points is not None:
        fig.colorbar(points, ax=ax, label="acceptance rate (accepted / drafted tokens)")
    confirmation = read_confirmation(study)
    confirmed = [c for c in (confirmation.candidates if confirmation else ()) if speedup(c) is not None]
    xs = _dodged([c.skipped_fraction for c in confirmed])
    if confirmed:
        ratios = [speedup(c) for c in confirmed]
        errors = [[r.estimate - r.low if _has_interval(r) else 0.0 for r in ratios],  # one paired run: no bar
                  [r.high - r.estimate if _has_interval(r) else 0.0 for r in ratios]]
        ax.errorbar(xs, [r.estimate for r in ratios], yerr=errors, fmt="o", mfc="none", color="black", capsize=3,
                    label="confirmed (95% interval), by trial")
        for candidate, x, ratio in zip(confirmed, xs, ratios):
            ax.annotate(str(candidate.trial), (x, ratio.estimate), xytext=(4, 2), textcoords="offset points",
                        fontsize=7)
    shown, title = _highlight(study)
    if shown is not None:
        at = {c.trial: x for c, x in zip(confirmed, xs)}.get(shown.trial, shown.skipped_fraction)  # on its point
        # Hollow: a trial's marker at the same place shows through.
        ax.plot([at], [speedup(shown).estimate], marker="*", markersize=16, markerfacecolor="none",
                markeredgecolor="tab:red", markeredgewidth=1.5, linestyle="none", label=title.split(",")[0], zorder=4)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="plain decoding")
    shares = {t.skipped_fraction for t in decoded} | {c.skipped_fraction for c in confirmed}
    if len(shares) == 1:  # one share (head-only sets: 0), spread apart: ticks at -0.002 would read as shares
        ax.set_xticks(sorted(shares))
        half = max([0.05, *(2 * abs(x - min(shares)) for x in xs)])  # the spread a small offset from its tick
        ax.set_xlim(min(shares) - half, min(shares) + half)
    if not shares:
        ax.set_ylim(0, 2)  # the dashed line inside the frame, not on its edge
        ax.text(0.5, 0.3, "no skip set was decoded: nothing to compare with plain decoding", transform=ax.transAxes,
                ha="center", va="center", fontsize=9, bbox={"facecolor": "white", "edgecolor": "gray"})
    ax.set_xlabel("skipped share of all sublayers (0 to 1)")
    ax.set_ylabel(("predicted" if label.objective == "modeled" else "measured") + " speedup (x plain decoding)")
    ax.set_title(f"{study.study_name} {_where(label)}: speedup vs skipped share\n"
                 + textwrap.fill(title, 90), fontsize=9)  # a long verdict wrapped, not cut at the figure's edges
    # Below the axes: inside, "best" still covered points or intervals wherever they filled the frame.
    legend = ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, fontsize=8)
    for handle in legend.legend_handles:  # a trial's colour is its acceptance (the colour bar), not its kind
        if isinstance(handle, PathCollection):
            handle.set_array(None)  # else drawing colours it from the colour map again
            handle.set_facecolor("gray")
    return fig


def _dodged(xs: list[float]) -> list[float]:
    """`xs` with the points that share one spread apart around it (2% of the points' span, at least 0.005), so that
    candidates at one skipped share (head-only sets: none) show their intervals side by side."""
    step = max(0.02 * (max(xs) - min(xs)), 0.005) if xs else 0.0
    sharing = collections.Counter(xs)
    placed: collections.Counter = collections.Counter()
    dodged = []
    for x in xs:
        dodged.append(x + (placed[x] - (sharing[x] - 1) / 2) * step)
        placed[x] += 1
    return dodged


HEAD_MARKERS = "o^sDvP*X"  # the full head's trials as dots, each trimmed head's by its own marker


def _by_head(trials: list[TrialRecord]) -> list[tuple[tuple[int | None, str], list[TrialRecord]]]:
    """Trials grouped by their draft head's size (the full head first, then from the smallest), with a marker each."""
    sizes = sorted({t.skip.head_rows for t in trials}, key=lambda rows: -1 if rows is None else rows)
    return [((rows, HEAD_MARKERS[i % len(HEAD_MARKERS)]), [t for t in trials if t.skip.head_rows == rows])
            for i, rows in enumerate(sizes)]


def _target_label(study: optuna.Study, units: bool = False) -> str:
    """What a single-objective study maximizes (or the first objective of a Pareto study), for axis labels."""
    objective = study_label(study).objective
    if objective == "speed_x_acceptance":
        return "score: speedup x acceptance rate" if units else "score"
    if objective == "modeled":
        return "predicted speedup (x plain decoding)" if units else "predicted speedup"
    return "measured speedup (x plain decoding)" if units else "speedup"


def _labelled(ax: plt.Axes, title: str, xlabel: str, ylabel: str) -> plt.Figure:
    """An Optuna plot's figure with our title and axis labels (Optuna's are generic)."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.figure.set_size_inches(7, 4.5)
    return ax.figure


def _only(study: optuna.Study, trials: list[TrialRecord]) -> optuna.Study:
    """An in-memory copy of `study` in which every trial but `trials` is failed, so that Optuna's plots and
    importances skip them; each trial keeps its number."""
    kept = {t.number for t in trials}
    view = optuna.create_study(directions=study.directions)
    view.add_trials([t if t.number in kept else optuna.trial.create_trial(state=TrialState.FAIL)
                     for t in study.get_trials(deepcopy=False)])
    return view


def history(study: optuna.Study) -> plt.Figure:
    """Optuna's optimization history of the decoded trials (the first objective of a Pareto study), labelled,
    with whole trial numbers, beside a dashed line at plain decoding's 1.0."""
    multi = len(study.directions) > 1
    # Plain decoding's trial is not measured: every objective scores it 1.0 by definition (its speedup is 1, its
    # acceptance counts as 1), which the dashed line draws.
    trials = decoded_trials(study)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # Optuna's matplotlib plots
        # With no trial, Optuna's legend is empty; the one below holds the plain decoding line.
        warnings.filterwarnings("ignore", "No artists with labels", UserWarning)
        ax = optuna.visualization.matplotlib.plot_optimization_history(
            _only(study, trials), target=(lambda t: t.values[0]) if multi else None,
            target_name="Speedup" if multi else "Score")
    # Above the style's grid (zorder 0.5), which has a line at 1.0 too, and below Optuna's points.
    ax.axhline(1.0, color="0.3", linestyle="--", linewidth=1, zorder=1.5, label="plain decoding (1.0)")
    _confirmed_star(ax, study, multi)
    ax.legend(bbox_to_anchor=(1.05, 1.0), loc="upper left")  # Optuna's, drawn before the line: again to hold it
    low, high = ax.get_ylim()
    ax.set_ylim(min(low, 0.95), max(high, 1.05))  # the line off the frame's edge where every trial is below (above) it
    # Matplotlib's default ticks put 0.5, 1.5, ... between trials when there are few of them.
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not trials:
        ax.set_ylim(0, 2)  # the dashed line inside the frame, not on its edge
        ax.text(0.5, 0.3, "no skip set was decoded:\nnothing to compare with plain decoding", transform=ax.transAxes,
                ha="center", va="center", fontsize=9, bbox={"facecolor": "white", "edgecolor": "gray"})
    return _labelled(ax, f"{study.study_name}: {_target_label(study)} per decoded trial", "trial number",
                     _target_label(study, units=True))


def _confirmed_star(ax: plt.Axes, study: optuna.Study, multi: bool) -> None:
    """The exported (or best confirmed) set's confirmed figure at its trial: the search's best value is one
    measurement of few runs, which the confirmation may not bear out."""
    shown, label = _highlight(study, scored=not multi)
    if shown is None:
        return
    value = quoted_speedup(shown.figures, study_label(study).objective).estimate if multi else shown.score
    ax.scatter([shown.trial], [value], marker="*", s=250, facecolors="none", edgecolors="tab:red", linewidths=1.5,
               zorder=4, label="\n".join(textwrap.wrap(label, 40)))  # hollow: the trial's own point shows through


def pareto(study: optuna.Study) -> plt.Figure:
    """Optuna's Pareto front of a Pareto study's decoded trials. Pre-screened sets' values are estimates from their
    match rate, not measured speedups, and a repeated proposal is a copy of its set's point: neither belongs on it."""
    return _labelled(optuna.visualization.matplotlib.plot_pareto_front(
        _only(study, decoded_trials(study)), target_names=["speedup", "acceptance rate"]),
        f"{study.study_name}: Pareto front of speedup and acceptance", "measured speedup (x plain decoding)",
        "acceptance rate (accepted / drafted tokens)")


def _sublayer_label(param: str) -> str:
    if param == HEAD_PARAM:
        return "draft head size"
    kind, layer = param.split("_")
    return f"layer {int(layer)} {'attention' if kind == 'attn' else 'MLP'}"


# PED-ANOVA compares the parameters of the best `_PED_ANOVA_TOP` of the trials with those of all trials. Optuna's
# documentation asks for at least 5 trials in that top group to make it stable, so 50 trials at the top 10%: below
# that, the top group is one to four trials and the bars mostly show which sublayers those few happened to skip.
_PED_ANOVA_TOP = 0.1
IMPORTANCE_MIN_TRIALS = math.ceil(5 / _PED_ANOVA_TOP)


def _trials(n: int) -> str:
    return f"{n} decoded trial{'' if n == 1 else 's'}"


def _decision(trial: TrialRecord, param: str) -> int | bool:
    """What `param` decided in `trial`: the head's rows, or whether its sublayer was skipped."""
    if param == HEAD_PARAM:
        return trial.skip.head_rows or 0
    kind, layer = param.split("_")
    return int(layer) in (trial.skip.attn if kind == "attn" else trial.skip.mlp)


def _deciding_params(study: optuna.Study, trials: list[TrialRecord]) -> tuple[list[str], list[str]]:
    """The parameters whose decision differs between `trials`, and the others. One the trials all decide alike (a
    sublayer kept in every warm start) cannot explain their values, yet PED-ANOVA would give it a share."""
    numbers = {t.number for t in trials}
    names = {name for t in study.get_trials(deepcopy=False) if t.number in numbers for name in t.params}
    deciding = sorted(name for name in names if len({_decision(t, name) for t in trials}) > 1)
    return deciding, sorted(names - set(deciding))


def importances(study: optuna.Study, top: int = 15) -> plt.Figure:
    """The `top` sublayers (and the draft head size) whose choice explains most of the objective (PED-ANOVA), the
    rest counted in the title; a share of 0 is no bar.

    One bar per parameter would be 2 x layers bars (56 on a 30-layer model), whose labels overlap. On fewer than
    `IMPORTANCE_MIN_TRIALS` decoded trials the title says that the ranking is rough.
    """
    trials = decoded_trials(study)
    deciding, alike = _deciding_params(study, trials)
    values = _ped_anova(study, trials, deciding) if len(trials) >= 2 and deciding else {}
    if not any(values.values()):
        fig, ax = plt.subplots(figsize=(7, 2.5), constrained_layout=True)
        ax.set_axis_off()
        why = (f"too few to say whose skipping matters (it wants {IMPORTANCE_MIN_TRIALS} or more)"
               if len(trials) < IMPORTANCE_MIN_TRIALS else "no choice scored apart from the others")
        ax.text(0.5, 0.5, f"PED-ANOVA tells no sublayer apart from {_trials(len(trials))}:\n{why}",
                ha="center", va="center", fontsize=10)
        ax.set_title(f"{study.study_name}: which sublayers' skipping matters: not known yet", fontsize=10)
        return fig
    total = sum(values.values())
    shares = {name: value / total for name, value in values.items()}
    ranked = sorted(shares.items(), key=lambda item: item[1], reverse=True)
    shown = [(name, share) for name, share in ranked[:top] if share > 0]
    fig, ax = plt.subplots(figsize=(7, max(3.0, 0.28 * len(shown) + 2.0)), constrained_layout=True)
    _share_bars(ax, shown, shares)
    ax.set_xlabel(f"share of the importance for the {_target_label(study)} (PED-ANOVA, %)")
    ax.set_ylabel("what the trials chose")
    ax.set_title(_importance_title(study.study_name, shown, ranked[len(shown):], alike, len(trials)), fontsize=10)
    return fig


def _ped_anova(study: optuna.Study, trials: list[TrialRecord], params: list[str]) -> dict[str, float]:
    """Each of `params`' importance over `trials` alone, unnormalized (all 0 is not equal shares)."""
    multi = len(study.directions) > 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on few trials Optuna warns that every importance is 0; the title says so
        # Only decoded values, each skip set once: a repeated proposal would count its set twice in the top group,
        # and pre-screen estimates sit on another scale.
        return optuna.importance.get_param_importances(
            _only(study, trials), params=params,
            evaluator=optuna.importance.PedAnovaImportanceEvaluator(target_quantile=_PED_ANOVA_TOP),
            # PED-ANOVA takes a given target's low values as the good ones: the speedup, negated.
            target=(lambda t: -t.values[0]) if multi else None, normalize=False)


def _share_bars(ax: plt.Axes, shown: list[tuple[str, float]], shares: dict[str, float]) -> None:
    """One labelled bar per shown parameter, largest on top, coloured by kind; the kinds' totals in a legend below."""
    color = {"attn": "tab:blue", "mlp": "tab:orange", "head": "tab:green"}
    bars = ax.barh([_sublayer_label(name) for name, _ in shown][::-1], [100 * share for _, share in shown][::-1],
                   color=[color[name.split("_")[0]] for name, _ in shown][::-1])
    ax.bar_label(bars, fmt="%.1f%%", padding=2, fontsize=8)
    ax.set_xlim(0, 100 * max(share for _, share in shown) * 1.2 + 0.5)
    ax.tick_params(axis="y", labelsize=8)
    by_kind = {kind: sum(v for k, v in shares.items() if k.startswith(kind)) for kind in ("attn", "mlp")}
    # Below the axes: inside, it covered the bars where there are few of them.
    ax.figure.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=color[kind]) for kind in ("attn", "mlp", "head")
                              if kind != "head" or HEAD_PARAM in shares],
                     labels=[f"attention (all: {by_kind['attn']:.1%})", f"MLP (all: {by_kind['mlp']:.1%})"]
                     + ([f"draft head size: {shares[HEAD_PARAM]:.1%}"] if HEAD_PARAM in shares else []),
                     loc="outside lower center", ncols=3, fontsize=8)


def _importance_title(name: str, shown: list[tuple[str, float]], rest: list[tuple[str, float]], alike: list[str],
                      decoded: int) -> str:
    """What the bars show, what the others share, what was left out, and whether so few trials make it rough."""
    sublayers = sum(param != HEAD_PARAM for param, _ in shown)
    what = " and ".join(part for part in (
        f"the {sublayers} sublayer{'' if sublayers == 1 else 's'}" if sublayers else "",
        "the draft head size" if len(shown) > sublayers else "") if part)
    others = "parameter" if any(param == HEAD_PARAM for param, _ in rest) else "sublayer"
    text = f"{name}: what matters most: {what}"
    if rest:
        one = len(rest) == 1
        text += (f"; the other {len(rest)} {others}{'' if one else 's'} share{'s' if one else ''} "
                 f"{sum(share for _, share in rest):.0%}")
    kept = sum(param != HEAD_PARAM for param in alike)
    if kept:
        text += f"; {kept} other sublayer{'' if kept == 1 else 's'}, kept (or skipped) in every trial, left out"
    if HEAD_PARAM in alike:
        text += "; the draft head size, the same in every trial, left out"
    if decoded < IMPORTANCE_MIN_TRIALS:
        text += (f"\nonly {_trials(decoded)}: a rough ranking (it compares the best {_PED_ANOVA_TOP:.0%} of the "
                 f"trials with all of them, and wants {IMPORTANCE_MIN_TRIALS} or more)")
    return text


def write_plots(study: optuna.Study, folder: Path) -> list[Path]:
    """Write every plot that the study's trials allow; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    multi = len(study.directions) > 1
    figures = {
        "history": lambda: history(study),
        "importances": lambda: importances(study),
        "skip_map": lambda: skip_map(study),
        "speedup_vs_skipped": lambda: speedup_vs_skipped(study),
    }
    if multi:
        figures["pareto"] = lambda: pareto(study)
    written = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
        for name, make in figures.items():
            path = folder / f"{name}.png"
            with plt.rc_context():  # Optuna's plots switch matplotlib to its style: the caller's comes back after
                save_figure(make(), path)
            written.append(path)
    return written
