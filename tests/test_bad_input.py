"""Every place a user types something: one clear line on stderr, exit code 2, nothing written or changed."""

import json
import re
import subprocess
import sys

import pytest

from skipsearch.cli import main


def snapshot(folder):
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture
def workspace(tmp_path, tiny_model_dir):
    """A folder with a good config and some bad inputs, and the tiny model's path."""
    from transformers import AutoModelForCausalLM

    from skipsearch.config import ModelInfo, SkipConfig, save_skip_config
    from skipsearch.skipping import SkipSet

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_skip_config(SkipConfig(model=ModelInfo.of(model, "tiny"), skip=SkipSet.of([1], [2], 4)), tmp_path / "good.json")
    good = json.loads((tmp_path / "good.json").read_text())
    (tmp_path / "malformed.json").write_text('{"format": "skipsearch/skip-config", ')
    (tmp_path / "format.json").write_text(json.dumps({**good, "format": "something-else"}))
    (tmp_path / "version.json").write_text(json.dumps({**good, "version": 7}))
    (tmp_path / "other-model.json").write_text(json.dumps({**good, "model": {**good["model"], "num_hidden_layers": 30}}))
    (tmp_path / "range.json").write_text(json.dumps({**good, "skip": {"attn": [1, 4], "mlp": []}}))
    (tmp_path / "prompts.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "studies").mkdir()
    return tmp_path, str(tiny_model_dir)


CASES = [
    # (argv with {dir} = workspace and {model} = tiny model, expected message)
    (["generate", "--model", "{dir}/no-such-model", "--prompt", "hi"], "cannot load model"),
    (["generate", "--model", "{dir}/not-a-model", "--prompt", "hi"], "has no config.json"),
    (["generate", "--prompt", "hi", "--config", "{dir}/malformed.json"], "is not valid JSON"),
    (["generate", "--prompt", "hi", "--config", "{dir}/format.json"], "not a skipsearch skip config"),
    (["generate", "--prompt", "hi", "--config", "{dir}/version.json"], "unsupported version 7"),
    (["generate", "--prompt", "hi", "--config", "{dir}/other-model.json"], "num_hidden_layers=30"),
    (["generate", "--prompt", "hi", "--config", "{dir}/range.json"], "out of range"),
    (["generate", "--prompt", "hi", "--config", "{dir}/missing.json"], "does not exist"),
    (["generate", "--prompt", "word " * 300, "--max-new-tokens", "10"], "exceed the model's context of 256"),
    (["generate", "--prompt", "hi", "--device", "cuda"], "CUDA is not available"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "number > 0"),
    (["optimize", "--dataset", "{dir}/missing.jsonl"], "does not exist"),
    (["optimize", "--dataset", "{dir}/prompts.jsonl", "--num-prompts", "1"], "has no field 'prompt'"),
    (["optimize", "--dataset", "{dir}/prompts.jsonl", "--field", "text", "--num-prompts", "5"], "asked for 5 prompts"),
    (["optimize", "--storage", "not-a-url"], "is not a URL"),
    (["optimize", "--storage", "postgresql+psycopg2://user:secret@127.0.0.1:1/db"], "cannot open storage"),
    (["optimize", "--storage", "journal:{dir}/no/such/folder/study.log"], "does not exist"),
    (["optimize", "--study-name", "my study!"], "study names are"),
    (["optimize", "--n-trials", "-2"], "integer >= 1"),
    (["optimize", "--max-skip-fraction", "1.5"], r"number in \[0, 1\]"),
    (["optimize", "--heartbeat-interval", "10", "--heartbeat-grace", "5"], "must be longer"),
    (["export", "--study-name", "never-ran"], "no study database"),
    (["bench", "--repeats", "0"], "integer >= 1"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[f"{a[0]}-{m[:24]}" for a, m in CASES])
def test_bad_input(argv, message, workspace, capsys):
    folder, model = workspace
    argv = [a.replace("{dir}", str(folder)) for a in argv]
    if "--model" not in argv:
        argv += ["--model", model]
    if argv[0] in ("optimize", "export"):
        argv += ["--studies-dir", str(folder / "studies")]
    if argv[0] == "export":
        argv.remove("--model"), argv.remove(model)
    before = snapshot(folder)
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert "secret" not in err  # passwords never echoed
    assert snapshot(folder) == before


def test_no_traceback_from_the_real_command(workspace):
    folder, model = workspace
    result = subprocess.run([sys.executable, "-m", "skipsearch", "generate", "--model", model, "--prompt", "hi",
                             "--config", str(folder / "other-model.json")], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("skipsearch generate: error:")
