"""On the embedded default model (SmolLM2-135M-Instruct): lossless greedy decoding."""

import pytest
import torch

from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet
from skipsearch.io.models import encode_prompt

PROMPTS = ["Explain what a hash map is.", "Write a Python function that reverses a string."]
SKIPS = [SkipSet.of([0], [29], 30), SkipSet.of([4, 9, 14, 19], [2, 25], 30), SkipSet.of(range(0, 30, 2), [], 30)]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_generate_on_the_default_model(default_model, prompt):
    model, tokenizer = default_model.model, default_model.tokenizer
    ids = encode_prompt(tokenizer, prompt)
    eos = model.generation_config.eos_token_id
    reference = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=40, eos_token_id=eos)
    reference = reference[0, len(ids):].tolist()
    for skip, policy in zip(SKIPS, [DraftPolicy(), DraftPolicy(max_draft_tokens=4, adaptive=False), DraftPolicy()]):
        out = generate(model, ids, skip=skip, max_new_tokens=40, policy=policy, eos_token_id=eos)
        assert out.tokens == reference, f"skip {skip} changed the output"
        assert out.stats.drafted > 0


def test_compiled_greedy_equals_generate_on_held_out_prompts(default_model):
    """fp32, compiled draft and verify steps (aot_eager in CI; inductor is timed in benchmarks/engine_speed.py)."""
    from torch._dynamo.utils import counters

    model, tokenizer = default_model.model, default_model.tokenizer
    eos = model.generation_config.eos_token_id
    skip, policy = SKIPS[1], DraftPolicy(max_draft_tokens=4, adaptive=False)
    graphs = None
    for prompt in ["Name three prime numbers.", "What is the capital of France? Answer in one sentence."]:
        ids = encode_prompt(tokenizer, prompt)
        reference = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24, eos_token_id=eos)
        out = generate(model, ids, skip=skip, max_new_tokens=24, policy=policy, eos_token_id=eos,
                       compile=True, compile_backend="aot_eager")
        assert out.tokens == reference[0, len(ids):].tolist()
        if graphs is not None:  # warm: a prompt of another length makes no new graph
            assert counters["stats"]["unique_graphs"] == graphs and out.stats.compile_time_s == 0.0
        graphs = counters["stats"]["unique_graphs"]


def test_default_model_loads_from_the_converted_cache(default_model):
    assert type(default_model.model).__name__ == "LlamaForCausalLM"
    assert default_model.model.config.num_hidden_layers == 30
    assert default_model.tokenizer.chat_template


def test_a_gguf_path_is_converted_once_and_loads(tmp_path, monkeypatch):
    from skipsearch.io.conversion import default_gguf_path
    from skipsearch.io.models import load_model

    monkeypatch.setenv("SKIPSEARCH_CACHE", str(tmp_path))
    (tmp_path / "not.gguf").write_bytes(b"NOPE" + bytes(16))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(tmp_path / "not.gguf"))
    loaded = load_model(str(default_gguf_path()))
    assert loaded.model.config.num_hidden_layers == 30
    assert len(list((tmp_path / "models").iterdir())) == 1


def test_a_damaged_cached_default_model_is_converted_again(tmp_path, monkeypatch, capsys):
    """A cached tokenizer and weights cut short (a full disk, a copy interrupted) are noticed and rebuilt from the
    GGUF; the rebuilt files get the mode any file gets under the umask (safetensors writes 0600)."""
    import os
    import stat

    from skipsearch.io.conversion import cache_dir, converted_default_model
    from skipsearch.io.models import load_model

    cached = converted_default_model()
    monkeypatch.setenv("SKIPSEARCH_CACHE", str(tmp_path))
    damaged = cache_dir() / "models" / cached.name
    damaged.mkdir(parents=True)
    for path in cached.iterdir():
        if path.suffix != ".safetensors":
            (damaged / path.name).write_bytes(path.read_bytes())
    tokenizer = (cached / "tokenizer.json").read_bytes()
    (damaged / "tokenizer.json").write_bytes(tokenizer[:100_000])
    (damaged / "model.safetensors").write_bytes((cached / "model.safetensors").open("rb").read(1_000_000))
    previous = os.umask(0o022)
    try:
        loaded = load_model(device="cpu")
    finally:
        os.umask(previous)
    assert "is damaged" in capsys.readouterr().err
    assert loaded.tokenizer("hello")["input_ids"]
    assert (damaged / "tokenizer.json").read_bytes() == tokenizer
    assert (damaged / "model.safetensors").stat().st_size == (cached / "model.safetensors").stat().st_size
    assert [p.name for p in (tmp_path / "models").iterdir()] == [cached.name]  # nothing left beside it
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in damaged.iterdir()} == \
        {p.name: 0o644 for p in damaged.iterdir()}
    assert stat.S_IMODE(damaged.stat().st_mode) == 0o755
