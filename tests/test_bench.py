import json

import torch

from conftest import tiny_model
from skipsearch.bench import bench_verdict, format_table, run_bench, write_outputs
from skipsearch.config import ModelInfo, SkipConfig
from skipsearch.costs import profile_costs
from skipsearch.decoding import DraftPolicy
from skipsearch.skipping import SkipSet

PROMPTS = [[5, 9, 14, 3, 5, 9], [7, 2, 30, 31, 8]]


def test_bench_rows_json_and_chart(tmp_path):
    model = tiny_model(dtype=torch.float64)
    config = SkipConfig(model=ModelInfo.of(model, "tiny"), skip=SkipSet.of([1], [2], 4),
                        draft=DraftPolicy(max_draft_tokens=3, adaptive=False))
    profile = profile_costs(model, contexts=(8,), max_verify_tokens=4, repeats=2, calibrate=False)
    rows = run_bench(model, PROMPTS, max_new_tokens=8, eos=None, config=config, early_exit_layer=2,
                     prompt_lookup_tokens=3, repeats=2, profile=profile, show_progress=False)
    names = [r.method for r in rows]
    assert names == ["hf greedy", "hf prompt lookup (3)", "hf early exit (layer 2)", "skipsearch plain",
                     "skipsearch attn=[1] mlp=[2]"]
    assert all(r.identical for r in rows), format_table(rows)
    assert rows[0].speedup == 1.0 and all(r.tokens_per_second > 0 for r in rows)
    ours = rows[-1]
    assert ours.acceptance_rate is not None and ours.predicted_speedup > 0 and ours.speedup_over_plain_loop > 0
    assert rows[3].acceptance_rate is None and rows[3].predicted_speedup is None
    table = format_table(rows)
    assert table.splitlines()[0].startswith("method") and len(table.splitlines()) == 6
    json_path, png_path = write_outputs(rows, tmp_path, {"model": "tiny", "device": "cpu"})
    data = json.loads(json_path.read_text())
    assert [r["method"] for r in data["rows"]] == names and data["verdict"] == bench_verdict(rows)
    assert png_path.read_bytes()[:4] == b"\x89PNG"


def test_bench_verdict_says_when_the_config_does_not_pay():
    from skipsearch.bench import BenchRow

    base = [BenchRow("hf greedy", 10.0, 1.0, True), BenchRow("skipsearch plain", 10.5, 1.05, True)]
    slow = BenchRow("skipsearch attn=[3]", 9.0, 0.9, True, acceptance_rate=0.8)
    assert bench_verdict(base + [slow]) == "no skip set beats plain decoding on this model and device: best 0.90x"
    fast = BenchRow("skipsearch attn=[3]", 12.0, 1.2, True, acceptance_rate=0.8)
    assert bench_verdict(base + [fast]) is None
    nothing = BenchRow("skipsearch config (skips nothing)", 10.0, 1.0, True)
    assert "decodes plainly" in bench_verdict(base + [nothing])
