"""Plots people read: few labelled bars, a title, axis labels with units; numbers on bench bars."""

import json
import random

import matplotlib.colors
import matplotlib.container
import matplotlib.pyplot as plt
import optuna
import pytest
from optuna.distributions import FloatDistribution

from conftest import tiny_model
from skipsearch.decode.config import ModelInfo
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet
from skipsearch.report import bench, plots
from skipsearch.report.bench import BenchRow
from skipsearch.search.records import STUDY_ATTR
from skipsearch.search.study import SearchSpace, StudySettings, run_study

LAYERS = 30


def synthetic_study(objective: str = "speed_x_acceptance", n: int = 24) -> optuna.Study:
    """A finished study of a 30-layer model (56 parameters) without decoding anything: plots only read trials."""
    space = SearchSpace(num_layers=LAYERS, skip_prior=0.3)
    directions = ["maximize", "maximize"] if objective == "pareto" else ["maximize"]
    study = optuna.create_study(study_name="synthetic", directions=directions)
    study.set_user_attr(STUDY_ATTR, {"model": {"name_or_path": "synthetic", "architecture": "LlamaForCausalLM",
                                               "num_hidden_layers": LAYERS, "hidden_size": 576}, "objective": objective})
    rng = random.Random(0)
    for _ in range(n):
        params = {space.param_name(k, i): rng.random() for k, i in space.sublayers()}
        skip = space.from_params(params)
        # Skipping late attention is cheap and accepted here, so those parameters carry the importance.
        accept = max(0.05, 1.0 - 0.04 * len(skip.mlp) - 0.01 * sum(i < 20 for i in skip.attn))
        speedup = 0.8 + 0.05 * sum(i >= 20 for i in skip.attn) * accept
        attrs = {"skip_attn": list(skip.attn), "skip_mlp": list(skip.mlp), "skipped": skip.size,
                 "skipped_fraction": skip.skipped_fraction(LAYERS), "speedup": speedup, "acceptance_rate": accept}
        values = [speedup, accept] if objective == "pareto" else [speedup * accept]
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={name: FloatDistribution(0, 1) for name in params}, values=values,
            user_attrs=attrs))
    return study


def assert_labelled(fig: plt.Figure) -> None:
    """A title, and x and y labels (in a figure of stacked panels, on some panel)."""
    assert fig.axes[0].get_title() or (fig._suptitle is not None and fig._suptitle.get_text())
    assert any(ax.get_xlabel() for ax in fig.axes) and any(ax.get_ylabel() for ax in fig.axes)


def test_importances_shows_the_top_sublayers_by_name():
    study = synthetic_study()
    fig = plots.importances(study, top=15)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 15 and all(label.startswith("layer ") for label in labels)
    assert "the other 41 sublayers share" in ax.get_title() and "%" in ax.get_xlabel()
    assert all(text.get_text().endswith("%") for text in ax.texts)  # every bar carries its number
    assert "attention (all:" in fig.legends[0].get_texts()[0].get_text()
    assert_labelled(fig)
    plt.close(fig)


@pytest.mark.parametrize("objective, expected", [("speed_x_acceptance", 4), ("pareto", 5)])
def test_every_plot_has_a_title_and_labels(tmp_path, monkeypatch, objective, expected):
    figures = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: (figures.append(fig), path.write_bytes(b"png")))
    written = plots.write_plots(synthetic_study(objective), tmp_path)
    assert len(written) == len(figures) == expected
    for fig in figures:
        assert_labelled(fig)
        plt.close(fig)


def test_importances_on_few_decoded_trials_say_they_are_rough():
    assert plots.IMPORTANCE_MIN_TRIALS == 50
    study = synthetic_study(n=49)
    screened = study.trials[0]  # a pre-screened set is not decoded: it does not count
    study.add_trial(optuna.trial.create_trial(params=screened.params, distributions=screened.distributions,
                                              values=[0.01], user_attrs={**screened.user_attrs, "screened_out": "x"}))
    fig = plots.importances(study)
    title = fig.axes[0].get_title()
    assert "only 49 decoded trials: a rough ranking" in title and "wants 50 or more" in title, title
    assert len(fig.axes[0].patches) == 15  # still drawn
    plt.close(fig)
    fig = plots.importances(synthetic_study(n=50))
    assert "rough" not in fig.axes[0].get_title()
    plt.close(fig)


def test_importances_of_a_single_trial_say_nothing_is_known_instead_of_equal_bars():
    fig = plots.importances(synthetic_study(n=1))
    [ax] = fig.axes
    assert "not known yet" in ax.get_title() and not ax.patches
    assert "1 decoded trial:" in ax.texts[0].get_text() and "50 or more" in ax.texts[0].get_text()
    plt.close(fig)


def test_pareto_importances_rank_by_high_speedup(monkeypatch):
    """PED-ANOVA takes low values of a given target as the good ones: a Pareto study's speedup must be negated."""
    seen = {}
    real = optuna.importance.get_param_importances

    def spy(study, **kwargs):
        seen["target"] = kwargs["target"]
        return real(study, **kwargs)

    monkeypatch.setattr(optuna.importance, "get_param_importances", spy)
    study = synthetic_study("pareto")
    plt.close(plots.importances(study))
    fastest = max(study.trials, key=lambda t: t.values[0])
    slowest = min(study.trials, key=lambda t: t.values[0])
    assert seen["target"](fastest) < seen["target"](slowest)


def test_plain_decodings_trial_is_not_counted_as_decoded_nor_drawn_as_a_search_estimate():
    study = synthetic_study(n=5)
    first = study.trials[0]
    study.add_trial(optuna.trial.create_trial(
        params={name: 1.0 for name in first.params}, distributions=first.distributions, values=[1.0],
        user_attrs={"skip_attn": [], "skip_mlp": [], "skipped": 0, "skipped_fraction": 0.0, "speedup": 1.0,
                    "speedup_low": 1.0, "speedup_high": 1.0, "acceptance_rate": None, "plain_decoding": "by definition"}))
    assert len(plots.decoded_trials(study)) == 5
    fig = plots.speedup_vs_skipped(study)
    assert len(fig.axes[0].collections[0].get_offsets()) == 5  # the dashed line at 1.0 is plain decoding
    plt.close(fig)


def test_speedup_plot_of_a_modeled_study_names_the_device_its_profile_prices():
    """A modeled study decodes here but its speedups are predictions for its cost profile's device: the title said
    this machine's name."""
    from skipsearch.decode.cost_profile import CostProfile

    study = synthetic_study("modeled", n=4)
    label = {**study.user_attrs[STUDY_ATTR], "device": "cpu", "device_name": "Intel Xeon"}
    study.set_user_attr(STUDY_ATTR, {**label, "cost_profile": CostProfile.load("nvidia-h200/llama-2-7b").to_dict()})
    title = plots.speedup_vs_skipped(study).axes[0].get_title()
    assert title.startswith("synthetic predicted for NVIDIA H200: speedup vs skipped share"), title
    study.set_user_attr(STUDY_ATTR, {**label, "objective": "speedup"})
    assert plots.speedup_vs_skipped(study).axes[0].get_title().startswith("synthetic on Intel Xeon: speedup")
    plt.close("all")


@pytest.mark.parametrize("objective", ["speed_x_acceptance", "pareto"])
def test_history_ticks_are_whole_trial_numbers(objective):
    fig = plots.history(synthetic_study(objective, n=5))  # few trials: matplotlib would tick 0.5, 1.5, ...
    ticks = fig.axes[0].get_xticks()
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
    assert fig.axes[0].get_xlabel() == "trial number"
    plt.close(fig)


def test_confirmed_sets_at_one_skipped_share_are_drawn_apart_and_named_by_trial():
    """Head-only sets all skip no sublayer: their confirmed points and intervals drew on top of one another, and
    nothing said which was which. Each is spread apart around its share and labelled with its trial; the legend's
    trial markers are grey, since a trial's colour is its acceptance."""
    from skipsearch.search.records import Confirmation, ConfirmedCandidate, Figures, Ratio, write_confirmation

    study = synthetic_study(n=6)
    shares = [0.25, 0.0, 0.0, 0.0]  # the last, the fastest, is the set shown
    candidates = tuple(ConfirmedCandidate(trial, SkipSet(), 1.0, 0, share,
                                          Figures(speedup=Ratio(0.9 + 0.05 * trial, 0.8, 1.1), paired_runs=8,
                                                  acceptance_rate=0.9, prompts=4))
                       for trial, share in enumerate(shares))
    write_confirmation(study, Confirmation(candidates, top=4, repeats=2))
    fig = plots.speedup_vs_skipped(study)
    ax = fig.axes[0]
    [confirmed] = [c for c in ax.containers if c.get_label().startswith("confirmed")]
    xs = list(confirmed.lines[0].get_xdata())
    assert len(set(xs)) == 4 and xs[0] == 0.25 and sorted(xs[1:]) == xs[1:] and xs[2] == 0.0  # spread around 0.0
    assert max(xs[1:]) - min(xs[1:]) < 0.05  # beside their share, not moved along the axis
    assert [t.get_text() for t in ax.texts] == ["0", "1", "2", "3"]
    assert len(ax.get_xticks()) > 1  # shares apart: the axis' own ticks
    [star] = [line for line in ax.lines if line.get_marker() == "*"]  # the shown set, on its own point
    shown = plots._highlight(study)[0].trial
    assert list(star.get_xdata()) == [xs[shown]] and xs[shown] != shares[shown]
    trial_handles = [h for h in ax.get_legend().legend_handles if h.get_label().startswith("trial")]
    fig.canvas.draw()  # drawing recolours a handle that still maps acceptance to colour
    grey = matplotlib.colors.to_rgba("gray")
    assert trial_handles and all(tuple(h.get_facecolor()[0]) == grey for h in trial_handles)
    assert ax.get_legend().get_window_extent().y1 <= ax.get_window_extent().y0  # below the axes, covering nothing
    plt.close(fig)
    head_only = synthetic_study(n=0)  # every set at share 0: one tick, not -0.002, 0.000, 0.002
    write_confirmation(head_only, Confirmation(candidates[1:], top=3, repeats=2))
    fig = plots.speedup_vs_skipped(head_only)
    ax = fig.axes[0]
    assert list(ax.get_xticks()) == [0.0] and len(set(ax.containers[0].lines[0].get_xdata())) == 3
    low, high = ax.get_xlim()
    spread = ax.containers[0].lines[0].get_xdata()
    assert high - low >= 5 * (max(spread) - min(spread))  # beside the tick, not at the axis' edges
    plt.close(fig)


def test_a_confirmation_of_one_paired_run_is_drawn_and_titled_without_an_interval():
    """One paired run bounds nothing: its figure says "no interval" rather than 0.00-inf, and no bar runs from 0."""
    from skipsearch.search.records import Confirmation, ConfirmedCandidate, Figures, Ratio, write_confirmation

    study = synthetic_study(n=6)
    single = ConfirmedCandidate(1, SkipSet.of([3]), 0.89, 1, 1 / 60,
                                Figures(speedup=Ratio(0.89, 0.0, None), paired_runs=1, acceptance_rate=0.9, prompts=1))
    write_confirmation(study, Confirmation((single,), top=1, repeats=1))
    assert plots._highlight(study)[1].endswith("0.89x (one paired run: no interval)")
    fig = plots.speedup_vs_skipped(study)
    [confirmed] = [c for c in fig.axes[0].containers if c.get_label().startswith("confirmed")]
    [bars] = confirmed.lines[2]
    assert all(abs(y1 - y0) < 1e-12 for (_, y0), (_, y1) in bars.get_segments())  # no whisker
    plt.close(fig)


def test_plots_with_nothing_to_draw_say_so():
    """A study of plain decoding alone draws no point; a study whose top trials only trim the head leaves the
    share of skipped sublayers all zero: each says why instead of showing an empty panel."""
    from skipsearch.decode.skipset import DraftHead

    empty = synthetic_study(n=0)
    fig = plots.speedup_vs_skipped(empty)
    assert "nothing to compare" in fig.axes[0].texts[0].get_text() and fig.axes[0].get_ylim()[1] > 1.0
    plt.close(fig)
    head_only = synthetic_study(n=0)
    head = DraftHead(tuple(range(64)))
    for number in range(3):
        head_only.add_trial(optuna.trial.create_trial(value=1.1, user_attrs={
            "skip_attn": [], "skip_mlp": [], "skip_head_rows": 64, "skipped": 0, "skipped_fraction": 0.0,
            "speedup": 1.1, "acceptance_rate": 0.9}))
    from skipsearch.search.records import write_vocabulary
    from skipsearch.search.vocabulary import VocabularyRanking

    write_vocabulary(head_only, VocabularyRanking(head.ids))
    fig = plots.skip_map(head_only)
    assert [t.get_text() for t in fig.axes[1].texts] == ["none of them skips a sublayer: they only trim the LM head"]
    plt.close(fig)


def test_a_skip_map_of_a_set_that_skips_no_sublayer_says_so():
    """A head-only set (or plain decoding) leaves the set's map all "kept", which read as an empty plot."""
    from skipsearch.decode.skipset import DraftHead
    from skipsearch.search.records import (Confirmation, ConfirmedCandidate, Figures, Ratio, write_confirmation,
                                           write_vocabulary)
    from skipsearch.search.vocabulary import VocabularyRanking

    study = synthetic_study(n=6)
    write_vocabulary(study, VocabularyRanking(tuple(range(100))))  # what a study drafting with trimmed heads keeps
    fig = plots.skip_map(study)
    assert [t.get_text() for t in fig.axes[0].texts] == ["plain decoding"]  # nothing confirmed
    plt.close(fig)
    head_only = ConfirmedCandidate(2, SkipSet(head=DraftHead(tuple(range(64)))), 1.3, 0, 0.0,
                                   Figures(speedup=Ratio(1.3, 1.2, 1.4), paired_runs=8, acceptance_rate=0.9, prompts=4))
    write_confirmation(study, Confirmation((head_only,), top=1, repeats=2))
    fig = plots.skip_map(study)
    assert [t.get_text() for t in fig.axes[0].texts] == [
        "no sublayer skipped: the draft only reads fewer rows of the LM head"]
    assert "draft head: 64 rows" in fig.axes[0].get_title() and not fig.axes[1].texts
    plt.close(fig)


def test_bench_bars_carry_their_numbers(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(bench, "render_png", lambda fig: figures.append(fig) or b"png")
    rows = [BenchRow("hf greedy", 20.0, 1.0, True), BenchRow("skipsearch attn=[3]", 25.0, 1.25, True)]
    bench.write_outputs(rows, tmp_path, {"model": "m", "device": "cpu", "num_prompts": 2, "max_new_tokens": 8})
    [fig] = figures
    texts = sorted(t.get_text() for t in fig.axes[0].texts)
    assert texts == ["1.00x (20.0 tok/s)", "1.25x (25.0 tok/s)"]
    assert_labelled(fig)
    assert "compiled" not in fig.axes[0].get_title()
    plt.close(fig)
    bench.write_outputs(rows, tmp_path, {"model": "m", "device": "cpu", "num_prompts": 2, "max_new_tokens": 8,
                                         "compile": True})
    assert figures[-1].axes[0].get_title().endswith(", skipsearch compiled")  # a chart says which steps it timed
    plt.close(figures[-1])
    with_intervals = [BenchRow("hf greedy", 20.0, 1.0, True, 1.0, 1.0), BenchRow("skipsearch", 25.0, 1.25, True, 1.1, 1.4)]
    bench.write_outputs(with_intervals, tmp_path, {"model": "m", "device": "cpu"})
    assert sorted(t.xy[0] for t in figures[-1].axes[0].texts) == [1.0, 1.4]  # past the whisker, not into it
    plt.close(figures[-1])
    wide = [*with_intervals, BenchRow("skipsearch attn=[1]", 40.0, 2.0, False, 1.5, 2.6)]  # "..., output differs"
    bench.write_outputs(wide, tmp_path, {"model": "m", "device": "cpu"})
    ax = figures[-1].axes[0]
    figures[-1].canvas.draw()
    assert all(t.get_window_extent().x1 <= ax.get_window_extent().x1 for t in ax.texts)  # inside the frame
    plt.close(figures[-1])
    for repeats, said in ((1, "x 1 repeat"), (3, "x 3 repeats")):
        bench.write_outputs(rows, tmp_path, {"model": "m", "device": "cpu", "num_prompts": 2, "max_new_tokens": 8,
                                             "repeats": repeats})
        assert figures[-1].axes[0].get_title().endswith(f"2 prompts x 8 new tokens {said}")  # not "1 repeats"
        plt.close(figures[-1])


def _whiskered_rows(bars: matplotlib.container.BarContainer) -> dict[float, tuple[float, float]]:
    """{a bar's centre height: its whisker's (left, right) x}, for the bars that have a whisker drawn."""
    drawn = {}
    for segment in bars.errorbar.lines[2][0].get_segments():
        if len(segment):
            (x0, y), (x1, _) = segment
            drawn[round(float(y), 6)] = (float(x0), float(x1))
    return drawn


def test_bench_bars_draw_no_whisker_for_an_unbounded_interval(tmp_path, monkeypatch):
    """One paired run bounds nothing (low 0, no high): a whisker down to 0 and none up read as a measured interval.
    The bar has no whisker, and its text says why."""
    figures = []
    monkeypatch.setattr(bench, "render_png", lambda fig: figures.append(fig) or b"png")
    rows = [BenchRow("hf greedy", 20.0, 1.0, True, 1.0, 1.0), BenchRow("skipsearch", 25.0, 1.25, True, 1.1, 1.4),
            BenchRow("skipsearch attn=[3]", 24.0, 1.2, True, 0.0, None)]
    bench.write_outputs(rows, tmp_path, {"model": "m", "device": "cpu"})
    ax = figures[0].axes[0]
    [bars] = [c for c in ax.containers if isinstance(c, matplotlib.container.BarContainer)]
    centres = [round(bar.get_y() + bar.get_height() / 2, 6) for bar in bars]  # bottom up: the rows reversed
    assert _whiskered_rows(bars) == {centres[2]: (1.0, 1.0), centres[1]: (1.1, 1.4)}
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts == ["1.00x (20.0 tok/s)", "1.20x (24.0 tok/s), interval unbounded: 1 paired run",
                     "1.25x (25.0 tok/s)"]
    plt.close(figures[0])


def test_category_bars_draw_no_whisker_for_an_unbounded_interval():
    from skipsearch.report import categories

    groups = [categories.CategoryRows(name, prompts, [BenchRow("hf greedy", 20.0, 1.0, True, 1.0, 1.0),
                                                      BenchRow("skipsearch", 22.0, 1.1, True, low, high)])
              for name, prompts, low, high in (("qa", 1, 0.0, None), ("coding", 4, 0.9, 1.3))]
    drawn = [categories.category_figure(groups, "per category")]
    ax = drawn[0].axes[0]
    [bars] = [c for c in ax.containers if isinstance(c, matplotlib.container.BarContainer)]
    coding, qa = (round(bar.get_y() + bar.get_height() / 2, 6) for bar in bars)  # bottom up: the groups reversed
    assert _whiskered_rows(bars) == {coding: (0.9, 1.3)}
    assert sorted(t.get_text() for t in ax.texts) == ["1.10x", "1.10x, interval unbounded: 1 paired run"]
    plt.close(drawn[0])


def test_real_study_attributes_are_json_and_plots_are_written(tmp_path):
    model = tiny_model(num_layers=6)
    settings = StudySettings(study_name="real", storage=f"sqlite:///{tmp_path}/real.db", n_trials=4, num_prompts=1,
                             max_new_tokens=4, min_match=0.0, show_progress_bar=False)
    study = run_study(model, ModelInfo.of(model, "tiny"), "float32", [[5, 9, 14]], settings,
                      SearchSpace(num_layers=6, skip_prior=0.4), DraftPolicy(max_draft_tokens=2), None)
    # optuna-dashboard and JSON tools read these: plain JSON, no NaN or infinity.
    json.dumps(study.user_attrs, allow_nan=False)
    for trial in study.trials:
        json.dumps(trial.user_attrs, allow_nan=False)
    written = plots.write_plots(study, tmp_path / "plots")
    assert {p.name for p in written} == {"history.png", "importances.png", "skip_map.png", "speedup_vs_skipped.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_writing_plots_leaves_the_callers_matplotlib_style_alone(tmp_path):
    before = dict(plt.rcParams)
    plots.write_plots(synthetic_study(n=6), tmp_path)
    assert dict(plt.rcParams) == before


def test_importances_count_each_decoded_skip_set_once(monkeypatch):
    """A repeated proposal (answered without decoding) and a pre-screened trial must not weigh in PED-ANOVA."""
    seen = {}
    real = optuna.importance.get_param_importances

    def spy(study, **kwargs):
        seen["trials"] = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
        return real(study, **kwargs)

    monkeypatch.setattr(optuna.importance, "get_param_importances", spy)
    study = synthetic_study(n=8)
    first = study.trials[0]
    study.add_trial(optuna.trial.create_trial(params=first.params, distributions=first.distributions,
                                              values=first.values, user_attrs={**first.user_attrs, "repeat_of": 0}))
    study.add_trial(optuna.trial.create_trial(params=first.params, distributions=first.distributions, values=[0.1],
                                              user_attrs={**first.user_attrs, "screened_out": True}))
    plt.close(plots.importances(study))
    assert len(seen["trials"]) == 8


def test_skip_map_ranks_only_decoded_trials():
    study = synthetic_study(n=6)
    without = plots.skip_map(study)
    expected = without.axes[1].images[0].get_array().copy()
    params = {name: 0.0 for name in study.trials[0].params}  # every sublayer skipped
    skip = SearchSpace(num_layers=LAYERS, skip_prior=0.3).from_params(params)
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions=study.trials[0].distributions, values=[99.0],
        user_attrs={"skip_attn": list(skip.attn), "skip_mlp": list(skip.mlp), "skipped": skip.size,
                    "screened_out": True}))  # a pre-screen estimate, on another scale, at the top by value
    fig = plots.skip_map(study)
    assert (fig.axes[1].images[0].get_array() == expected).all()
    plt.close(fig)
    plt.close(without)


def test_history_shows_decoded_trials_at_their_numbers():
    """A pre-screen estimate and a repeated proposal are not points; the others keep their trial numbers."""
    study = synthetic_study(n=4)
    first = study.trials[0]
    for attrs in ({"repeat_of": 0}, {"screened_out": True}):
        study.add_trial(optuna.trial.create_trial(params=first.params, distributions=first.distributions,
                                                  values=[50.0], user_attrs={**first.user_attrs, **attrs}))
    study.add_trial(optuna.trial.create_trial(params=first.params, distributions=first.distributions,
                                              values=[0.5], user_attrs=dict(first.user_attrs)))
    fig = plots.history(study)
    points = fig.axes[0].collections[0].get_offsets()
    assert sorted(points[:, 0].tolist()) == [0, 1, 2, 3, 6] and points[:, 1].max() < 50
    plt.close(fig)


def test_pareto_front_draws_decoded_trials_only():
    """A pre-screened set's values (half its match rate, its match rate) are no measured speedup, and a repeated
    proposal is a copy of its set: neither is a point under the axis "measured speedup"."""
    study = synthetic_study("pareto", n=4)
    first = study.trials[0]
    study.add_trial(optuna.trial.create_trial(params=first.params, distributions=first.distributions,
                                              values=[0.45, 0.9], user_attrs={**first.user_attrs, "screened_out": "x"}))
    study.add_trial(optuna.trial.create_trial(params=first.params, distributions=first.distributions,
                                              values=first.values, user_attrs={**first.user_attrs, "repeat_of": 0}))
    fig = plots.pareto(study)
    points = sorted(tuple(p) for c in fig.axes[0].collections for p in c.get_offsets().tolist())
    assert points == sorted(tuple(t.values) for t in study.trials[:4])
    assert fig.axes[0].get_xlabel() == "measured speedup (x plain decoding)"
    plt.close(fig)


def _plain_decoding_first(objective: str, n: int) -> optuna.Study:
    """A study whose trial 0 is the plain-decoding warm start (1.0 by definition, not decoded), then `n` trials."""
    study = synthetic_study(objective, n=0)
    study.add_trial(optuna.trial.create_trial(
        values=[1.0, 1.0] if objective == "pareto" else [1.0],
        user_attrs={"skip_attn": [], "skip_mlp": [], "skipped": 0, "skipped_fraction": 0.0, "speedup": 1.0,
                    "acceptance_rate": None, "plain_decoding": "by definition"}))
    study.add_trials(synthetic_study(objective, n=n).trials)
    return study


def _plain_line(ax: plt.Axes) -> list:
    """The dashed line at 1.0, where it is drawn above the grid (which has a white line at 1.0 too): the axis draws
    its grid lines at its own zorder."""
    grid = ax.yaxis.get_zorder()
    return [line for line in ax.get_lines() if line.get_label() == "plain decoding (1.0)"
            and set(line.get_ydata()) == {1.0} and line.get_zorder() > grid]


@pytest.mark.parametrize("objective", ["speed_x_acceptance", "pareto"])
def test_history_draws_plain_decoding_as_a_line_not_a_trial(objective):
    fig = plots.history(_plain_decoding_first(objective, n=4))
    ax = fig.axes[0]
    assert sorted(ax.collections[0].get_offsets()[:, 0].tolist()) == [1, 2, 3, 4]
    assert _plain_line(ax) and "plain decoding (1.0)" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert ax.get_ylim()[0] <= 0.95 and ax.get_ylim()[1] >= 1.05  # the line inside the frame, not on its edge
    plt.close(fig)


def test_a_history_of_plain_decoding_alone_says_so():
    fig = plots.history(_plain_decoding_first("speed_x_acceptance", n=0))
    ax = fig.axes[0]
    assert not any(len(points.get_offsets()) for points in ax.collections) and _plain_line(ax)
    assert "no skip set was decoded" in ax.texts[0].get_text() and ax.get_ylim()[0] < 1.0 < ax.get_ylim()[1]
    plt.close(fig)


def test_category_bars_stand_in_the_legends_order_beside_a_labelled_baseline():
    from skipsearch.report import categories

    methods = ["hf prompt lookup (10)", "skipsearch plain loop", "skipsearch attn=[3]"]
    groups = [categories.CategoryRows(name, 2, [BenchRow("hf greedy", 20.0, 1.0, True), *[
        BenchRow(method, 20.0 + k, 1.0 + 0.1 * k, True, 0.9, 1.3) for k, method in enumerate(methods)]])
        for name in ("qa", "coding")]
    drawn = [categories.category_figure(groups, "per category")]
    ax = drawn[0].axes[0]
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert "HF greedy (1.0x)" in legend and [label for label in legend if label in methods] == methods
    heights = {container.get_label(): [bar.get_y() for bar in container] for container in ax.containers
               if isinstance(container, matplotlib.container.BarContainer)}
    for category in range(2):  # within each category, the legend's first method stands highest
        tops = [heights[method][category] for method in methods]
        assert tops == sorted(tops, reverse=True)
    # Every bar carries its number, right of its whisker's end (1.3) rather than into the whisker.
    assert sorted(t.get_text() for t in ax.texts) == ["1.00x", "1.00x", "1.10x", "1.10x", "1.20x", "1.20x"]
    assert {t.xy[0] for t in ax.texts} == {1.3} and ax.get_xlim()[1] > 1.3
    plt.close(drawn[0])


def study_of(name: str, space: SearchSpace, scored: list[tuple[SkipSet, float]]) -> optuna.Study:
    """A finished study of `scored`'s skip sets, each with its value, drawn by `space`'s parameters."""
    study = optuna.create_study(study_name=name, directions=["maximize"])
    study.set_user_attr(STUDY_ATTR, {"model": {"name_or_path": "synthetic", "architecture": "LlamaForCausalLM",
                                               "num_hidden_layers": LAYERS, "hidden_size": 576},
                                     "objective": "speed_x_acceptance"})
    for skip, value in scored:
        params = space.params_for(skip)
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={name: FloatDistribution(0, 1) for name in params}, values=[value],
            user_attrs={"skip_attn": list(skip.attn), "skip_mlp": list(skip.mlp), "skipped": skip.size}))
    return study


def test_importances_leave_out_sublayers_that_every_trial_decided_alike():
    """A study of warm starts alone keeps most sublayers in every trial: PED-ANOVA gave each a share all the same."""
    space = SearchSpace(num_layers=LAYERS, skip_prior=0.3)
    warm = [space.from_params(params) for params in space.warm_start_params()][1:]  # the first skips nothing
    study = study_of("warm", space, [(skip, 1.0 + value) for value, skip in enumerate(warm)])
    varied = {f"layer {i} attention" for i in range(15, 30)} | {f"layer {i} MLP" for i in range(15, 30)}
    fig = plots.importances(study)
    ax = fig.axes[0]
    labels = {t.get_text() for t in ax.get_yticklabels()}
    assert labels and labels <= varied, labels - varied
    decided = {space.param_name(kind, i) for skip in warm for kind, ids in (("attn", skip.attn), ("mlp", skip.mlp))
               for i in ids if not all(i in (s.attn if kind == "attn" else s.mlp) for s in warm)}
    assert len(labels) == min(15, len(decided))
    assert f"{len(space.sublayers()) - len(decided)} other sublayers, kept (or skipped) in every trial, left out" \
        in ax.get_title()
    plt.close(fig)


def test_importances_of_few_choices_keep_the_legend_off_the_bars_and_name_what_they_show():
    """One sublayer decided differently: one bar, whose legend sits below the axes rather than over it."""
    study = study_of("few", SearchSpace(num_layers=LAYERS, skip_prior=0.3),
                     [(SkipSet.of([5] if number % 2 else [], [7], LAYERS), 1.0 + 0.1 * (number % 2) + 0.001 * number)
                      for number in range(12)])
    fig = plots.importances(study)
    [ax] = fig.axes
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["layer 5 attention"]
    assert ax.get_title().startswith("few: what matters most: the 1 sublayer;") and "left out" in ax.get_title()
    assert fig.legends[0].get_window_extent().y1 <= ax.get_window_extent().y0
    plt.close(fig)
    head = plots._importance_title("s", [(plots.HEAD_PARAM, 0.7), ("attn_03", 0.3)], [("mlp_04", 0.0)], [], 60)
    assert head == "s: what matters most: the 1 sublayer and the draft head size; the other 1 sublayer shares 0%"
    alike = plots._importance_title("s", [("attn_03", 1.0)], [], ["mlp_04", plots.HEAD_PARAM], 60)
    assert alike == ("s: what matters most: the 1 sublayer; 1 other sublayer, kept (or skipped) in every trial, left "
                     "out; the draft head size, the same in every trial, left out")


@pytest.mark.parametrize("objective", ["speed_x_acceptance", "pareto"])
def test_history_marks_the_confirmed_figure_of_the_set_the_other_plots_show(objective):
    """The search's best value is one measurement; the confirmation may not bear it out. The history draws the
    shown set's confirmed figure at its trial, in the objective's units, and names it as the other plots do."""
    from skipsearch.search.records import Confirmation, ConfirmedCandidate, Figures, Ratio, write_confirmation

    study = synthetic_study(objective, n=6)
    confirmed = ConfirmedCandidate(3, SkipSet.of([21]), 0.62, 1, 1 / 56,
                                   Figures(speedup=Ratio(0.69, 0.57, 0.84), paired_runs=8, acceptance_rate=0.9,
                                           prompts=4))
    write_confirmation(study, Confirmation((confirmed,), top=1, repeats=2))
    fig = plots.history(study)
    ax = fig.axes[0]
    [star] = [c for c in ax.collections if c.get_label().startswith("best confirmed skip set")]
    assert star.get_offsets().tolist() == [[3, 0.69 if objective == "pareto" else 0.62]]
    named = plots._highlight(study, scored=objective != "pareto")[1]
    assert named.replace(" ", "") == star.get_label().replace("\n", "").replace(" ", "")
    assert star.get_label() in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(fig)
    fig = plots.history(synthetic_study(objective, n=6))  # nothing confirmed: no star
    assert not [c for c in fig.axes[0].collections if "confirmed" in c.get_label()]
    plt.close(fig)


@pytest.mark.parametrize("objective, score, figure", [
    ("speed_x_acceptance", 0.62, "score 0.62 = 0.69x (0.57-0.84) x acceptance 0.90"),
    ("speedup", 0.69, "0.69x (0.57-0.84)"), ("pareto", 0.62, "0.69x (0.57-0.84)"),
    ("modeled", 0.75, "0.75x (0.70-0.80)")])
def test_history_star_is_labelled_with_the_value_it_is_drawn_at(objective, score, figure):
    """A speed_x_acceptance history draws the confirmed star at its score (speedup x acceptance): a label quoting
    the speedup alone named a value the star is not at. Its label gives the score, then what it comes from."""
    from skipsearch.search.records import Confirmation, ConfirmedCandidate, Figures, Ratio, write_confirmation

    study = synthetic_study(objective, n=6)
    figures = Figures(speedup=Ratio(0.69, 0.57, 0.84), paired_runs=8, acceptance_rate=0.9, prompts=4,
                      predicted_speedup=Ratio(0.75, 0.7, 0.8) if objective == "modeled" else None)
    write_confirmation(study, Confirmation((ConfirmedCandidate(3, SkipSet.of([21]), score, 1, 1 / 56, figures),),
                                           top=1, repeats=2))
    fig = plots.history(study)
    [star] = [c for c in fig.axes[0].collections if c.get_label().startswith("best confirmed skip set")]
    label = "".join(star.get_label().split())  # wrapped for the legend, maybe at a hyphen
    assert label.endswith("".join(f"(not exported, plain decoding is): {figure}".split())), star.get_label()
    drawn_at = star.get_offsets()[0][1]
    assert figure.startswith(f"score {drawn_at:.2f} =" if objective == "speed_x_acceptance" else f"{drawn_at:.2f}x")
    plt.close(fig)
