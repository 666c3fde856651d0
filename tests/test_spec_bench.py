"""Spec-Bench as users bring it (a small file in its format, written here; not the real data): conversations of two
turns, categories kept, the stratified draw, the report per category, one study per category exported together, and
the refusals."""

import json
from dataclasses import replace

import pytest

from conftest import tiny_model
from skipsearch.decode.provenance import ConfigMetrics, ConfigSearch
from skipsearch.api.optimize import category_study_name
from skipsearch.api.prompts import encode_rows
from skipsearch.cli import main
from skipsearch.decode.config import ModelInfo, SkipConfig, load_skip_config, save_skip_config
from skipsearch.decode.loop import generate
from skipsearch.decode.skipset import DraftHead, SkipSet
from skipsearch.io.data import MT_BENCH, PromptRow, categories_of, draw, draw_per_category, load_rows
from skipsearch.io.models import LoadedModel, encode_conversation
from skipsearch.report.export import category_config

# Spec-Bench's categories: MT-bench's subcategories (two turns), then its five tasks of one turn.
CATEGORIES = ["writing", "coding", "translation", "summarization", "qa", "math_reasoning", "rag"]


def spec_bench_file(folder, per_category=2, rag_words=0):
    """question.jsonl in Spec-Bench's format; `rag_words` makes the rag prompts that long."""
    rows, qid = [], 80
    for category in CATEGORIES:
        for i in range(per_category):
            qid += 1
            if category in ("writing", "coding"):
                turns = [f"Write about {category} {i}.", f"Now shorten it ({i})."]
            elif category == "rag":
                turns = [" ".join(["context"] * rag_words) + f" Question {i}?"]
            else:
                turns = [f"{category} question {i}?"]
            rows.append({"question_id": qid, "category": category, "turns": turns})
    path = folder / "question.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_turns_and_categories_are_read_as_they_are(tmp_path):
    rows = load_rows(str(spec_bench_file(tmp_path)), field="turns", num_prompts=None)
    assert len(rows) == 14 and {len(r.turns) for r in rows if r.category == MT_BENCH} == {2}
    # MT-bench's subcategories are one category, reported first as Spec-Bench does.
    assert categories_of(rows) == [MT_BENCH, "translation", "summarization", "qa", "math_reasoning", "rag"]
    assert all(r.where.startswith("line ") for r in rows)
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text('{"turns": ["a"], "task": "x"}\n{"turns": ["b", "c"], "task": "y"}\n')
    assert [r.category for r in load_rows(str(renamed), "turns", num_prompts=None, category_field="task")] == \
        ["x", "y"]
    assert [r.category for r in load_rows(str(renamed), "turns", num_prompts=None)] == [None, None]


@pytest.mark.parametrize("categories, read", [
    (["math", "writing"], ["math", "writing"]),  # MT-bench's names, but none of Spec-Bench's own tasks
    (["math", "qa", "poetry"], ["math", "qa", "poetry"]),  # a category Spec-Bench does not have
    (["math", "qa"], [MT_BENCH, "qa"]),
])
def test_only_spec_bench_rows_have_mt_benchs_subcategories_read_as_one(tmp_path, categories, read):
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "category": c}) + "\n" for i, c in enumerate(categories)))
    rows = sorted(load_rows(str(path), num_prompts=None), key=lambda row: row.turns)
    assert [row.category for row in rows] == read


def test_the_draw_is_stratified_and_seeded():
    rows = [PromptRow((f"{c}{i}",), c) for c in "abc" for i in range(5)]
    six = draw(rows, 6, seed=1)
    assert sorted(r.category for r in six) == ["a", "a", "b", "b", "c", "c"]
    assert six == draw(rows, 6, seed=1) and six != draw(rows, 6, seed=2)
    assert draw(rows, 9, seed=1)[:6] == six  # a larger draw holds a smaller one
    assert [r.category for r in draw(rows, 3, seed=0)] == ["a", "b", "c"]  # in turn: a short trial measures each
    with pytest.raises(ValueError, match="--num-prompts 2 cannot represent the dataset's 3 categories"):
        draw(rows, 2, seed=0)
    per = draw_per_category(rows, 2, seed=1)
    assert list(per) == ["a", "b", "c"] and all(len(group) == 2 for group in per.values())
    with pytest.raises(ValueError, match="category 'a' has 5 prompts, fewer than --num-prompts 6"):
        draw_per_category(rows, 6, seed=1)
    with pytest.raises(ValueError, match="have no category"):
        draw_per_category([PromptRow(("x",))], 1, seed=0)


@pytest.mark.parametrize("line, message", [
    ('{"turns": [], "category": "qa"}', r"line 2: 'turns' is an empty list"),
    ('{"turns": ["a", ""], "category": "qa"}', r"line 2: 'turns': turn 2 is empty"),
    ('{"turns": ["a", 3], "category": "qa"}', r"line 2: 'turns': turn 2 is a number \(3\), not text"),
    ('{"turns": {"a": 1}, "category": "qa"}', r"line 2: 'turns' is a dict .*not text or a list of turns"),
    # A category field named is refused in a row without text in it, saying what the row has instead.
    ('{"turns": ["a"]}', r"line 2: no 'category' field \(a category is read from each row"),
    ('{"turns": ["a"], "category": null}', r"line 2: a null 'category' field \("),
    ('{"turns": ["a"], "category": " "}', r"line 2: an empty 'category' field \("),
    ('{"turns": ["a"], "category": 7}', r"line 2: a number \(7\) in its 'category' field \("),
])
def test_bad_rows_are_refused_naming_the_row(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"turns": ["fine"], "category": "qa"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_rows(str(path), field="turns", num_prompts=None, category_field="category")


@pytest.mark.parametrize("line, why", [
    ('{"turns": ["a"]}', "line 2 has no 'category' field"),
    ('{"turns": ["a"], "category": null}', "line 2 has a null 'category' field"),
    ('{"turns": ["a"], "category": 7}', "line 2 has a number (7) in its 'category' field"),
])
def test_a_category_field_read_unnamed_is_left_out_where_a_row_has_none(tmp_path, line, why):
    """No flag asked for categories: a row without one draws the dataset unstratified, with a note, not refused."""
    path = tmp_path / "some.jsonl"
    path.write_text('{"turns": ["fine"], "category": "qa"}\n' + line + "\n")
    notes = []
    rows = load_rows(str(path), field="turns", num_prompts=None, note=notes.append)
    assert [row.category for row in rows] == [None, None] and len(notes) == 1
    assert why in notes[0] and "drawn without categories" in notes[0] and "\n" not in notes[0]


def test_more_categories_than_prompts_draws_unstratified_unless_the_field_is_named(tmp_path):
    path = tmp_path / "eight.jsonl"  # as databricks-dolly-15k: 8 categories, more than the default 4 prompts
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "category": f"c{i % 8}"}) + "\n" for i in range(16)))
    notes = []
    rows = load_rows(str(path), num_prompts=4, note=notes.append)
    assert len(rows) == 4 and {row.category for row in rows} == {None}
    assert len(notes) == 1 and "its 8 categories are more than the 4 prompts asked for" in notes[0]
    assert {row.category for row in load_rows(str(path), num_prompts=8, note=notes.append)} == {f"c{i}" for i in
                                                                                                 range(8)}
    assert len(notes) == 1  # enough prompts: stratified, no note
    with pytest.raises(ValueError, match="cannot represent the dataset's 8 categories .*--category-field none"):
        load_rows(str(path), num_prompts=4, category_field="category")
    # --category-field none: no categories, and nothing to note
    assert {row.category for row in load_rows(str(path), num_prompts=None, category_field="none",
                                              note=notes.append)} == {None}
    assert len(notes) == 1


def test_a_conversation_goes_through_the_chat_template_or_joins_as_text(default_model):
    tokenizer = default_model.tokenizer
    ids = encode_conversation(tokenizer, ["Hi", "And then?"], ["Hello!"])
    text = tokenizer.decode(ids)
    assert text.index("Hi") < text.index("Hello!") < text.index("And then?")
    assert text.count("<|im_start|>assistant") == 2  # the answer's turn, and the one to come
    raw = encode_conversation(tokenizer, ["Hi", "And then?"], ["Hello!"], raw=True)
    assert tokenizer.decode(raw) == "Hi\n\nHello!\n\nAnd then?"
    with pytest.raises(ValueError, match="2 turns need 1 answers"):
        encode_conversation(tokenizer, ["Hi", "And then?"])


def test_the_second_turn_is_asked_after_the_models_own_answer(default_model):
    model = tiny_model(vocab_size=len(default_model.tokenizer))
    loaded = LoadedModel(model, default_model.tokenizer, "tiny")
    rows = [PromptRow(("Tell me a story.", "Shorter, please."), MT_BENCH, "line 1"), PromptRow(("Hi",), "qa")]
    encoded = encode_rows(loaded, rows, raw=False, max_new_tokens=6, max_draft_tokens=4)
    first = encode_conversation(loaded.tokenizer, ["Tell me a story."], [])
    answer = loaded.tokenizer.decode(generate(model, first, max_new_tokens=6).tokens, skip_special_tokens=True)
    assert encoded.ids[0] == encode_conversation(loaded.tokenizer, rows[0].turns, [answer.strip()])
    assert encoded.categories == [MT_BENCH, "qa"] and encoded.kept == [0, 1]


def test_a_prompt_too_long_for_the_context_is_refused_or_skipped_before_any_decoding(default_model, monkeypatch):
    model = tiny_model(vocab_size=len(default_model.tokenizer))  # a context of 256 tokens
    loaded = LoadedModel(model, default_model.tokenizer, "tiny")
    rows = [PromptRow(("short",), "qa", "line 1"), PromptRow((" ".join(["word"] * 300),), "rag", "line 2")]
    monkeypatch.setattr("skipsearch.api.prompts.generate", lambda *a, **k: pytest.fail("decoded before the checks"))
    with pytest.raises(ValueError, match=r"line 2 \(rag\): prompt \(\d+ tokens\).*exceed the model's context of 256 "
                                         r"tokens.*--too-long skip"):
        encode_rows(loaded, [*rows, PromptRow(("a", "b"), MT_BENCH)], False, 8, 4)
    said = []
    encoded = encode_rows(loaded, rows, False, 8, 4, too_long="skip", say=said.append)
    assert encoded.kept == [0] and encoded.categories == ["qa"]
    assert len(said) == 1 and said[0].startswith("skipped line 2 (rag): prompt (")
    with pytest.raises(ValueError, match="every prompt is too long"):
        encode_rows(loaded, rows[1:], False, 8, 4, too_long="skip", say=said.append)


def test_bench_reports_per_category(capsys, tmp_path, tiny_model_dir):
    path = spec_bench_file(tmp_path, rag_words=400)
    common = ["bench", "--model", tiny_model_dir, "--dataset", path, "--field", "turns", "--max-new-tokens", 3,
              "--repeats", 2, "--prompt-lookup-tokens", 0, "--no-progress", "--output-dir", tmp_path / "out"]
    code, _, err = run(capsys, *common, "--num-prompts", 12)
    assert code == 2 and "(rag): prompt (" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    code, out, _ = run(capsys, *common, "--num-prompts", 12, "--too-long", "skip")
    assert code == 0
    assert out.count("skipped line ") == 2 and "per category:" in out
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    entries = data["categories"]
    assert [e["category"] for e in entries] == [MT_BENCH, "translation", "summarization", "qa", "math_reasoning"]
    assert all(e["num_prompts"] == 2 for e in entries) and data["settings"]["num_prompts"] == 10
    assert data["settings"]["compile"] is False  # which steps were timed: eager here, without --compile
    assert [r["method"] for r in entries[0]["rows"]] == ["hf greedy", "skipsearch plain"]
    plain = entries[0]["rows"][1]
    assert plain["speedup_low"] <= plain["speedup"] <= (plain["speedup_high"] or float("inf"))
    table = out[out.index("per category:"):].splitlines()
    assert table[1].split()[:3] == ["category", "prompts", "method"]
    assert [line.split()[0] for line in table[2:8]] == [MT_BENCH, "translation", "summarization", "qa",
                                                       "math_reasoning", "overall"]
    assert (tmp_path / "out" / "bench_categories.png").stat().st_size > 0


def test_bench_json_says_how_its_prompts_were_drawn_and_a_failed_chart_writes_nothing(tmp_path, tiny_model_dir,
                                                                                     monkeypatch):
    import skipsearch.api.bench as api
    from skipsearch.report.bench import run_caption

    path = spec_bench_file(tmp_path, rag_words=400)
    titles, real_figure, real_measure = [], api.category_figure, api.measure_methods
    monkeypatch.setattr(api, "category_figure",
                        lambda groups, title: titles.append(title) or real_figure(groups, title))
    # Compiling a step takes about 100 s on a CPU: the runs are eager here, and the settings say compiled.
    monkeypatch.setattr(api, "measure_methods", lambda *a, **k: real_measure(*a, **{**k, "compile": False}))
    settings = api.BenchSettings(model=str(tiny_model_dir), dataset=str(path), field="turns", num_prompts=12, seed=3,
                                 max_new_tokens=3, repeats=1, prompt_lookup_tokens=0, no_progress=True,
                                 output_dir=tmp_path / "out", too_long="skip", compile=True)
    result = api.benchmark(settings, say=lambda line: None)
    saved = json.loads(result.json_path.read_text())
    written = saved["settings"]
    # The category chart's title is bench.png's: one repeat said so, and which steps were timed.
    assert titles == [f"Speedup per category: {run_caption(written)}"]
    assert titles[0].endswith(", 10 prompts x 3 new tokens x 1 repeat, skipsearch compiled")
    assert {key: written[key] for key in ("seed", "field", "split", "num_prompts_drawn", "raw", "category_field",
                                          "too_long", "num_prompts")} == \
        {"seed": 3, "field": "turns", "split": "train", "num_prompts_drawn": 12, "raw": False, "category_field": None,
         "too_long": "skip", "num_prompts": 10}
    assert [s["category"] for s in written["skipped_too_long"]] == ["rag", "rag"]
    # The draw made again from bench.json alone, less the prompts it says were skipped: the prompts decoded.
    drawn = load_rows(written["dataset"], written["field"], written["split"], written["num_prompts_drawn"],
                      written["seed"], written["category_field"])
    decoded = [r for r in drawn if {"where": r.where, "category": r.category} not in written["skipped_too_long"]]
    assert len(decoded) == 10 and categories_of(decoded) == [e["category"] for e in saved["categories"]]
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert set(before) == {"bench.json", "bench.png", "bench_categories.png"}

    def broken(groups, title):
        raise RuntimeError("the chart failed")

    monkeypatch.setattr(api, "category_figure", broken)
    with pytest.raises(RuntimeError, match="the chart failed"):
        api.benchmark(replace(settings, seed=4), say=lambda line: None)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before  # the earlier run's, whole


def _known_runs():
    """Runs of 4 prompts (categories a, b, a, b) x 3 repeats, 10 tokens each: HF greedy at 1 s a run, skipsearch's
    plain loop about as fast, and a skip set about 2x faster on a's prompts and 1x on b's, drafting well on a's
    (8 of 10 accepted) and badly on b's (2 of 10), its output differing from HF greedy's on prompt 1 (b's)."""
    from collections import Counter

    from skipsearch.decode.stats import DecodeStats
    from skipsearch.report.bench import Measured, Runs

    categories, jitter = ["a", "b", "a", "b"], [1.0, 1.1, 0.93, 1.04, 0.97, 1.08, 0.9, 1.02, 1.06, 0.95, 1.01, 0.92]
    set_speed = {"a": 2.0, "b": 1.0}
    hf = Runs([1.0] * 12, [10] * 12, [0.0] * 12, [[1], [2], [3], [4]], DecodeStats(), [None] * 4)

    def ours(speed, prefill, accepted, outputs):
        stats = [DecodeStats(drafted=10, accepted=accepted(c), verify_sizes=Counter({3: 5})) if accepted else None
                 for c in categories]
        total = DecodeStats()
        for one in stats:
            if one is not None:
                total.add(one)
        return Runs([jitter[k] / speed(categories[k % 4]) for k in range(12)], [10] * 12, [prefill] * 12, outputs,
                    total, stats)

    runs = {"hf greedy": hf, "skipsearch plain": ours(lambda c: 1.0, 0.1, None, hf.outputs),
            "skipsearch attn=[1]": ours(set_speed.get, 0.1, lambda c: 8 if c == "a" else 2, [[1], [9], [3], [4]])}
    return Measured([[5, 1], [5, 2], [5, 3], [5, 4]], runs, {"skipsearch attn=[1]": False}), categories


def test_a_categorys_runs_are_its_prompts_alone_in_every_repeat():
    measured, _ = _known_runs()
    run = measured.runs["skipsearch attn=[1]"]
    part = run.subset([1, 3], 4)
    # (repeat, prompt) order, as every method's runs: the i-th runs of two methods stay a pair.
    assert part.seconds == [run.seconds[k] for k in (1, 3, 5, 7, 9, 11)] and part.tokens == [10] * 6
    assert part.outputs == [[9], [4]] and part.prompt_stats == [run.prompt_stats[1], run.prompt_stats[3]]
    assert (part.stats.drafted, part.stats.accepted) == (20, 4)  # b's prompts' stats alone, summed
    subset = measured.subset([0, 2])
    assert subset.prompts == [[5, 1], [5, 3]] and subset.guarded == measured.guarded
    assert subset.runs["hf greedy"].outputs == [[1], [3]]
    assert subset.runs["skipsearch plain"].seconds == [measured.runs["skipsearch plain"].seconds[k]
                                                      for k in (0, 2, 4, 6, 8, 10)]


def test_each_categorys_figures_come_from_its_prompts_alone():
    from skipsearch.report.categories import category_rows, format_category_table
    from skipsearch.search.measure import ratio_interval

    measured, categories = _known_runs()
    groups = category_rows(None, measured, categories, ["b", "a", "c"])  # c has no prompt: no entry
    assert [(g.category, g.num_prompts) for g in groups] == [("b", 2), ("a", 2)]
    ours = measured.runs["skipsearch attn=[1]"]
    plain = measured.runs["skipsearch plain"]
    for group, speed, acceptance in ((groups[0], 1.0, 0.2), (groups[1], 2.0, 0.8)):
        picks = [k for k in range(12) if categories[k % 4] == group.category]
        row = next(r for r in group.rows if r.method == "skipsearch attn=[1]")
        over_hf = ratio_interval([1.0 / ours.seconds[k] for k in picks])  # 10 tokens each side; HF at 1 s
        assert (row.speedup, row.speedup_low, row.speedup_high) == pytest.approx(
            (over_hf.estimate, over_hf.low, over_hf.high))
        assert row.speedup == pytest.approx(speed, rel=0.05)  # the category's own ratio, not the overall ~1.4x
        over_plain = ratio_interval([(plain.seconds[k] - 0.1) / (ours.seconds[k] - 0.1) for k in picks])
        assert (row.speedup_over_plain_loop, row.speedup_over_plain_low, row.speedup_over_plain_high) == \
            pytest.approx((over_plain.estimate, over_plain.low, over_plain.high))
        assert row.acceptance_rate == pytest.approx(acceptance) and row.divergence_gaps is None
        assert row.tokens_per_second == pytest.approx(60 / sum(ours.seconds[k] for k in picks))
    b_row, a_row = (next(r for r in g.rows if r.method == "skipsearch attn=[1]") for g in groups)
    assert (a_row.identical, a_row.identical_share) == (True, 1.0)  # prompt 1, b's, differs
    assert (b_row.identical, b_row.identical_share) == (False, 0.5)
    assert b_row.speedup_high < a_row.speedup_low  # the intervals are each category's: they do not even overlap
    lines = {line.split()[0]: line.split() for line in format_category_table(groups).splitlines()
             if "attn=[1]" in line}
    # category, prompts, the method's two words, tok/s, then the speedup over HF greedy
    assert lines["a"][5] == f"{a_row.speedup:.2f}x" and lines["b"][5] == f"{b_row.speedup:.2f}x"


def test_bench_measures_a_config_of_several_sets(capsys, tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    info = ModelInfo.of(model, "tiny")
    config = category_config({"qa": SkipConfig(info, SkipSet.of([1])), "rag": SkipConfig(info, SkipSet.of([], [2]))},
                             "s")
    save_skip_config(config, tmp_path / "c.json")
    code, out, _ = run(capsys, "bench", "--model", tiny_model_dir, "--config", tmp_path / "c.json", "--num-prompts", 1,
                       "--max-new-tokens", 3, "--repeats", 1, "--prompt-lookup-tokens", 0, "--no-progress",
                       "--output-dir", tmp_path / "out")
    assert code == 0 and "skipsearch 2 sets chosen per prompt (qa, rag) (guarded)" in out


def test_the_categories_winners_are_exported_together():
    info = ModelInfo("tiny", "LlamaForCausalLM", 4, 32)

    def won(attn, verdict):
        return SkipConfig(info, SkipSet.of(attn), metrics=ConfigMetrics(speedup=1.2, verdict=verdict),
                          search=ConfigSearch(study_name=f"s-{verdict}"))

    plain = SkipConfig(info, SkipSet(), metrics=ConfigMetrics(speedup=1.0, verdict="lost"),
                       search=ConfigSearch(study_name="s-c"))
    config = category_config({"a": won([1], "a won"), "b": won([2], "b won"), "c": plain, "d": won([1], "d won")},
                             "s")
    assert [(e.label, e.skip) for e in config.entries] == [("a, d", SkipSet.of([1])), ("b", SkipSet.of([2]))]
    assert config.entries[0].metrics.verdict == "a: a won; d: d won"
    assert config.search.category_studies == {"a": "s-a won", "b": "s-b won", "c": "s-c", "d": "s-d won"}
    assert config.search.created_at is not None  # when the combined config was made, not a category's export
    assert config.to_json()["version"] == 2
    one = category_config({"a": won([1], "a won"), "c": plain}, "s")
    assert one.to_json()["version"] == 2 and one.label == "a"  # a labelled set, even alone
    nothing = category_config({"c": plain}, "s")
    assert not nothing.skip.size and nothing.to_json()["version"] == 1 and "c: lost" in nothing.metrics.verdict


def test_the_combined_config_counts_every_categorys_prompts():
    info = ModelInfo("tiny", "LlamaForCausalLM", 4, 32)

    def config(attn, prompts):
        return SkipConfig(info, SkipSet.of(attn), metrics=ConfigMetrics(speedup=1.2, verdict="won"),
                          search=ConfigSearch(study_name="s", num_prompts=prompts))

    assert category_config({"a": config([1], 4), "b": config([2], 3), "c": config([], 2)}, "s").search.num_prompts == 9
    assert category_config({"a": config([1], 4), "b": config([2], None)}, "s").search.num_prompts is None


def test_the_combined_config_names_every_categorys_study_prompts():
    """bench leaves out every prompt a category's study saw: the combined config names them all, once each."""
    info = ModelInfo("tiny", "LlamaForCausalLM", 4, 32)

    def config(attn, seen):
        return SkipConfig(info, SkipSet.of(attn), metrics=ConfigMetrics(speedup=1.2, verdict="won"),
                          search=ConfigSearch(study_name="s", seen_prompts=seen))

    combined = category_config({"a": config([1], ["d2", "d1"]), "b": config([2], ["d1", "d3"]), "c": config([], None)},
                               "s")
    assert combined.search.seen_prompts == ["d1", "d2", "d3"]
    assert category_config({"a": config([1], None)}, "s").search.seen_prompts is None


def test_plain_decoding_exported_for_every_category_rests_on_their_confirmations():
    """As a study's plain export does where its confirmation found no set faster (`confirmed` true)."""
    info = ModelInfo("tiny", "LlamaForCausalLM", 4, 32)

    def plain(confirmed):
        return SkipConfig(info, SkipSet(), metrics=ConfigMetrics(speedup=1.0, confirmed=confirmed, verdict="lost"),
                          search=ConfigSearch(study_name="s"))

    assert category_config({"a": plain(True), "b": plain(True)}, "s").metrics.confirmed is True
    assert category_config({"a": plain(True), "b": plain(False)}, "s").metrics.confirmed is False
    assert category_config({"a": plain(True), "b": plain(None)}, "s").metrics.confirmed is False


def test_the_line_of_the_combined_export_names_the_categories_that_confirmed_a_set():
    from skipsearch.report.export import categories_confirmed

    info = ModelInfo("tiny", "LlamaForCausalLM", 4, 32)
    won, plain = SkipConfig(info, SkipSet.of([1])), SkipConfig(info, SkipSet())
    assert categories_confirmed({"a": won, "b": plain, "c": won}) == "a skip set confirmed for a and c; none for b"
    assert categories_confirmed({"a": won, "b": won, "c": won, "d": plain}) == \
        "a skip set confirmed for a, b and c; none for d"
    assert categories_confirmed({"a": won}) == "a skip set confirmed for a"
    assert categories_confirmed({"a": plain, "b": plain}) == "a skip set confirmed for no category"


def test_a_categorys_trimmed_head_alone_is_exported():
    """A category whose study confirmed a draft that skips nothing but reads a trimmed head (what Gemma 3 270M's
    studies export) won: it is not taken for plain decoding."""
    info = ModelInfo("tiny", "LlamaForCausalLM", 4, 32, vocab_size=8)
    head = SkipSet(head=DraftHead((0, 1, 2)))
    won = SkipConfig(info, head, metrics=ConfigMetrics(speedup=1.2, verdict="a won"),
                     search=ConfigSearch(study_name="s-a"))
    plain = SkipConfig(info, SkipSet(), metrics=ConfigMetrics(speedup=1.0, verdict="lost"),
                       search=ConfigSearch(study_name="s-c"))
    config = category_config({"a": won, "c": plain}, "s")
    assert [(e.label, e.skip) for e in config.entries] == [("a", head)]


def test_optimize_runs_one_study_per_category(capsys, tmp_path, tiny_model_dir):
    path = tmp_path / "two.jsonl"
    path.write_text("\n".join(json.dumps({"turns": turns, "category": c}) for c, turns in [
        ("writing", ["Write a poem.", "Shorter."]), ("qa", ["Why is the sky blue?"]),
        ("writing", ["Write a song.", "Longer."]), ("qa", ["What is rain?"])]) + "\n")
    code, out, err = run(capsys, "optimize", "--model", tiny_model_dir, "--dataset", path, "--field", "turns",
                         "--per-category", "--num-prompts", 1, "--n-trials", 2, "--max-new-tokens", 4,
                         "--confirm-top", 1, "--no-plots", "--no-progress", "--no-warm-starts", "--min-match", 0,
                         "--studies-dir", tmp_path / "studies", "--study-name", "sb")
    assert code == 0, err
    assert "category mt_bench: study sb-mt_bench on 1 prompt\n" in out and "category qa: study sb-qa" in out
    assert {p.name for p in (tmp_path / "studies").iterdir()} >= {"sb-mt_bench.db", "sb-qa.db", "sb"}
    config = load_skip_config(tmp_path / "studies" / "sb" / "best.json")
    assert config.search.categories == [MT_BENCH, "qa"]
    from skipsearch.report.export import categories_confirmed, exported_text

    # Which category confirmed a set depends on timing: the line must say what the files hold.
    studied = {c: load_skip_config(tmp_path / "studies" / f"sb-{c}" / "best.json") for c in config.search.categories}
    assert f"exported {tmp_path / 'studies' / 'sb' / 'best.json'}: {exported_text(config)}; " \
           f"{categories_confirmed(studied)}\n" in out
    assert category_study_name("sb", "math reasoning/x") == "sb-math-reasoning-x"
    _a_stop_keeps_the_categories_an_earlier_run_studied(capsys, tmp_path, tiny_model_dir, path, studied)
    for command in ("export", "plot"):  # the name given to optimize names no study of its own: say which are
        code, _, err = run(capsys, command, "--study-name", "sb", "--studies-dir", tmp_path / "studies")
        assert code == 2 and "one study per category, sb-mt_bench, sb-qa: give one of them to --study-name" in err


def _a_stop_keeps_the_categories_an_earlier_run_studied(capsys, tmp_path, model, path, studied):
    """A re-run stopped during its first category: best.json still holds what qa's study of the first run decided."""
    import skipsearch.api.optimize as api

    real = api._optimize

    def stopped_at_once(*args):
        result = real(*args)
        result.stopped_by, result.outcome = "SIGINT", "after its trials"
        return result

    api._optimize = stopped_at_once
    try:
        code, out, err = run(capsys, "optimize", "--model", model, "--dataset", path, "--field",
                             "turns", "--per-category", "--num-prompts", 1, "--n-trials", 3, "--max-new-tokens", 4,
                             "--confirm-top", 1, "--no-plots", "--no-progress", "--no-warm-starts", "--min-match", 0,
                             "--studies-dir", tmp_path / "studies", "--study-name", "sb")
    finally:
        api._optimize = real
    config = load_skip_config(tmp_path / "studies" / "sb" / "best.json")
    assert config.search.categories == [MT_BENCH, "qa"] and "category qa:" not in out, out
    assert f"(the categories studied before the stop: {MT_BENCH}; as an earlier run left them: qa)" in out, out
    assert load_skip_config(tmp_path / "studies" / "sb-qa" / "best.json") == studied["qa"]


@pytest.mark.parametrize("extra, message", [
    (["--per-category", "--num-prompts", "3"], "category 'translation' has 2 prompts, fewer than --num-prompts 3"),
    (["--num-prompts", "5", "--category-field", "category"],
     "--num-prompts 5 cannot represent the dataset's 6 categories"),
    (["--per-category", "--category-field", "none"], "--per-category needs the rows' categories"),
    (["--category-field", "task"], "has no field 'task'"),
    (["--field", "question_id"], r"'question_id' is a number"),
])
def test_optimize_refuses_in_one_line_and_writes_nothing(capsys, tmp_path, tiny_model_dir, extra, message):
    path = spec_bench_file(tmp_path)
    studies = tmp_path / "studies"
    code, out, err = run(capsys, "optimize", "--model", tiny_model_dir, "--dataset", path, "--field", "turns",
                         "--studies-dir", studies, *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err.replace("\\", ""), err
    assert not studies.exists()


def test_the_split_script_keeps_held_out_prompts_out_of_calibration(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parent.parent
    script, env = root / "benchmarks" / "spec_bench_split.py", {**os.environ, "PYTHONPATH": str(root)}  # this tree's
    path = spec_bench_file(tmp_path, per_category=3)
    result = subprocess.run([sys.executable, str(script), str(path), "--calibration", "2", "--held-out", "1",
                             "--output-dir", str(tmp_path / "split")], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    calibration = load_rows(str(tmp_path / "split" / "calibration.jsonl"), "turns", num_prompts=None)
    held_out = load_rows(str(tmp_path / "split" / "held_out.jsonl"), "turns", num_prompts=None)
    assert len(calibration) == 12 and len(held_out) == 6  # mt_bench's two subcategories are one category
    assert not {r.turns for r in calibration} & {r.turns for r in held_out}
    assert categories_of(held_out) == categories_of(calibration) == categories_of(load_rows(str(path), "turns", None))
    short = subprocess.run([sys.executable, str(script), str(path), "--calibration", "3", "--held-out", "1",
                            "--output-dir", str(tmp_path / "no")], capture_output=True, text=True, env=env)
    assert short.returncode == 2 and "category 'translation' has 3 prompts" in short.stderr
    assert not (tmp_path / "no").exists()


def test_per_category_refuses_a_row_without_a_category_naming_it(capsys, tmp_path, tiny_model_dir):
    """A study per category needs every row's category: one read without the flag is required, as if named."""
    path = spec_bench_file(tmp_path)
    path.write_text(path.read_text() + json.dumps({"category": None, "turns": ["no category"]}) + "\n")
    code, _, err = run(capsys, "optimize", "--model", tiny_model_dir, "--dataset", path, "--field", "turns",
                       "--studies-dir", tmp_path / "studies", "--per-category", "--num-prompts", 1)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "line 15: a null 'category' field" in err, err
    assert not (tmp_path / "studies").exists()
