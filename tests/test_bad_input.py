"""Every place a user types something: one clear line on stderr, exit code 2, nothing written or changed."""

import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy
import optuna
import pytest
import torch

from skipsearch import LoadedModel, SkipSet, load_model
from skipsearch.cli import main
from skipsearch.io.errors import RESOURCE_EXIT
from skipsearch.search.study import StudySettings


def snapshot(folder):
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def hf_snapshot():
    """The Hugging Face caches (HF_HOME, datasets' cache): a rejected input must leave them as they were."""
    import datasets
    from huggingface_hub import constants

    folders = {Path(constants.HF_HOME), Path(datasets.config.HF_DATASETS_CACHE)}
    return {f: snapshot(f) if f.is_dir() else None for f in folders}


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory, default_model):
    """A tiny GPT-2 (not of the Llama family) with a tokenizer, saved as a folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("tiny-gpt2")
    config = GPT2Config(vocab_size=len(default_model.tokenizer), n_embd=16, n_layer=2, n_head=2, n_positions=256)
    GPT2LMHeadModel(config).save_pretrained(folder)
    default_model.tokenizer.save_pretrained(folder)
    return folder


DEEP = "[" * 10_000 + "]" * 10_000  # past Python's recursion limit: json's decoder raises RecursionError


def damage_a_page(database, page=5, page_size=4096):
    with open(database, "r+b") as handle:
        handle.seek(page * page_size)
        handle.write(b"\xff" * page_size)


@pytest.fixture(scope="session")
def damaged(tmp_path_factory, tiny_model_dir):
    """Model files cut short or hostile, too big to write for every case: a model folder whose weights are cut
    short, one whose config.json nests too deeply, a GGUF file cut short."""
    from skipsearch.io.conversion import default_gguf_path

    folder = tmp_path_factory.mktemp("damaged")
    shutil.copytree(tiny_model_dir, folder / "cut-weights")
    weights = folder / "cut-weights" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shutil.copytree(tiny_model_dir, folder / "deep-config")
    (folder / "deep-config" / "config.json").write_text(DEEP)
    with default_gguf_path().open("rb") as gguf:
        (folder / "cut.gguf").write_bytes(gguf.read(2_000_000))
    return folder


@pytest.fixture
def workspace(tmp_path, tiny_model_dir):
    """A folder with a good config and some bad inputs, and the tiny model's path."""
    from transformers import AutoModelForCausalLM

    from skipsearch.decode.config import ModelInfo, SkipConfig, SkipEntry, save_skip_config
    from skipsearch.decode.policy import DraftPolicy
    from skipsearch.decode.skipset import SkipSet

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_skip_config(SkipConfig(model=ModelInfo.of(model, "tiny"), skip=SkipSet.of([1], [2], 4)), tmp_path / "good.json")
    good = json.loads((tmp_path / "good.json").read_text())
    save_skip_config(SkipConfig.of_entries(ModelInfo.of(model, "tiny"), [SkipEntry(SkipSet.of([1]), "qa"),
                                                                        SkipEntry(SkipSet.of([], [2]), "rag")],
                                           DraftPolicy()), tmp_path / "several.json")
    (tmp_path / "malformed.json").write_text('{"format": "skipsearch/skip-config", ')
    (tmp_path / "format.json").write_text(json.dumps({**good, "format": "something-else"}))
    (tmp_path / "version.json").write_text(json.dumps({**good, "version": 7}))
    (tmp_path / "other-model.json").write_text(json.dumps({**good, "model": {**good["model"], "num_hidden_layers": 30}}))
    (tmp_path / "range.json").write_text(json.dumps({**good, "skip": {"attn": [1, 4], "mlp": []}}))
    (tmp_path / "prompts.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "studies").mkdir()
    (tmp_path / "figures" / "bench.png").mkdir(parents=True)  # bench's own files, where they cannot be written
    (tmp_path / "old-studies" / "bench" / "bench_categories.png").mkdir(parents=True)
    (tmp_path / "draft-list.json").write_text(json.dumps({**good, "draft": [8, 0.6]}))
    (tmp_path / "draft-null.json").write_text(json.dumps({**good, "draft": {**good["draft"], "max_draft_tokens": None}}))
    (tmp_path / "a-folder.jsonl").mkdir()
    (tmp_path / "bad-line.jsonl").write_text('{"prompt": "one"}\n{"prompt": "two",\n{"prompt": "three"}\n')
    (tmp_path / "no-weights").mkdir()
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "no-weights" / "config.json")
    (tmp_path / "broken-config").mkdir()
    (tmp_path / "broken-config" / "config.json").write_text('{"model_type": "llama",')
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / "broken-config" / name)
    with sqlite3.connect(tmp_path / "other.db") as db:  # someone else's database
        db.execute("CREATE TABLE invoices (id INTEGER)")
    plain = optuna.create_study(study_name="plain", storage=f"sqlite:///{tmp_path / 'plain.db'}")
    plain.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)  # a study made by plain Optuna
    # Damaged or hostile files
    for name in ("deep.json", "deep.jsonl"):
        (tmp_path / name).write_text(DEEP + "\n")
    (tmp_path / "number-prompt.jsonl").write_text('{"prompt": "one"}\n{"prompt": 2}\n')
    from skipsearch.decode.cost_profile import SHIPPED_PROFILES

    profile = json.loads((SHIPPED_PROFILES / "nvidia-h200/smollm2-135m.json").read_text())
    (tmp_path / "repeated-contexts.json").write_text(json.dumps({**profile, "contexts": profile["contexts"] * 2}))
    (tmp_path / "nan-cost.json").write_text(json.dumps({**profile, "contexts": [
        {**profile["contexts"][0], "mlp_s": float("nan")}]}))
    shutil.copy(tmp_path / "plain.db", tmp_path / "damaged.db")
    damage_a_page(tmp_path / "damaged.db")
    from optuna.storages.journal import JournalFileBackend

    journal = optuna.storages.JournalStorage(JournalFileBackend(str(tmp_path / "garbage.log")))
    optuna.create_study(study_name="j", storage=journal).optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    lines = (tmp_path / "garbage.log").read_text().splitlines(keepends=True)
    (tmp_path / "garbage.log").write_text("".join([lines[0], "garbage {{{\n", *lines[2:]]))
    return tmp_path, str(tiny_model_dir)


CASES = [
    # (argv with {dir} = workspace and {model} = tiny model, expected message)
    (["generate", "--model", "{model}", "--prompt", "hi", "--autoregressive", "--skip-attn", "1"],
     "--autoregressive decodes plainly"),
    (["generate", "--model", "{model}", "--prompt", "  "], "--prompt is empty"),
    (["generate", "--model", "{dir}/no-such-model", "--prompt", "hi"], "cannot load model"),
    (["generate", "--model", "{dir}/not-a-model", "--prompt", "hi"], "has no config.json"),
    (["generate", "--model", "{dir}/prompts.jsonl", "--prompt", "hi"], "is a file, not a model folder or a .gguf file"),
    (["generate", "--prompt", "hi", "--config", "{dir}/malformed.json"], "malformed.json.: not valid JSON"),
    # a broken config is refused before the model loads (this one would fail to)
    (["generate", "--model", "{dir}/no-such-model", "--prompt", "hi", "--config", "{dir}/malformed.json"],
     "malformed.json.: not valid JSON"),
    (["generate", "--prompt", "hi", "--config", "{dir}/format.json"], "not a skipsearch skip config"),
    (["generate", "--prompt", "hi", "--config", "{dir}/version.json"], "unsupported version 7"),
    (["generate", "--prompt", "hi", "--config", "{dir}/other-model.json"], "num_hidden_layers=30"),
    (["generate", "--prompt", "hi", "--config", "{dir}/range.json"], "out of range"),
    (["generate", "--prompt", "hi", "--config", "{dir}/missing.json"], "does not exist"),
    (["generate", "--prompt", "word " * 300, "--max-new-tokens", "10"], "exceed the model's context of 256"),
    (["generate", "--prompt", "hi", "--device", "cuda"], "CUDA is not available"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], r"finite number >= 0.0001"),
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
    (["bench", "--dataset", "{dir}/prompts.jsonl", "--dataset", "builtin"], "--dataset: given twice; this command reads one"),
    (["bench", "--dataset", "builtin", "--dataset", "{dir}/prompts.jsonl"], "--dataset: given twice; this command reads one"),
    # 1. output paths: a folder where a file goes, a file where a folder goes (checked before any work)
    (["export", "--output", "{dir}/studies"], "is a folder: name a file"),
    (["export", "--output", "{dir}/prompts.jsonl/best.json"], "is a file, not a folder"),
    (["plot", "--output", "{dir}/prompts.jsonl"], "is a file: name a folder"),
    (["profile", "--output", "{dir}/studies"], "is a folder: name a file"),
    (["profile", "--output", "{dir}/good.json/profile.json"], "is a file, not a folder"),
    (["bench", "--output-dir", "{dir}/prompts.jsonl"], "is a file: name a folder"),
    # each file bench writes, before the model loads (this one would fail to): not bench.json first, then a refusal
    (["bench", "--model", "{dir}/no-such-model", "--output-dir", "{dir}/figures"],
     r"--output-dir .*figures/bench.png. is a folder: name a file$"),
    (["bench", "--studies-dir", "{dir}/old-studies"], r"--studies-dir .*bench/bench_categories.png. is a folder"),
    # the folder as given, not the one made in it (prompts.jsonl/bench), named where it is a file
    (["bench", "--studies-dir", "{dir}/prompts.jsonl"], r"--studies-dir .*prompts.jsonl. is a file: name a folder$"),
    (["profile", "--studies-dir", "{dir}/prompts.jsonl"], r"--studies-dir .*prompts.jsonl. is a file: name a folder$"),
    (["optimize", "--studies-dir", "{dir}/prompts.jsonl"], r"--studies-dir .*prompts.jsonl. is a file: name a folder$"),
    (["export", "--studies-dir", "{dir}/prompts.jsonl"], r"--studies-dir .*prompts.jsonl. is a file: name a folder$"),
    (["plot", "--studies-dir", "{dir}/prompts.jsonl"], r"--studies-dir .*prompts.jsonl. is a file: name a folder$"),
    # 2. rejected input writes nothing: no database, no Optuna tables added to someone else's
    (["optimize", "--seed", "-1"], r"--seed: expected an integer in \[0, 4294967295\]"),
    (["optimize", "--sampler", "cmaes", "--objective", "pareto"], "cmaes sampler handles one objective"),
    (["optimize", "--model", "{gpt2}"], r"gpt2 \(GPT2LMHeadModel\) is not a supported decoder: its decoder keeps no "),
    (["export", "--study-name", "nope", "--storage", "sqlite:///{dir}/new.db"], "no study database at"),
    (["plot", "--study-name", "nope", "--storage", "journal:{dir}/new.log"], "no such file"),
    (["export", "--storage", "sqlite:///{dir}/other.db"], "holds tables that are not Optuna's \\(invoices\\)"),
    (["optimize", "--storage", "sqlite:///{dir}/other.db"], "holds tables that are not Optuna's"),
    (["optimize", "--storage", "sqlite:///{dir}/studies"], "names a folder"),
    # 3. studies made by plain Optuna
    (["export", "--study-name", "plain", "--storage", "sqlite:///{dir}/plain.db"], "was not made by skipsearch"),
    (["plot", "--study-name", "plain", "--storage", "sqlite:///{dir}/plain.db"], "was not made by skipsearch"),
    (["optimize", "--study-name", "plain", "--storage", "sqlite:///{dir}/plain.db"], "was not made by skipsearch"),
    # 4. models and devices
    (["generate", "--prompt", "hi", "--model", "{dir}/no-weights"], "has a config.json but no weights"),
    (["generate", "--prompt", "hi", "--model", "{dir}/broken-config"], "config.json.: not valid JSON"),
    (["generate", "--prompt", "hi", "--device", "meta"], "cannot decode"),
    (["generate", "--prompt", "hi", "--device", "mps"], "MPS"),
    (["generate", "--prompt", "hi", "--device", "cuda:1"], "CUDA is not available"),
    # 5. malformed values, each naming its field or flag
    (["generate", "--prompt", "hi", "--config", "{dir}/draft-list.json"], r"'draft' has the wrong type \(list\)"),
    (["generate", "--prompt", "hi", "--config", "{dir}/draft-null.json"], "draft.'max_draft_tokens'"),
    (["generate", "--prompt", "hi", "--seed", "1e23"], "argument --seed"),
    (["generate", "--prompt", "hi", "--do-sample", "--seed", "100000000000000000000000"], "argument --seed"),
    (["generate", "--prompt", "caf\udce9"], "argument --prompt: not valid UTF-8"),
    (["generate", "--prompt", "hi", "--temperature", "inf"], "finite number >= 0.0001"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "finite number >= 0.0001"),
    (["optimize", "--timeout", "inf"], "finite number > 0"),
    (["optimize", "--dataset", "{dir}/a-folder.jsonl"], "is a folder"),
    (["optimize", "--dataset", "{dir}/bad-line.jsonl"], "line 2: not valid JSON"),
    (["bench", "--dataset", "{dir}/bad-line.jsonl"], "line 2: not valid JSON"),
    (["bench", "--config", "{dir}/draft-list.json"], "'draft' has the wrong type"),
    # 6. damaged or hostile files: JSON nested past the recursion limit wherever JSON is read, files cut short
    (["generate", "--prompt", "hi", "--config", "{dir}/deep.json"], "skip config .*deep.json.: nested too deeply"),
    (["optimize", "--warm-start", "{dir}/deep.json"], "warm-start file .*deep.json.: nested too deeply"),
    (["optimize", "--dataset", "{dir}/deep.jsonl"], "dataset .*deep.jsonl., line 1: nested too deeply"),
    (["optimize", "--dataset", "{dir}/deep.json"], "dataset .*deep.json.: nested too deeply"),  # a document
    (["optimize", "--objective", "modeled", "--cost-profile", "{dir}/deep.json"], "cost profile .*: nested too deeply"),
    (["bench", "--cost-profile", "{dir}/deep.json"], "cost profile .*deep.json.: nested too deeply"),
    # a cost profile whose figures are not costs: refused as it loads, naming the file and the field
    (["bench", "--cost-profile", "{dir}/repeated-contexts.json"],
     r"repeated-contexts.json: contexts: context_tokens 128, 512, 2048, 8182 appear more than once"),
    (["optimize", "--objective", "modeled", "--cost-profile", "{dir}/nan-cost.json"],
     r"nan-cost.json: context 128: mlp_s is nan, not a finite cost at least 0$"),
    (["profile", "--config-only", "--model", "{dir}/deep.json"], "model config .*deep.json.: nested too deeply"),
    (["generate", "--prompt", "hi", "--model", "{bad}/deep-config"], "config.json.: nested too deeply.*: download"),
    (["generate", "--prompt", "hi", "--model", "{bad}/cut-weights"], "model.safetensors. is damaged or cut short"),
    (["generate", "--prompt", "hi", "--model", "{bad}/cut.gguf"], "GGUF file .*cut.gguf is damaged or cut short"),
    (["optimize", "--dataset", "{dir}/number-prompt.jsonl", "--num-prompts", "1"],
     r"line 2: 'prompt' is a number \(2\), not text"),
    (["export", "--study-name", "plain", "--storage", "sqlite:///{dir}/damaged.db"], r"is damaged \(SQLite: .*backup"),
    (["optimize", "--study-name", "plain", "--storage", "sqlite:///{dir}/damaged.db"], r"is damaged \(SQLite"),
    (["plot", "--study-name", "j", "--storage", "journal:{dir}/garbage.log"], "garbage.log., line 2: not valid JSON"),
    (["optimize", "--study-name", "j", "--storage", "journal:{dir}/garbage.log"], "line 2: not valid JSON.*backup"),
    # 7. settings under which the figures mean nothing: no draft can be measured, or sampling overflows
    (["optimize", "--max-new-tokens", "1"],
     r"--max-new-tokens 1 leaves no room for a draft.* needs --max-new-tokens >= 3"),
    (["optimize", "--max-new-tokens", "2"], r"--max-new-tokens 2 leaves no room for a draft.*>= 3"),
    (["optimize", "--max-draft-tokens", "0"], r"--max-draft-tokens 0 drafts nothing.*--max-draft-tokens >= 1"),
    # bench: a config that drafts measures no draft without room for a round, refused before the model loads
    (["bench", "--model", "{dir}/no-such-model", "--config", "{dir}/good.json", "--max-new-tokens", "2"],
     r"--max-new-tokens 2 leaves no room for a draft.*benching a config that drafts needs --max-new-tokens >= 3$"),
    # bench: a projection prices one skip set, not a config of several (chosen per prompt at decoding)
    (["bench", "--model", "{dir}/no-such-model", "--config", "{dir}/several.json", "--project-with", "{dir}/good.json"],
     r"--project-with prices one skip set, and .*several.json holds 2, chosen per prompt .*without --project-with$"),
    (["generate", "--prompt", "hi", "--do-sample", "--temperature", "1e-45"],
     r"argument --temperature: expected a finite number >= 0.0001 \(lower samples as greedy decoding does"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[f"{a[0]}-{m[:24]}" for a, m in CASES])
def test_bad_input(argv, message, workspace, gpt2_dir, damaged, capsys, monkeypatch):
    folder, model = workspace
    monkeypatch.chdir(folder)  # a default path (studies/...) would land here and be seen
    argv = [a.replace("{dir}", str(folder)).replace("{gpt2}", str(gpt2_dir)).replace("{bad}", str(damaged))
            for a in argv]
    if "--model" not in argv and argv[0] not in ("export", "plot"):
        argv += ["--model", model]
    if argv[0] in ("optimize", "export", "plot") and "--studies-dir" not in argv:
        argv += ["--studies-dir", str(folder / "studies")]
    before, hf_before, damaged_before = snapshot(folder), hf_snapshot(), snapshot(damaged)
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert len(err.strip().splitlines()) == 1, err
    # argparse's errors and the tool's own start alike: the command's prog, then "error:".
    assert err.startswith(f"python -m skipsearch {argv[0]}: error: "), err
    assert "Traceback" not in err
    assert re.search(message, err), err
    assert "secret" not in err  # passwords never echoed
    assert snapshot(folder) == before
    assert hf_snapshot() == hf_before
    assert snapshot(damaged) == damaged_before


ENV_CASES = [
    # (environment, argv, expected message): the cache of converted models, the Hub while offline
    ({"SKIPSEARCH_CACHE": "{dir}/prompts.jsonl/cache"}, ["generate", "--prompt", "hi", "--model",
                                                         "smollm2-135m-instruct"], "cannot cache the converted model"),
    ({"HF_HUB_OFFLINE": True}, ["generate", "--prompt", "hi", "--model", "someone/no-such-model"], "HF_HUB_OFFLINE"),
    ({"HF_HUB_OFFLINE": True}, ["optimize", "--dataset", "someone/no-such-dataset"], "HF_HUB_OFFLINE"),
    ({"access": False}, ["export", "--output", "{dir}/ro/best.json"], "is not writable"),
    ({"access": False}, ["bench", "--output-dir", "{dir}/ro"], "is not writable"),
    ({"free": 0}, ["plot", "--output", "{dir}/full"], "out of disk space: no space left"),  # exit 3: a resource
    ({"free": 0}, ["optimize"], "out of disk space: no space left"),
    # a study database that cannot be written, on resume; a journal file likewise
    ({"read_only": "{dir}/plain.db"}, ["optimize", "--study-name", "plain", "--storage", "sqlite:///{dir}/plain.db"],
     r"plain.db. is read-only, and `optimize` adds trials to it: make it writable"),
    ({"read_only": "{dir}/garbage.log"}, ["optimize", "--study-name", "j", "--storage", "journal:{dir}/garbage.log"],
     "garbage.log. is read-only"),
    # a machine too busy to profile: every timing a random delay
    ({"noisy_clock": True}, ["profile", "--config-only", "--contexts", "8", "--repeats", "5", "--no-progress"],
     r"this machine is too noisy to profile: after 4 rounds of 5 timed runs, .*--cost-profile"),
]


@pytest.mark.parametrize("env, argv, message", ENV_CASES, ids=[m[:24] for _, _, m in ENV_CASES])
def test_bad_environment(env, argv, message, workspace, capsys, monkeypatch):
    """A cache folder that cannot be written, the Hub offline, a read-only or full file system."""
    import os

    from huggingface_hub import constants

    folder, model = workspace
    monkeypatch.chdir(folder)
    argv = [a.replace("{dir}", str(folder)) for a in argv]
    if argv[0] != "generate" and argv[0] not in ("export", "plot"):
        argv += ["--model", model]
    if argv[0] in ("optimize", "export", "plot"):
        argv += ["--studies-dir", str(folder / "studies")]
    if "SKIPSEARCH_CACHE" in env:
        monkeypatch.setenv("SKIPSEARCH_CACHE", env["SKIPSEARCH_CACHE"].replace("{dir}", str(folder)))
    if "HF_HUB_OFFLINE" in env:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    if "access" in env:  # what a read-only mount or a folder of another user answers (root ignores chmod)
        monkeypatch.setattr(os, "access", lambda *a, **k: False)
    if "noisy_clock" in env:
        import itertools
        import random
        import types

        delays = random.Random(0)
        readings = itertools.accumulate(delays.expovariate(1e3) for _ in itertools.count())
        monkeypatch.setattr("skipsearch.costs.profiler.time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    if "read_only" in env:  # one file of another user, or chmod a-w (which root, running the tests, ignores)
        real_access, target = os.access, Path(env["read_only"].replace("{dir}", str(folder)))
        monkeypatch.setattr(os, "access", lambda path, mode, **k: not (Path(path) == target and mode & os.W_OK)
                            and real_access(path, mode, **k))
    if "free" in env:
        real = os.statvfs
        monkeypatch.setattr(os, "statvfs", lambda p: type("S", (), {"f_flag": real(p).f_flag, "f_bavail": 0,
                                                                     "f_frsize": 4096})())
    before, hf_before = snapshot(folder), hf_snapshot()
    assert main(argv) == (RESOURCE_EXIT if "free" in env else 2)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert err.startswith(f"python -m skipsearch {argv[0]}: error: "), err
    assert snapshot(folder) == before
    assert hf_snapshot() == hf_before


def test_no_traceback_from_the_real_command(workspace):
    folder, model = workspace
    result = subprocess.run([sys.executable, "-m", "skipsearch", "generate", "--model", model, "--prompt", "hi",
                             "--config", str(folder / "other-model.json")], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("python -m skipsearch generate: error:")
    # An error argparse finds reads the same way.
    result = subprocess.run([sys.executable, "-m", "skipsearch", "generate", "--prompt", "hi", "--top-p", "2"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("python -m skipsearch generate: error: argument --top-p:")


def _generate(sampling_options=None, **kwargs):
    """A call of `generate` on a model; `sampling_options` build the Sampling inside the call (its checks count)."""
    from skipsearch.decode.loop import generate
    from skipsearch.decode.sampling import Sampling

    def call(model):
        sampling = {"sampling": Sampling(**sampling_options)} if sampling_options else {}
        return generate(model, **{"input_ids": [5, 9, 14], **sampling, **kwargs})

    return call


def _custom_generate(**options):
    from skipsearch import self_speculative

    return lambda model: model.generate(torch.tensor([[5, 9, 14]]), max_new_tokens=4, pad_token_id=0,
                                        custom_generate=self_speculative(SkipSet.of([1], [2], 4)), **options)


def _with_model(wrap, call):
    return lambda model: call(wrap(model))


def _skip_config(model):
    from skipsearch.decode.config import ModelInfo, SkipConfig

    return SkipConfig(model=ModelInfo.of(model, "tiny"), skip=SkipSet.of([1], [2], 4))


API_CASES = [
    # (what, call(model), exception, message): each refused before any forward, in one line
    ("two prompts, listed", _generate(input_ids=[[5, 9], [14, 3]]), ValueError, "one prompt at a time, got a batch of 2"),
    ("two prompts, a tensor", _generate(input_ids=torch.tensor([[5, 9], [14, 3]])), ValueError, "a batch of 2"),
    ("float ids", _generate(input_ids=[5.0, 9.7]), TypeError, r"token ids must be integers, got 5.0 \(float\)"),
    ("a float tensor", _generate(input_ids=torch.tensor([5.0, 9.0])), TypeError, "got a tensor of float32"),
    ("bool ids", _generate(input_ids=[True, 5]), TypeError, "token ids must be integers, got True"),
    ("text", _generate(input_ids="hello"), TypeError, "got str: tokenize it first"),
    ("an id past the vocabulary", _generate(input_ids=[5, 96]), ValueError, r"token id 96 is outside .* \(0..95\)"),
    ("a negative id", _generate(input_ids=torch.tensor([[5, -1]])), ValueError, "token id -1 is outside"),
    ("a 3-D tensor", _generate(input_ids=torch.zeros(1, 1, 3, dtype=torch.long)), ValueError, r"got shape \(1, 1, 3\)"),
    ("no tokens", _generate(input_ids=[]), ValueError, "the prompt is empty"),
    ("max_new_tokens past the context", _generate(max_new_tokens=10**12), ValueError,
     r"max_new_tokens \(1000000000000\) exceed the model's context of 256"),
    ("max_new_tokens a float", _generate(max_new_tokens=8.0), ValueError, "max_new_tokens must be an integer"),
    ("skip a list", _generate(skip=[1, 2]), TypeError, r"skip must be a SkipSet \(SkipSet.of"),
    ("skip a skip config", lambda m: _generate(skip=_skip_config(m))(m), TypeError, "pass skip=config.skip"),
    ("skip past the layers", _generate(skip=SkipSet.of([7])), ValueError,
     r"attn skip id 7 is out of range: layer ids are 0..3"),
    ("policy a dict", _generate(policy={"max_draft_tokens": 4}), TypeError, "policy must be a DraftPolicy, got dict"),
    ("sampling a bool", _generate(sampling=True), TypeError, "sampling must be a Sampling, got bool"),
    ("model, loaded", lambda m: _generate()(LoadedModel(m, None, "tiny")), TypeError,
     r"got LoadedModel: pass its .model"),
    ("model, a name", lambda m: _generate()("HuggingFaceTB/SmolLM2-135M"), TypeError,
     "model must be a transformers causal LM, got str"),
    ("a config checked against a loaded model", lambda m: _skip_config(m).check_model(LoadedModel(m, None, "tiny")),
     TypeError, "pass its .model"),
    ("load_model given a number", lambda m: load_model(3), TypeError,
     r"load_model takes a model name or path \(str or pathlib.Path\), got int"),
    ("custom_generate with dola_layers", _custom_generate(dola_layers="high"), ValueError,
     r"not by dola generation \(dola_layers='high'\)"),
    ("custom_generate with penalty_alpha", _custom_generate(penalty_alpha=0.6, top_k=4), ValueError,
     r"not by contrastive search \(penalty_alpha=0.6\)"),
    ("a temperature that overflows", _generate(sampling_options=dict(do_sample=True, temperature=1e-45)), ValueError,
     r"temperature must be a finite number >= 0.0001, got 1e-45: lower samples as greedy decoding does"),
    # transformers hands a callable no synced_gpus (it is a parameter of `_sample`'s too): read from generate's frame
    ("custom_generate with synced_gpus", _custom_generate(synced_gpus=True), ValueError,
     "self_speculative does not support synced_gpus"),
    ("custom_generate with a temperature that overflows", _custom_generate(do_sample=True, temperature=1e-45),
     ValueError, r"samples with temperature >= 0.0001, got 1e-45"),
    ("a study of 2 new tokens", lambda m: StudySettings(study_name="s", storage="sqlite:///unused.db",
                                                        max_new_tokens=2),
     ValueError, r"max_new_tokens 2 leaves no room for a draft .*max_new_tokens >= 3"),
]


@pytest.fixture(scope="module")
def api_model():
    from conftest import tiny_model

    return tiny_model("llama", num_layers=4)  # vocabulary 0..95, context 256


@pytest.mark.parametrize("call, error, message", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_the_python_api_refuses_before_any_work(call, error, message, api_model):
    forwards = []
    hook = api_model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(error, match=message) as raised:
            call(api_model)
    finally:
        hook.remove()
    assert len(str(raised.value).splitlines()) == 1
    assert not forwards


@pytest.mark.parametrize("prompt", [[5, 9, 14], (5, 9, 14), [[5, 9, 14]], torch.tensor([5, 9, 14]),
                                    torch.tensor([[5, 9, 14]], dtype=torch.int32), [torch.tensor(5), 9, 14],
                                    numpy.array([5, 9, 14])],
                         ids=["list", "tuple", "one row", "tensor", "int32 row", "0-d tensors", "numpy"])
def test_every_form_of_one_prompt_decodes_alike(prompt, api_model):
    from skipsearch.decode.loop import generate

    assert generate(api_model, prompt, max_new_tokens=4).tokens == generate(api_model, [5, 9, 14],
                                                                             max_new_tokens=4).tokens


def test_load_model_takes_a_path(tiny_model_dir):
    assert load_model(Path(tiny_model_dir)).name_or_path == str(tiny_model_dir)


def test_a_study_refuses_settings_that_measure_no_draft_before_any_work(api_model, tmp_path):
    """No draft, no figure: `run_study` refuses a policy that drafts nothing before it opens the storage."""
    from skipsearch.decode.config import ModelInfo
    from skipsearch.decode.policy import DraftPolicy
    from skipsearch.search.space import SearchSpace
    from skipsearch.search.study import run_study

    settings = StudySettings(study_name="s", storage=f"sqlite:///{tmp_path}/s.db", show_progress_bar=False)
    forwards = []
    hook = api_model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(ValueError, match="max_draft_tokens 0 drafts nothing, and a study measures drafting"):
            run_study(api_model, ModelInfo.of(api_model, "tiny"), "float32", [[5, 9, 14]], settings,
                      SearchSpace(num_layers=4), DraftPolicy(max_draft_tokens=0), None)
    finally:
        hook.remove()
    assert not forwards and not list(tmp_path.iterdir())


def _raw_prompt_of(tokens, tokenizer):
    """A raw prompt text that encodes to exactly `tokens` tokens."""
    from skipsearch.io.models import encode_prompt

    text = " ".join(["word"] * tokens)
    while len(encode_prompt(tokenizer, text, raw=True)) > tokens:
        text = text[: text.rindex(" ")]
    assert len(encode_prompt(tokenizer, text, raw=True)) == tokens
    return text


def test_a_prompt_and_answer_that_fill_the_context_decode_drafting_or_not(tiny_model_dir, default_model, capsys):
    """A prompt plus --max-new-tokens that fill the context exactly decode, plainly and drafting (the rounds draft
    fewer near the context's end, so drafts need no room of their own), to the same text; one token more is refused
    in one line."""
    prompt = _raw_prompt_of(200, default_model.tokenizer)
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", prompt, "--raw", "--max-new-tokens", "56"]
    assert main([*argv, "--autoregressive"]) == 0
    plain = capsys.readouterr()
    assert "plain decoding" in plain.err
    assert main([*argv, "--skip-attn", "1"]) == 0
    assert capsys.readouterr().out == plain.out
    argv[-1] = "57"
    assert main([*argv, "--skip-attn", "1"]) == 2
    assert "--max-new-tokens (57) exceed the model's context of 256" in capsys.readouterr().err


def _positions_fed(model):
    """The largest position the model's rotary embedding is asked for, per forward (a list filled as it decodes)."""
    fed = []

    def record(module, args, kwargs):
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        fed.append(int(positions.max()))

    return fed, model.model.rotary_emb.register_forward_pre_hook(record, with_kwargs=True)


@pytest.mark.parametrize("skip", [None, SkipSet.of([1], [2], 4)], ids=["plain", "drafting"])
def test_decoding_at_the_edge_of_the_context_feeds_no_position_past_it(skip, api_model):
    """The cache has spare slots past prompt + max_new_tokens (a round's verify width, a batch of plain steps), but
    no token is fed at a position the model does not have: plain decoding stops its steps at max_new_tokens, and a
    drafting round near the context's end drafts fewer (`loop._within_bounds`)."""
    from skipsearch.decode.loop import generate
    from skipsearch.decode.policy import DraftPolicy

    policy = DraftPolicy(max_draft_tokens=4, adaptive=False, guard=False)
    prompt = [5, 9, 14] * 80  # 240 tokens
    max_new_tokens = 256 - len(prompt)
    fed, hook = _positions_fed(api_model)
    try:
        output = generate(api_model, prompt, skip=skip, max_new_tokens=max_new_tokens, policy=policy)
        with pytest.raises(ValueError, match="exceed the model's context of 256"):
            generate(api_model, prompt, skip=skip, max_new_tokens=max_new_tokens + 1, policy=policy)
    finally:
        hook.remove()
    assert len(output.tokens) == max_new_tokens
    assert max(fed) == len(prompt) + max_new_tokens - 2 < 256  # the last token is never fed
    assert bool(output.stats.drafted) == (skip is not None)
