"""The README's inference example runs as written."""

import re
from pathlib import Path

from skipsearch.decode.config import ModelInfo, SkipConfig, save_skip_config
from skipsearch.decode.provenance import ConfigMetrics, ConfigSearch
from skipsearch.decode.skipset import SkipSet


def run_readme_block(marker, tmp_path, monkeypatch, default_model):
    """Run the README's python block containing `marker` as written, with a best.json that skips attention 20."""
    readme = Path(__file__).parent.parent / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    example = next(b for b in blocks if marker in b)
    config = SkipConfig(model=ModelInfo.of(default_model.model, "smollm2-135m-instruct"), skip=SkipSet.of([20], [], 30),
                        metrics=ConfigMetrics(verdict="it pays"), search=ConfigSearch(study_name="default"))
    save_skip_config(config, tmp_path / "studies" / "default" / "best.json")
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {})


def test_readme_inference_example_runs(tmp_path, monkeypatch, default_model, capsys):
    run_readme_block("load_skip_config", tmp_path, monkeypatch, default_model)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) >= 3 and out[0] == "it pays default" and "tok/s, acceptance" in out[-1] and out[1]


def test_readme_custom_generate_example_runs(tmp_path, monkeypatch, default_model, capsys):
    run_readme_block("custom_generate=", tmp_path, monkeypatch, default_model)
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(r"\d+ tokens, acceptance (0\.\d\d|1\.00)", out.splitlines()[-1])  # attention 20 drafts
    assert len(out.splitlines()[0]) > 10  # the streamer printed the text
