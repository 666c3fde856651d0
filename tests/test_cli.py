import json
import re

import pytest

from skipsearch.cli import main


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_matches_autoregressive(capsys, tiny_model_dir):
    # float64: a random model over a 49k vocabulary has fp32 near-ties that batched verification may flip.
    common = ["generate", "--model", tiny_model_dir, "--prompt", "hello there", "--max-new-tokens", 12, "--json",
              "--dtype", "float64"]
    code, out, _ = run(capsys, *common, "--skip-attn", "1,2", "--skip-mlp", "0", "--fixed-draft")
    assert code == 0
    drafted = json.loads(out)
    code, out, _ = run(capsys, *common, "--autoregressive")
    plain = json.loads(out)
    assert drafted["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) >= 1
    assert drafted["skip"] == {"attn": [1, 2], "mlp": [0]} and drafted["stats"]["drafted"] > 0
    assert plain["stats"]["drafted"] == 0 and isinstance(plain["text"], str)


def test_generate_reads_a_config(capsys, tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from skipsearch.config import ModelInfo, SkipConfig, save_skip_config
    from skipsearch.skipping import SkipSet

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_skip_config(SkipConfig(model=ModelInfo.of(model, str(tiny_model_dir)), skip=SkipSet.of([3], [1], 4)),
                     tmp_path / "best.json")
    code, out, _ = run(capsys, "generate", "--model", tiny_model_dir, "--prompt", "hi", "--max-new-tokens", 5,
                       "--config", tmp_path / "best.json", "--json")
    assert code == 0 and json.loads(out)["skip"] == {"attn": [3], "mlp": [1]}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--skip-attn", "1,9"], "out of range"),
        (["--skip-attn", "a,b"], "comma-separated layer ids"),
        (["--max-new-tokens", "0"], "integer >= 1"),
        (["--top-p", "1.5"], r"number in \[0, 1\]"),
        (["--config", "/nonexistent/best.json"], "does not exist"),
        (["--config", "x.json", "--skip-mlp", "1"], "either --config or --skip-attn"),
    ],
)
def test_generate_bad_input_is_one_line_and_exit_2(capsys, tiny_model_dir, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        code = main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", *argv])
        raise SystemExit(code)
    _, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and re.search(message, err)
