import json

import torch

from conftest import VirtualTimer, tiny_model
from skipsearch.decode.provenance import ConfigMetrics, ConfigSearch
from skipsearch.costs.profiler import profile_costs
from skipsearch.decode.config import ModelInfo, SkipConfig
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet
from skipsearch.report.bench import bench_rows, bench_verdict, format_table, measure_methods, write_outputs

PROMPTS = [[5, 9, 14, 3, 5, 9], [7, 2, 30, 31, 8]]


def test_bench_rows_json_and_chart(tmp_path):
    model = tiny_model(dtype=torch.float64)
    config = SkipConfig(model=ModelInfo.of(model, "tiny"), skip=SkipSet.of([1], [2], 4),
                        draft=DraftPolicy(max_draft_tokens=3, adaptive=False))
    profile = profile_costs(model, contexts=(8,), max_verify_tokens=4, repeats=2, calibrate=False,
                            clock=VirtualTimer(model))
    measured = measure_methods(model, PROMPTS, max_new_tokens=8, eos=None, config=config, early_exit_layer=2,
                               prompt_lookup_tokens=3, repeats=2, show_progress=False)
    rows = bench_rows(model, measured, config, profile, project_with=[("other", profile)])
    names = [r.method for r in rows]
    assert names == ["hf greedy", "hf prompt lookup (3)", "hf early exit (layer 2)", "skipsearch plain",
                     "skipsearch attn=[1] mlp=[2] (guarded)",
                     "skipsearch attn=[1] mlp=[2] (unguarded, as its study measured)"]
    assert [r.guarded for r in rows[-2:]] == [True, False] and rows[3].guarded is None
    assert all(r.identical for r in rows), format_table(rows)
    assert rows[0].speedup == 1.0 and all(r.tokens_per_second > 0 for r in rows)
    ours = rows[-1]
    assert ours.acceptance_rate is not None and ours.predicted_speedup > 0 and ours.speedup_over_plain_loop > 0
    assert rows[3].acceptance_rate is None and rows[3].predicted_speedup is None
    # The guard's choices follow this machine's timings: only the unguarded row is projected to another device.
    assert [r.projected_speedups is None for r in rows] == [True] * 5 + [False]
    assert ours.projected_speedups == {"other": ours.predicted_speedup}
    table = format_table(rows)
    assert table.splitlines()[0].startswith("method") and len(table.splitlines()) == 7
    for row in rows:
        assert row.speedup_low <= row.speedup <= (row.speedup_high or float("inf"))
    assert ours.speedup_over_plain_low <= ours.speedup_over_plain_loop
    verdict = bench_verdict(rows, config)
    json_path, png_path = write_outputs(rows, tmp_path, {"model": "tiny", "device": "cpu"}, verdict)
    data = json.loads(json_path.read_text())
    assert [r["method"] for r in data["rows"]] == names and data["verdict"] == verdict
    assert png_path.read_bytes()[:4] == b"\x89PNG"


def test_a_chart_that_fails_to_draw_leaves_the_earlier_outputs_whole(tmp_path, monkeypatch):
    """Every chart is rendered before any file is written, bench.json last: a new bench.json beside the earlier run's
    charts would pass them for this run's."""
    import matplotlib.pyplot as plt
    import pytest

    from skipsearch.report import bench
    from skipsearch.report.bench import BenchRow

    rows = [BenchRow("hf greedy", 10.0, 1.0, True), BenchRow("skipsearch plain", 11.0, 1.1, True)]
    earlier = {name: f"an earlier run's {name}".encode() for name in ("bench.json", "bench.png", "extra.png")}
    for name, content in earlier.items():
        (tmp_path / name).write_bytes(content)

    def broken(*args):
        raise RuntimeError("the chart failed")

    with monkeypatch.context() as patch:
        patch.setattr(bench, "fit_labels", broken)  # bench.png's own drawing
        with pytest.raises(RuntimeError, match="the chart failed"):
            write_outputs(rows, tmp_path, {"model": "m"})
    extra, real = plt.figure(), bench.render_png
    with monkeypatch.context() as patch:  # a chart drawn beside it (bench_categories.png's) fails to render
        patch.setattr(bench, "render_png", lambda fig: broken() if fig is extra else real(fig))
        with pytest.raises(RuntimeError, match="the chart failed"):
            write_outputs(rows, tmp_path, {"model": "m"}, figures={"extra.png": extra})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == earlier  # untouched, and no temp file left
    assert not plt.fignum_exists(extra.number)  # closed all the same
    write_outputs(rows, tmp_path, {"model": "m"}, figures={"extra.png": plt.figure()})
    assert all((tmp_path / name).read_bytes() != content for name, content in earlier.items())


def test_the_table_gives_the_plain_loop_figure_its_interval_in_its_own_column():
    """As the HF greedy figure and the per-category table do: a column of its own, aligned under its header."""
    from skipsearch.report.bench import BenchRow

    rows = [BenchRow("hf greedy", 10.0, 1.0, True),
            BenchRow("skipsearch attn=[3]", 12.0, 1.2, True, 1.1, 1.3, 0.8, 2.5, speedup_over_plain_loop=1.15,
                     speedup_over_plain_low=1.05, speedup_over_plain_high=1.26),
            BenchRow("skipsearch attn=[4]", 11.0, 1.1, True, 1.0, 1.2, 0.8, 2.5, speedup_over_plain_loop=1.07,
                     speedup_over_plain_low=0.98)]  # one paired run: unbounded above
    header, *lines = format_table(rows).splitlines()
    figure = header.index("vs our plain loop (decode)")
    interval = header.index("95% interval", figure)
    assert [line[figure:interval].strip() for line in lines] == ["-", "1.15x", "1.07x"]
    assert [line[interval:].split()[0] for line in lines] == ["-", "1.05-1.26", "0.98-inf"]


def test_bench_verdict_quotes_the_paired_figure_and_the_studys_own_verdict():
    from skipsearch.report.bench import BenchRow

    base = [BenchRow("hf greedy", 10.0, 1.0, True), BenchRow("skipsearch plain", 10.5, 1.05, True)]
    slow = BenchRow("skipsearch attn=[3]", 9.0, 0.9, True, acceptance_rate=0.8, speedup_over_plain_loop=0.86,
                    speedup_over_plain_low=0.80, speedup_over_plain_high=0.93)
    text = bench_verdict(base + [slow])
    assert "not confirmed faster than plain decoding: 0.86x (95% interval 0.80-0.93)" in text
    fast = BenchRow("skipsearch attn=[3]", 12.0, 1.2, True, acceptance_rate=0.8, speedup_over_plain_loop=1.2,
                    speedup_over_plain_low=1.1, speedup_over_plain_high=1.3)
    assert bench_verdict(base + [fast]).startswith("in this run the config's skip set decodes 1.20x")
    nothing = BenchRow("skipsearch config (skips nothing)", 10.0, 1.0, True)
    config = SkipConfig(model=ModelInfo("tiny", "LlamaForCausalLM", 4, 32), skip=SkipSet(),
                        metrics=ConfigMetrics(verdict="no skip set was confirmed faster than plain decoding: 0.84x"))
    assert bench_verdict(base + [nothing], config) == (
        "the config skips nothing: it decodes plainly (its study's verdict: no skip set was confirmed faster "
        "than plain decoding: 0.84x)")
    assert bench_verdict(base) is None
    guarded = BenchRow("skipsearch attn=[3] (guarded)", 10.4, 1.04, True, acceptance_rate=0.8,
                       speedup_over_plain_loop=0.99, speedup_over_plain_low=0.95, speedup_over_plain_high=1.03,
                       guarded=True)
    slow.guarded = False
    assert bench_verdict(base + [guarded, slow]) == (
        "in this run the config's skip set is not confirmed faster than plain decoding with the run-time guard: "
        "0.99x (95% interval 0.95-1.03) (without it, as its study measures: 0.86x (95% interval 0.80-0.93))")


def test_a_config_that_drafts_yet_drafted_nothing_in_the_run_is_not_said_to_skip_nothing():
    """Only a config whose sets skip nothing decodes plainly by design. A set that drafts can draft nothing in a run:
    the guard decoded every token plainly, --max-new-tokens left no room for a round, or every prompt ended at EOS;
    the verdict says which where the run shows it."""
    from dataclasses import replace

    from skipsearch.report.bench import BenchRow

    base = [BenchRow("hf greedy", 10.0, 1.0, True), BenchRow("skipsearch plain", 10.5, 1.05, True)]
    config = SkipConfig(model=ModelInfo("tiny", "LlamaForCausalLM", 4, 32), skip=SkipSet.of([3]))
    guarded = BenchRow("skipsearch attn=[3] mlp=[] (guarded)", 10.0, 1.0, True, guarded=True)
    unguarded = BenchRow("skipsearch attn=[3] mlp=[] (unguarded, as its study measured)", 9.0, 0.9, True,
                         acceptance_rate=0.8, speedup_over_plain_loop=0.86, speedup_over_plain_low=0.80,
                         speedup_over_plain_high=0.93, guarded=False)
    assert bench_verdict(base + [guarded, unguarded], config) == (
        "in this run the config's skip set drafted nothing with the run-time guard, which decoded every token plainly "
        "(measuring plain speed, or judging drafting slower on this machine); without it, as its study measures: "
        "0.86x (95% interval 0.80-0.93)")
    idle = replace(unguarded, acceptance_rate=None)
    assert bench_verdict(base + [guarded, idle], config, max_new_tokens=2) == (
        "the config's skip set drafted nothing in this run: --max-new-tokens 2 leaves no room for a draft (the prefill "
        "gives the first token, a round needs one for a draft and one for the full model's)")
    assert bench_verdict(base + [guarded, idle], config, max_new_tokens=48) == (
        "the config's skip set drafted nothing in this run: every prompt ended (at EOS) before a round could draft")


def test_bench_verdict_of_several_sets_gives_the_end_to_end_figure_too():
    """Choosing among several sets costs a draft forward per set in each prefill, which the decode-time figure leaves
    out: a config of several sets (Gemma's per-category export: 1.18x decode time, 1.03x HF greedy end to end) is
    quoted both ways."""
    from skipsearch.report.bench import BenchRow
    from skipsearch.report.export import category_config

    info = ModelInfo("tiny", "LlamaForCausalLM", 4, 32)
    config = category_config({c: SkipConfig(info, SkipSet.of([i + 1]), metrics=ConfigMetrics(speedup=1.2, verdict="won"),
                                            search=ConfigSearch(study_name=c)) for i, c in enumerate("ab")}, "s")
    rows = [BenchRow("hf greedy", 10.0, 1.0, True), BenchRow("skipsearch plain", 10.0, 1.0, True),
            BenchRow("skipsearch 2 sets chosen per prompt (a, b)", 10.3, 1.03, True, speedup_low=0.98,
                     speedup_high=1.08, acceptance_rate=0.9, speedup_over_plain_loop=1.18, speedup_over_plain_low=1.13,
                     speedup_over_plain_high=1.24)]
    text = bench_verdict(rows, config)
    assert text.startswith("in this run the config's skip set decodes 1.18x (95% interval 1.13-1.24)")
    assert ("end to end, the prefill's choice among the sets included: 1.03x HF greedy (95% interval 0.98-1.08), "
            "our plain loop 1.00x") in text
    one = SkipConfig(info, SkipSet.of([1]))
    assert "end to end" not in bench_verdict(rows, one)


def test_a_config_is_benched_as_deployed_and_as_its_study_measured_it():
    from skipsearch.report.bench import config_decoders

    model = tiny_model()
    config = SkipConfig(model=ModelInfo.of(model, "tiny"), skip=SkipSet.of([1], [], 4), draft=DraftPolicy())
    assert [p.guard for p in config_decoders(config).values()] == [True, False]
    unguarded = SkipConfig(model=config.model, skip=config.skip, draft=DraftPolicy(guard=False))
    assert list(config_decoders(unguarded)) == ["skipsearch attn=[1] mlp=[] (unguarded)"]
    assert list(config_decoders(SkipConfig(model=config.model, skip=SkipSet()))) == [
        "skipsearch config (skips nothing)"]


def test_bench_profiles_the_steps_it_decodes_with():
    """bench's own cost profile times what bench runs: eager forwards, or with --compile on CUDA the regional steps as
    CUDA graphs (eager forwards there time the host's Python); a CPU's frozen steps are priced by eager forwards."""
    from skipsearch.api.bench import profiled_mode

    assert profiled_mode(True, torch.device("cuda", 0)) == "regional"
    assert profiled_mode(False, torch.device("cuda", 0)) is None
    assert profiled_mode(True, torch.device("cpu")) is None and profiled_mode(False, torch.device("cpu")) is None


def test_bench_passes_its_profiled_mode_to_the_profile(monkeypatch):
    """The wiring: bench's profile is taken with the mode `profiled_mode` gives for its --compile and device."""
    import types

    from skipsearch.api import bench

    model = tiny_model()
    config = SkipConfig(model=ModelInfo.of(model, "tiny"), skip=SkipSet.of([1], [], 4), draft=DraftPolicy())
    taken = []
    monkeypatch.setattr(bench, "profile_costs", lambda model, **kwargs: taken.append(kwargs["compile_mode"]))
    for device in (torch.device("cuda", 0), torch.device("cpu")):  # the model stays on the CPU: only this is read
        loaded = types.SimpleNamespace(model=model, device=device)
        for compile in (True, False):
            bench._profile(bench.BenchSettings(compile=compile), loaded, config, [[1, 2, 3]], lambda line: None)
    assert taken == ["regional", None, None, None]


def test_bench_checks_each_prompts_room_for_its_longest_draft():
    """A config drafting more than 16 tokens a round needs that room past each answer: a prompt that leaves less is
    refused before any measuring, not by the decoding loop after the other methods ran."""
    from skipsearch.api.bench import BenchSettings, draft_room

    model = ModelInfo("tiny", "LlamaForCausalLM", 4, 32)
    long_drafts = SkipConfig(model=model, skip=SkipSet.of([1], [], 4), draft=DraftPolicy(max_draft_tokens=40))
    assert draft_room(BenchSettings(), long_drafts) == 40
    assert draft_room(BenchSettings(prompt_lookup_tokens=24), None) == 24
    assert draft_room(BenchSettings(), SkipConfig(model=model, skip=SkipSet())) == 16


def test_bench_says_before_profiling_this_device_how_to_reuse_a_profile(monkeypatch):
    """Profiling took most of a small bench's minutes with nothing saying why, or that --cost-profile avoids it."""
    from types import SimpleNamespace

    from skipsearch.api import bench as api_bench
    from skipsearch.api.bench import BenchSettings

    monkeypatch.setattr(api_bench, "profile_costs", lambda model, **kwargs: "this device's profile")
    monkeypatch.setattr(api_bench, "contexts_for", lambda model, encoded, tokens: [8])
    said = []
    config = SkipConfig(ModelInfo("tiny", "LlamaForCausalLM", 4, 32), SkipSet.of([1]))
    loaded = SimpleNamespace(model=None, device=torch.device("cpu"))
    assert api_bench._profile(BenchSettings(), loaded, config, [[1]], said.append) == "this device's profile"
    assert said == ["profiling this device first, to price the config's predicted speedup (--cost-profile reuses a "
                    "profile, e.g. one that `profile` wrote)"]
    said.clear()
    assert api_bench._profile(BenchSettings(), loaded, SkipConfig(config.model, SkipSet()), [[1]], said.append) is None
    assert said == []  # plain decoding has nothing to price


def test_hf_greedy_is_plain_greedy_whatever_the_models_generation_defaults():
    """A model's generation_config may set a repetition penalty or ban repeated n-grams; generate applies them to
    options it is not given. The baseline leaves them out (its output equals our greedy loop's) and leaves the
    model's config as it was."""
    from skipsearch.decode.loop import generate
    from skipsearch.report.bench import hf_decoder

    model = tiny_model(dtype=torch.float64)
    own = model.generation_config
    own.repetition_penalty, own.no_repeat_ngram_size, own.suppress_tokens = 50.0, 1, [5, 9]
    greedy = generate(model, PROMPTS[0], max_new_tokens=12).tokens
    assert 5 in greedy or 9 in greedy or len(set(greedy)) < len(greedy)  # the defaults would change this output
    assert hf_decoder(model, 12, eos=None)(PROMPTS[0])[0] == greedy
    assert model.generation_config is own and own.repetition_penalty == 50.0
