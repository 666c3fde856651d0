"""The scripts benchmarks/gpu.sh runs, run here small, on the CPU and in float32.

A GPU machine is lent rarely and briefly, and no other test runs these scripts: a script that a change of the package
broke, or a flag of gpu.sh that a script no longer takes, would otherwise be found there, at the cost of its minutes.
Each test runs one stage's script as gpu.sh does (a subprocess, the flags it passes; the embedded model replaced by a
tiny one, sizes cut) and checks the rows and columns the stage reads.
"""

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
GPU_SH = ROOT / "benchmarks" / "gpu.sh"
TINY_CONFIG = "benchmarks/configs/tiny-llama.json"  # 4 layers, hidden 64: the random-weight shape of these tests
TINY_SET = "a1,2|m2"  # gpu.sh's sets name layers up to 28; the tiny models have 4
SMALL = ["--device", "cpu", "--dtype", "float32"]

# What each stage of gpu.sh runs: a stage that runs another script needs a test of it here.
STAGE_SCRIPTS = {
    "setup": "benchmarks/skip_set_setup.py", "trials": "benchmarks/trial_vs_bench.py",
    "study": "-m skipsearch optimize", "host": "benchmarks/host_overhead.py", "kernels": "benchmarks/kernel_count.py",
    "prefill": "benchmarks/prefill.py", "speed": "benchmarks/engine_speed.py",
    "speed-8b": "benchmarks/engine_speed.py", "speed-shape": "benchmarks/engine_speed.py", "profiles": "-m skipsearch profile", "guard": "benchmarks/guard.py",
    "head": "benchmarks/draft_head.py", "resize": "benchmarks/cache_resize.py", "gptfast": "benchmarks/gptfast_anchor.py",
    "variants": "benchmarks/step_variants.py", "attention": "benchmarks/attention_kernels.py",
}
GPT_FAST = ROOT.parent / "shared" / "anchors" / "gpt-fast"  # beside a developer's checkout; not in CI

# Inductor's code generation takes minutes on two cores. The scripts run through this wrapper, which gives
# torch.compile the "eager" backend where it would use inductor: dynamo still traces every compiled step (full graph),
# and the rest runs as gpu.sh runs it. The script's folder goes first on sys.path, as `python script.py` puts it there
# (the scripts import decode_speed.py beside them).
RUNNER = """
import os, runpy, sys
import torch

compile_with = torch.compile
def compile_eagerly(*args, backend="inductor", **kwargs):
    return compile_with(*args, backend="eager" if backend == "inductor" else backend, **kwargs)
torch.compile = compile_eagerly
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_script(script: str, *flags, inductor: bool = False) -> str:
    """Run `script` (a path, or "-m skipsearch COMMAND" as in STAGE_SCRIPTS) with `flags` from the repo root; its
    stdout, after checking that it exited with 0. `inductor`: compile with inductor, not through RUNNER."""
    command = script.split() if script.startswith("-m ") else [script] if inductor else ["-c", RUNNER, script]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           # One thread: on a busy two-core machine OpenMP's two threads wait on each other, and a tiny model's matrix
           # products took 10 ms each (a decode of 8 tokens 2.5 s instead of 0.06 s).
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, *command, *map(str, flags)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def gpu_sh_stages() -> dict[str, str]:
    """gpu.sh's stages: name -> the stage's commands, with continued lines joined and comments left out."""
    text = re.sub(r"\\\n", " ", GPU_SH.read_text())
    body = text.split("case $stage in", 1)[1].split("esac", 1)[0]
    body = re.sub(r"#.*", "", body)
    return {match[1]: match[2] for match in re.finditer(r"^\s*([\w-]+)\)(.*?);;", body, re.M | re.S)}


def flags_taken(script: str) -> set[str]:
    """The long flags `script` (as in STAGE_SCRIPTS) defines. A script's are read from its source (its add_argument
    calls): its --help would import torch, seconds per script."""
    if script.startswith("-m skipsearch "):
        from skipsearch.cli import build_parser

        commands = build_parser()._subparsers._group_actions[0].choices
        return set(commands[script.split()[-1]]._option_string_actions)
    tree = ast.parse((ROOT / script).read_text())
    flags = _added_flags(tree)
    if any(isinstance(node, ast.Name) and node.id == "add_model_arguments" for node in ast.walk(tree)):
        shared = ast.parse((ROOT / "benchmarks" / "decode_speed.py").read_text())
        flags |= _added_flags(next(node for node in shared.body if isinstance(node, ast.FunctionDef)
                                   and node.name == "add_model_arguments"))
    return flags


def _added_flags(tree: ast.AST) -> set[str]:
    return {arg.value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}


def table_after(out: str, header_start: str) -> tuple[str, list[str]]:
    """The header line starting with `header_start` and the non-empty lines after it, up to the next empty one."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line)
    return lines[start], rows


def load_benchmark(name: str):
    """benchmarks/NAME.py as a module, imported in this process (its main() not run)."""
    if str(ROOT / "benchmarks") not in sys.path:  # as `python benchmarks/NAME.py` puts it there, for its imports
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_flag_gpu_sh_passes_is_one_its_script_takes():
    stages = gpu_sh_stages()
    assert {"info", "setup", "guard"} <= set(stages)  # the parse found the stages
    found = {}
    for stage, commands in stages.items():
        scripts = re.findall(r"python3 (benchmarks/\S+\.py|-m skipsearch \w+)", commands)
        if scripts:
            assert len(set(scripts)) == 1, (stage, scripts)
            found[stage] = scripts[0]
            passed = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", commands))
            assert passed and passed <= flags_taken(scripts[0]), (stage, passed - flags_taken(scripts[0]))
    assert found == STAGE_SCRIPTS


def pip_install_flags(script: Path) -> set[str]:
    """The flags of the first `pip install ... --target` in a shell script."""
    text = re.sub(r"\\\n", " ", script.read_text())
    return set(re.findall(r"--[a-z][\w-]*", re.search(r"pip install (.*?)--target", text)[1]))


def test_gpu_prepare_brings_pinned_wheels_and_installs_them_as_gpu_sh_does():
    prepare = ROOT / "benchmarks" / "gpu_prepare.sh"
    packages = {name.lower() for name in re.search(r'^PACKAGES="(.*?)"', prepare.read_text(), re.M | re.S)[1].split()}
    pinned = {line.split("==")[0].lower() for line in (ROOT / "constraints.txt").read_text().splitlines()
              if "==" in line}
    assert {"optuna", "transformers", "gguf"} <= packages
    assert packages <= pinned  # a lease installs what CI tested
    # The rehearsal installs with every flag gpu.sh's install takes, so that wheels it accepts install there too.
    assert "--no-index" in pip_install_flags(GPU_SH)  # the parse found gpu.sh's install
    assert pip_install_flags(GPU_SH) <= pip_install_flags(prepare)


def test_skip_set_setup():  # stage "setup"
    # 2 sets: the least it takes (it compares the later sets with the first)
    out = run_script("benchmarks/skip_set_setup.py", *SMALL, "--config-only", TINY_CONFIG,
                     "--modes", "regional,default", "--sets", 2, "--new-tokens", 8)
    assert re.search(r"^LlamaForCausalLM, 4 layers, cpu", out, re.M)  # the stage greps "mode\|layers"
    for mode in ("regional", "default"):
        header, rows = table_after(out, f"mode {mode} (")
        assert header.endswith("set, setup s, decode s, memory MB, identical to HF greedy")
        # One row per set (index, set, setup s, decode s, MB, identical), then the mode's summary.
        assert [re.fullmatch(r"\s+\d+ attn=\[.*\] mlp=\[.*\]( +[\d.]+){3} (True|False)", row) is not None
                for row in rows] == [True, True, False]
        assert rows[-1].startswith(f"mode {mode} (") and "first set's setup" in rows[-1]


def test_skip_set_setups_sets_are_distinct_and_refused_beyond_what_exists():
    sparse_sets = load_benchmark("skip_set_setup").sparse_sets
    assert len(set(sparse_sets(4, 15))) == 15  # every set of layers 1 and 2 (4 layers)
    with pytest.raises(ValueError, match="15 distinct skip sets"):
        sparse_sets(4, 16)  # drew forever before


@pytest.mark.parametrize("mode", ["deployed", "regional"])
def test_trial_vs_bench(tiny_model_dir, mode):  # stage "trials"
    out = run_script("benchmarks/trial_vs_bench.py", *SMALL, "--model", tiny_model_dir, "--num-prompts", 1,
                     "--max-new-tokens", 8, "--repeats", 1, "--skip-sets", TINY_SET, "--bench-mode", mode)
    assert f"bench's steps: {mode}" in out
    header, rows = table_after(out, "skip set")
    assert header.split() == ["skip", "set", "study", "(95%", "interval)", "bench", "(95%", "interval)", "overlap"]
    assert len(rows) == 1 and re.fullmatch(r"attn=\[1, 2\] mlp=\[2\] .*x \(.*\) .*x \(.*\)  (yes|NO)", rows[0])


def test_host_overheads_parts_are_all_in_the_package():
    """host_overhead.py leaves a piece it cannot find to "loop" (for older checkouts): a piece renamed in the package
    must be renamed there too, or the GPU's split by part silently goes wrong."""
    for part, places in load_benchmark("host_overhead").PARTS.items():
        for module_name, owner_name, name in places if isinstance(places, list) else [places]:
            module = importlib.import_module(module_name)
            assert hasattr(getattr(module, owner_name) if owner_name else module, name), (part, owner_name, name)


def test_host_overhead():  # stage "host"
    out = run_script("benchmarks/host_overhead.py", *SMALL, "--models", TINY_CONFIG, "--modes", "eager,regional",
                     "--new-tokens", 8, "--repeats", 1)
    header, rows = table_after(out, "model ")
    parts = ["steps", "positions", "drafting", "acceptance + r", "plain batches", "statistics", "prefill", "loop"]
    assert header.split()[:4] == ["model", "mode", "decoding", "us/token"] and all(p in header for p in parts)
    decodings = ["plain", "spec k=4 fixed", "spec adaptive (k<=8)"]
    assert [list(re.match(r"(\S+) +(\S+) +(.*?) +[\d.]+ ", row).groups()) for row in rows] == [
        ["tiny-llama.json", mode, decoding] for mode in ("eager", "regional") for decoding in decodings]
    assert all(row.count("[") == len(parts) for row in rows)  # per token [per round] for every part


def test_kernel_count():  # stage "kernels"
    out = run_script("benchmarks/kernel_count.py", *SMALL, "--compile", "--config-only", TINY_CONFIG,
                     "--skip-set", "a1|m2", "--per-layer", "--top", 30, inductor=True)  # its kernels are counted
    assert re.search(r"^benchmarks/configs/tiny-llama.json on cpu \(float32\), regional compiled steps", out, re.M)
    rows = re.findall(r"^(plain step|draft step attn=\[1\] mlp=\[2\]|no layer \(all skipped\)) +(\d+)   "
                      r"most frequent: (.*)$", out, re.M)
    assert [name for name, _, _ in rows] == ["plain step", "draft step attn=[1] mlp=[2]", "no layer (all skipped)"]
    plain, draft, no_layer = (int(count) for _, count, _ in rows)
    assert 0 < no_layer < draft < plain  # the draft skips sublayers: fewer launches
    # Inductor's own C++ kernels are counted beside the operators: each layer's 4 matmuls (its linears of one input
    # fused: decode/fused.py), its attention and the fused kernels around them (norms, rotary embedding, the cache's
    # writes, the activation, the residual adds).
    assert "cpp_fused" in rows[0][2] and "aten::mm x16" in rows[0][2]
    per_layer = float(re.search(r"^per decoder layer \(plain step\): ([\d.]+)$", out, re.M).group(1))
    assert per_layer == (plain - no_layer) / 4 and per_layer > 8


def test_draft_head():  # stage "head"
    out = run_script("benchmarks/draft_head.py", *SMALL, "--config-only", TINY_CONFIG, "--rows", "8,16", "--repeats", 3)
    assert re.search(r"^benchmarks/configs/tiny-llama.json \(random weights\) on cpu, torch.float32: timings only$", out,
                     re.M)
    assert len(re.findall(r"^ +(8|16) rows: [\d.]+ ms, full over trimmed [\d.]+x \([\d.]+-[\d.]+\)$", out, re.M)) == 2
    for mode in ("eager", "regional"):
        assert re.search(rf"^one-token forwards, {mode} steps: plain step [\d.]+ ms \(median\); the head's matmul", out,
                         re.M)
    assert len(re.findall(r"^  draft step, nothing skipped, head of +(8|16) rows: [\d.]+ ms; plain over draft", out,
                          re.M)) == 4


def test_prefill():  # stage "prefill"
    out = run_script("benchmarks/prefill.py", *SMALL, "--config-only", TINY_CONFIG, "--num-prompts", 2, "--repeats", 2)
    assert re.search(r"^benchmarks/configs/tiny-llama.json on cpu \(float32\), 2 prompts \(37-90 tokens, made up: "
                     r"random weights\) x 2 paired runs; compiled at widths 16, 64, 256$", out, re.M)
    for kind in ("eager", "compiled"):
        assert re.search(rf"^{kind} +prefill: +[\d.]+ ms a prompt, +[\d.]+ us a token$", out, re.M)
    assert re.search(r"^eager / compiled: [\d.]+x \(95% interval [\d.]+-[\d.]+\)$", out, re.M)


@pytest.mark.parametrize("stage", ["speed", "speed-8b", "speed-shape"])
def test_engine_speed(stage, request):
    # "speed" decodes the built-in prompts with a model and its tokenizer, "speed-8b" random prompts, random weights;
    # "speed-shape" too, with plain rows only (no skip sets).
    model = (["--model", request.getfixturevalue("tiny_model_dir")] if stage == "speed"
             else ["--config-only", TINY_CONFIG])
    # On a GPU the shapes' stages leave out our eager rows.
    sets, eager = ("", False) if stage == "speed-shape" else (TINY_SET, stage == "speed")
    out = run_script("benchmarks/engine_speed.py", *SMALL, "--num-prompts", 1, "--max-new-tokens", 8, "--repeats", 1,
                     *model, "--skip-sets", sets, *([] if eager else ["--no-eager"]))
    assert re.search(r"^weights read per forward [\d.]+ GB; measured read bandwidth [\d.]+ GB/s$", out, re.M)
    header, rows = table_after(out, "method ")
    for column in ("tok/s", "vs HF eager (95% interval)", "vs HF static+compile", "vs ours plain compiled", "GB/s",
                   "host us/tok", "identical", "accept", "compile s", "gaps"):
        assert column in header
    skip = "attn=[1, 2] mlp=[2]"
    # On a CPU with inductor (the default backend) the regional rows are there too.
    plain = ["HF eager greedy", "HF static cache + compile", "skipsearch plain eager", "skipsearch plain compiled",
             "skipsearch plain compiled, regional (studies)"]
    drafts = [f"self-spec {skip} eager", f"self-spec {skip} compiled", f"self-spec {skip} compiled, regional"]
    expected = plain + ([] if stage == "speed-shape" else drafts)
    if not eager:
        expected = [row for row in expected if row == "HF eager greedy" or not row.endswith(" eager")]
    assert [row[:48].rstrip() for row in rows] == expected


def test_guard(tiny_model_dir):  # stage "guard"
    out = run_script("benchmarks/guard.py", *SMALL, "--model", tiny_model_dir, "--compile", "--num-prompts", 1,
                     "--max-new-tokens", 8, "--repeats", 1, "--sets", TINY_SET, "--learned", 1)
    assert "1 repeats after 1 untimed passes" in out
    header, rows = table_after(out, "| method |")
    assert header == ("| method | tok/s | vs plain (95% interval) | acceptance | drafted / round | guard: plain tokens "
                      "| identical |")
    cells = [row.strip("| ").split(" | ") for row in rows[1:]]  # after the | --- | line
    assert cells[0][0] == "plain" and all(len(c) == 7 for c in cells)
    policies = [c[0] for c in cells[1:]]
    assert len(policies) == 5 and all(p.startswith("attn=[1, 2] mlp=[2]: ") for p in policies)


def test_profile(tmp_path, virtual_profiles):  # stage "profiles"
    """In this process and in virtual time (conftest's `virtual_profiles`): a busy machine's real timings are refused
    as noise, and a subprocess could not be given the virtual clock."""
    import torch

    from skipsearch.cli import main

    output = tmp_path / "profile-tiny-llama.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_script's OMP_NUM_THREADS: two threads took 70 s here on a busy machine, one 1 s
    try:
        code = main(["profile", "--config-only", "--model", TINY_CONFIG, *SMALL, "--no-progress", "--output",
                     str(output), "--contexts", "8,16", "--repeats", "2"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    profile = json.loads(output.read_text())
    keys = {"device", "dtype", "architecture", "num_hidden_layers", "contexts", "overheads", "provenance"}
    assert keys <= set(profile) and profile["num_hidden_layers"] == 4
    assert [c["context_tokens"] for c in profile["contexts"]] == [8, 16]
    assert profile["provenance"]["weights"] == "random (built from the config alone)"


def test_optimize(tiny_model_dir, tmp_path):  # stage "study"
    out = run_script("-m skipsearch optimize", *SMALL, "--model", tiny_model_dir, "--study-name", "gpu30",
                     "--n-trials", 2, "--no-progress", "--studies-dir", tmp_path, "--num-prompts", 1,
                     "--max-new-tokens", 8, "--repeats", 1)
    # The stage reads the unindented summary: the trials evaluated and the verdict.
    assert re.search(r"^study gpu30 in sqlite:///.*: 2 distinct skip sets evaluated", out, re.M)
    assert f"exported {tmp_path / 'gpu30' / 'best.json'}" in out and (tmp_path / "gpu30" / "best.json").is_file()


def test_before_after(tmp_path, default_model):  # not a stage: an engine change against the revision before it
    from skipsearch.decode.config import ModelInfo, SkipConfig, save_skip_config
    from skipsearch.decode.skipset import SkipSet

    layers = default_model.model.config.num_hidden_layers
    save_skip_config(SkipConfig(ModelInfo.of(default_model.model, "default"), SkipSet.of([2], [3], layers)),
                     tmp_path / "best.json")  # the default (adaptive) draft policy
    out = run_script("benchmarks/before_after.py", "--before", "HEAD", "--device", "cpu", "--skip-sets", "a1",
                     "--num-prompts", 1, "--max-new-tokens", 4, "--repeats", 2, "--config", tmp_path / "best.json")
    rows = re.findall(r"^(plain|a1|config) eager +([\d.]+) +([\d.]+) +([\d.]+)x \(([\d.]+)-([\d.]+)\) +([\d.]+)$", out,
                      re.M)
    assert [row[0] for row in rows] == ["plain", "a1", "config"]
    for _, before, after, ratio, low, high, same in rows:
        assert float(before) > 0 and float(after) > 0 and float(low) <= float(ratio) <= float(high)
        assert float(same) == 1.0  # the same revision's code: the same tokens


def test_attention_speed():  # not a stage: on CUDA, kernel_count.py and engine_speed.py show the cut
    out = run_script("benchmarks/attention_speed.py", *SMALL, "--config-only", TINY_CONFIG, "--slots", "256,512",
                     "--repeats", 3)
    assert re.search(r"^benchmarks/configs/tiny-llama.json on cpu \(float32\), \d+ threads: 4 query heads over 2 "
                     r"key/value heads$", out, re.M)
    rows = re.findall(r"^(eager|regional) +(\d+) slots  (one-token step|verify step \(5 tokens\)) +transformers' SDPA "
                      r"+[\d.]+ ms  grouped +[\d.]+ ms  SDPA over grouped [\d.]+x \([\d.]+-[\d.]+\)$", out, re.M)
    assert rows == [(mode, slots, step) for mode in ("eager", "regional") for slots in ("256", "512")
                    for step in ("one-token step", "verify step (5 tokens)")]


def test_cache_resize():  # stage "resize"
    out = run_script("benchmarks/cache_resize.py", *SMALL, "--config-only", TINY_CONFIG, "--first", 200,
                     "--slots", "300,600", "--repeats", 3)
    assert re.search(r"^resized copy, first cache 256 slots: [1-9]\d* graphs, [\d.]+ s$", out, re.M)
    sizes = re.findall(r"^(\d+) slots: resized copy (\d+) new graphs, [\d.]+ s; fresh copy ([1-9]\d*) graphs, [\d.]+ s$",
                       out, re.M)
    # The second length recompiles each layer function once (the length dynamic), the third compiles nothing.
    assert [slots for slots, _, _ in sizes] == ["512", "768"] and int(sizes[0][1]) > 0 and sizes[1][1] == "0"
    rows = re.findall(r"^  (one-token step|verify step \(5 tokens\)) +fresh +[\d.]+ ms  resized +[\d.]+ ms  fresh over "
                      r"resized [\d.]+x \([\d.]+-[\d.]+\)$", out, re.M)
    assert rows == ["one-token step", "verify step (5 tokens)"] * 2


def test_verify_head():  # not a stage: the packed head is a CPU's (decode/packed.py)
    out = run_script("benchmarks/verify_head.py", "--config-only", TINY_CONFIG, "--widths", "1,3", "--repeats", 3)
    assert re.search(r"^benchmarks/configs/tiny-llama.json: head \(\d+, 64\), float32", out, re.M)
    ratio = r"[\d.]+x \([\d.]+-[\d.]+\)"
    for what in ("the own head's one row", "a plain step"):
        rows = re.findall(rf"^  (\d) rows: own [\d.]+ ms = {ratio} {what}; packed [\d.]+ ms = {ratio}; own over packed "
                          rf"{ratio}$", out, re.M)
        assert rows == ["1", "3"]


def test_gptfast_model_args_follow_the_shapes_config():  # stage "gptfast"
    model_args = load_benchmark("gptfast_anchor").model_args
    smollm2 = json.loads((ROOT / "benchmarks" / "configs" / "smollm2-135m.json").read_text())
    assert model_args(smollm2) == dict(block_size=8192, vocab_size=49152, n_layer=30, n_head=9, n_local_heads=3,
                                       dim=576, intermediate_size=1536, rope_base=100000.0, norm_eps=1e-5)
    llama3 = json.loads((ROOT / "benchmarks" / "configs" / "llama-3-8b.json").read_text())
    assert model_args(llama3)["n_local_heads"] == 8 and model_args(llama3)["rope_base"] == 500000.0
    gemma = json.loads((ROOT / "benchmarks" / "configs" / "gemma-3-270m.json").read_text())
    with pytest.raises(ValueError, match="head_dim"):  # 4 heads of 256 over a width of 640
        model_args(gemma)


def test_gptfast_anchor_refuses_a_folder_without_gpt_fast(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/gptfast_anchor.py", "--gpt-fast", str(tmp_path), "--config",
                             TINY_CONFIG], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and f"--gpt-fast {tmp_path}: no generate.py there" in result.stderr


@pytest.mark.skipif(not (GPT_FAST / "generate.py").exists(), reason="gpt-fast's copy is beside a developer's checkout")
def test_gptfast_anchor():  # stage "gptfast"
    out = run_script("benchmarks/gptfast_anchor.py", "--gpt-fast", GPT_FAST, "--config", TINY_CONFIG, "--device", "cpu",
                     "--max-new-tokens", 8, "--repeats", 2)
    assert re.search(r"^gpt-fast on benchmarks/configs/tiny-llama.json \(cpu\): weights read per token [\d.]+ GB; "
                     r"measured read bandwidth [\d.]+ GB/s$", out, re.M)
    assert len(re.findall(r"^run [12]: [\d.]+ tok/s \(prefill included\), \d+ GB/s, \d+% of measured$", out, re.M)) == 2
    assert re.search(r"^gpt-fast median [\d.]+ tok/s, \d+% of measured bandwidth$", out, re.M)


def run_gpu_sh(tmp_path, *stages: str) -> subprocess.CompletedProcess:
    """gpu.sh run here as on the GPU machine: its wheels as if installed by an earlier call, its results to
    tmp_path/out, its temporary files under tmp_path/tmp."""
    keep = tmp_path / "keep"
    (keep / "site" / "optuna").mkdir(parents=True, exist_ok=True)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "KEEP": str(keep), "TMPDIR": str(tmp_path / "tmp")}
    return subprocess.run(["bash", str(GPU_SH), *stages], env=env, capture_output=True, text=True, timeout=300)


def test_gpu_sh_returns_one_archive_with_each_stages_times(tmp_path):
    """The run tool returns at most 8 files from a call: gpu.sh packs its logs into one (here a CPU's `info`, whose
    nvidia-smi is missing: the stage still ends, and its log says so)."""
    done = run_gpu_sh(tmp_path, "info")
    assert done.returncode == 0, done.stderr
    results = tmp_path / "out"
    assert [path.name for path in results.iterdir()] == ["results.tgz"]
    listing = subprocess.run(["tar", "tzf", str(results / "results.tgz")], capture_output=True, text=True, check=True)
    assert {"./stages.log", "./info.log"} <= set(listing.stdout.split())
    times = subprocess.run(["tar", "xzOf", str(results / "results.tgz"), "./stages.log"], capture_output=True,
                           text=True, check=True).stdout
    assert re.fullmatch(r"info began at \d+ s\ninfo ended at \d+ s\n", times)
    assert list((tmp_path / "tmp").iterdir()) == []  # the logs' folder is removed once packed


def test_gpu_sh_refuses_an_unknown_stage_before_running_any(tmp_path):
    done = run_gpu_sh(tmp_path, "info", "no-such-stage")
    assert done.returncode == 2 and done.stderr == "benchmarks/gpu.sh: unknown stage no-such-stage\n"
    assert list((tmp_path / "out").iterdir()) == [] and list((tmp_path / "tmp").iterdir()) == []


def test_gpu_sh_names_every_stage_it_runs():
    """The stages gpu.sh checks its arguments against are the ones its `case` runs."""
    listed = re.search(r'^STAGES="(.*?)"$', re.sub(r"\\\n", "", GPU_SH.read_text()), re.M | re.S)[1].split()
    assert sorted(listed) == sorted(gpu_sh_stages())


def plan_calls() -> list[tuple[str, list[str], str]]:
    """The calls gpu.sh's header plans, its lines "NAME, carry PATHS:  COMMAND": (name, paths carried, command), a
    command's continued lines joined."""
    header = re.sub(r"\\\n#\s*", " ", GPU_SH.read_text().split("\nset -uo pipefail", 1)[0])
    return [(match[1], match[3].split(), match[4]) for match in
            re.finditer(r"^#\s{2,}([a-z0-9 -]*call( \d+)?), carry ([^:]+):\s*(.*)$", header, re.M)]


def test_gpu_sh_plans_calls_it_can_run():
    """The header's plan as a lease runs it: each call's stages are ones gpu.sh takes, its variables ones it reads, its
    carried paths ones gpu_prepare.sh makes. Every call of the next lease's plan carries the wheels: a machine gone cold
    between calls starts bare, and gpu.sh there stops at "no wheels" without them. A call of gptfast carries gpt-fast.
    The first call runs the CUDA tests before anything is timed."""
    calls = plan_calls()
    assert [name for name, _, _ in calls][:2] == ["call 1", "call 2"]
    stages, read = set(gpu_sh_stages()), set(re.findall(r"\$\{(\w+):-", GPU_SH.read_text()))
    made = {".whl", ".gptfast", ".gpu/gguf.aa", ".gpu/gguf.ab", ".gpu/gguf.ac"}
    for name, carried, command in calls:
        variables, run = re.fullmatch(r'((?:\w+=(?:"[^"]*"|\S+) +)*)bash benchmarks/gpu\.sh ([\w -]+)',
                                      command).groups()
        assert set(run.split()) <= stages and set(re.findall(r"(\w+)=", variables)) <= read, name
        assert set(carried) <= made and ("gptfast" not in run.split() or ".gptfast" in carried), name
        assert ".whl" in carried or not re.fullmatch(r"call \d+", name), name
    first = calls[0][2].split("gpu.sh ")[1].split()
    assert "cuda-tests" in first and set(first[: first.index("cuda-tests")]) <= {"info"}


def test_profiles_time_the_shipped_shapes_most_needed_first():
    """The profiles stage's shapes are the shipped profiles' (each once), the default model's and the 8B goal's first:
    a call cut at its limit loses the last."""
    shapes = re.search(r"PROFILE_SHAPES:-([^}]*)\}", GPU_SH.read_text())[1].split()
    shipped = [path.stem for path in (ROOT / "skipsearch" / "profiles" / "nvidia-h200").glob("*.json")]
    assert sorted(shapes) == sorted(shipped)
    assert shapes[:2] == ["smollm2-135m", "llama-3-8b"]


def test_every_command_of_a_stage_is_killed_where_its_timeout_does_not_end_it():
    """`timeout N` alone sends one TERM: a process stuck in a CUDA call, or one holding the stage's pipe, outlives it,
    and the stages after it never run. Every stage's command runs under `timeout -k 15 N`."""
    found = re.findall(r"(?<![\w-])timeout +(\S+ \S+ \S+)", "\n".join(gpu_sh_stages().values()))  # not --timeout
    assert len(found) >= 18 and all(re.fullmatch(r"-k 15 \d+", arguments) for arguments in found), found


def test_gpu_carry_checks_each_planned_call_with_the_working_tree(tmp_path):
    """gpu_prepare.sh's last step: each call of gpu.sh's plan, its carried paths and the working tree that travels
    with every call (tracked files and untracked ones not ignored), against the run tool's 64 MiB a call."""
    (tmp_path / "benchmarks").mkdir()
    for name in ("gpu.sh", "gpu_carry.sh"):
        shutil.copy(ROOT / "benchmarks" / name, tmp_path / "benchmarks")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("/.whl/\n/.gpu/\n")
    sizes = {".whl/w.whl": 20, "tree.bin": 3, ".gpu/gguf.aa": 38, ".gpu/gguf.ab": 38, ".gpu/gguf.ac": 18, ".gpu/no": 50}
    for path, mib in sizes.items():
        (tmp_path / path).parent.mkdir(exist_ok=True)
        with open(tmp_path / path, "wb") as file:
            file.truncate(mib << 20)

    def checked() -> tuple[int, list[tuple[str, str, float, str]]]:
        done = subprocess.run(["bash", "benchmarks/gpu_carry.sh"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60)
        rows = re.findall(r"^(.+?) +carry (.+?) +([\d.]+) MiB with the tree: (.*)$", done.stdout, re.M)
        assert done.stdout.startswith("the working tree, with every call: "), done.stdout + done.stderr
        return done.returncode, [(name, paths, float(mib), verdict) for name, paths, mib, verdict in rows]

    status, rows = checked()
    assert [(name, paths.split()) for name, paths, _, _ in rows] == [(name, paths) for name, paths, _ in plan_calls()]
    by_name = {name: (mib, verdict) for name, _, mib, verdict in rows}
    assert status == 0 and by_name["call 1"] == (pytest.approx(23, abs=0.1), "fits")
    assert by_name["model call 1"] == (pytest.approx(61, abs=0.1), "fits")  # the wheels, a part, the tree
    assert by_name["gpt-fast call"][1] == "fits; lacks .gptfast"  # listed, but no call of the next lease's plan
    with open(tmp_path / "tree.bin", "wb") as file:  # untracked, not ignored: it travels with every call
        file.truncate(10 << 20)
    status, rows = checked()
    assert status == 1 and {name: verdict for name, _, _, verdict in rows}["model call 1"] == \
        "OVER the 64 MiB a call carries"
    shutil.rmtree(tmp_path / ".whl")
    status, rows = checked()
    assert status == 1 and rows[0][3] == "fits; lacks .whl"


def test_step_variants():  # stage "variants"
    out = run_script("benchmarks/step_variants.py", *SMALL, "--config-only", TINY_CONFIG, "--slots", "256,512",
                     "--repeats", 3)
    variants = ["frozen", "math", "frozen+math", "whole", "combo", "math+combo"]
    for slots in (256, 512):
        for variant in ["shipped", *variants]:
            assert re.search(rf"^{slots} slots, {re.escape(variant)}: \d+ new graphs, [\d.]+ s$", out, re.M)
    steps = ["one-token step", "verify step (5 tokens)"]
    shipped = re.findall(r"^  (one-token step|verify step \(5 tokens\)) +shipped (\d+) launches$", out, re.M)
    assert [step for step, _ in shipped] == steps * 2
    found = re.findall(r"^  (one-token step|verify step \(5 tokens\)) +(\S+) +(\d+) launches +[\d.]+ ms against +[\d.]+ "
                       r"ms  shipped over (\S+) [\d.]+x \([\d.]+-[\d.]+\); top-1 same in (\d+)/(\d+) rows, max "
                       r"difference [\d.e+-]+ \(smallest top-1 lead [\d.e+-]+\)$", out, re.M)
    assert [(step, name, over) for step, name, _, over, *_ in found] == [
        (step, v, v) for v in variants for step in steps] * 2
    assert [(same, rows) for *_, same, rows in found] == [("1", "1"), ("5", "5")] * len(variants) * 2  # fp32: same
    # The math backend reaches the compiled steps (SDPA's CPU kernel is one operator, the math backend several).
    assert [int(count) for _, name, count, *_ in found if name == "math"] != [int(count) for _, count in shipped]


def test_attention_kernels():  # stage "attention"
    """Every method's row for each cache size and width, each method's output equal to the engine's attention (the
    same attention, other kernels), and a kernel this device lacks (cuDNN's and the memory-efficient one on a CPU)
    one line. The calls cycle through copies of the cache (as on CUDA, against its L2)."""
    out = run_script("benchmarks/attention_kernels.py", *SMALL, "--shapes", "tiny-llama,qwen2.5-1.5b", "--slots",
                     "64,256", "--widths", "1,5", "--calls", 2, "--repeats", 2, "--ring-mb", "0.2")
    assert "calls cycle through 0.2 MB of caches" in out
    rows = re.findall(r"^(\S+) (\d+) slots (\d+) token\(s\): folded [\d.]+ ms \d+ GB/s; (.*)$", out, re.M)
    assert [row[:3] for row in rows] == [(shape, slots, width) for shape in ("tiny-llama", "qwen2.5-1.5b")
                                         for slots in ("64", "256") for width in ("1", "5")]
    for *_, cells in rows:
        measured = re.findall(r"(unfolded|math|gqa) [\d.]+ ms \d+ GB/s [\d.]+x \([\d.]+-[\d.inf]+\) "
                              r"\(max diff ([\d.e+-]+)\)", cells)
        assert [name for name, _ in measured] == ["unfolded", "math", "gqa"]
        assert all(float(difference) < 1e-5 for _, difference in measured)
        assert re.search(r"cudnn FAILED \([^)]*\); unfolded .*; efficient FAILED \([^)]*\); math .*; gqa .*; "
                         r"gqa-cudnn FAILED \([^)]*\)$", cells)


def test_attention_kernels_gqa_neither_folds_nor_copies(monkeypatch):
    """"gqa" gives the grouped query heads to SDPA as they are (`enable_gqa`, the keys not repeated) and "folded", the
    rows' baseline, folds them on any device (here a CPU's, whose engine would not); the two agree."""
    from skipsearch.decode import attention
    from test_attention import Heads, inputs

    attention_kernels = load_benchmark("attention_kernels")
    query, key, value, mask = inputs(1)
    shapes, real = [], attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kwargs: shapes.append((q.shape, k.shape)) or real(q, k, v, **kwargs))
    grouped = attention_kernels.METHODS["gqa"](Heads(3), query, key, value, mask)
    folded = attention_kernels.folded(Heads(3), query, key, value, mask)
    assert shapes == [((1, 9, 1, 16), (1, 3, 40, 16)), ((1, 3, 3, 16), (1, 3, 40, 16))]
    torch.testing.assert_close(grouped, folded, rtol=1e-12, atol=1e-12)


def test_step_variants_reports_a_failing_variant_and_measures_the_next(monkeypatch, capsys):
    """A variant that fails to compile or capture (on a GPU, in a call that cannot be run again) is one line, and the
    variants after it are still measured."""
    step_variants = load_benchmark("step_variants")
    measured = step_variants.measure

    def measure(model, variant, *rest):
        if variant == "frozen":
            raise RuntimeError("no capture here\nsecond line")
        return measured(model, variant, *rest)

    compile_with = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: compile_with(*args, **{**kwargs, "backend": "eager"}))
    monkeypatch.setattr(step_variants, "measure", measure)
    monkeypatch.setattr(step_variants, "profile_inductor_cpu_kernels", lambda: None)  # a setting of the process's
    monkeypatch.setattr(sys, "argv", ["step_variants.py", *SMALL, "--config-only", TINY_CONFIG, "--slots", "256",
                                      "--repeats", "2", "--variants", "frozen,math"])
    step_variants.main()
    out = capsys.readouterr().out
    assert "256 slots, frozen: FAILED, RuntimeError: no capture here\n" in out and "second line" not in out
    assert re.search(r"^  verify step \(5 tokens\) +math .* top-1 same in 5/5 rows", out, re.M)


def test_step_variants_attend_through_the_variants_function_and_restore_the_engines(monkeypatch, capsys):
    """A variant's steps attend through the function it names: "unfolded" (transformers' own SDPA), "gqa" and
    "folded" (the engine's attention, never and always folded) agree with the shipped steps, and a made-up variant
    whose attention outputs zeros changes the logits, which only the variant's steps can do; the engine's own
    attention is registered again afterwards."""
    from torch.nn.attention import SDPBackend
    from transformers import AttentionInterface

    from skipsearch.decode import adapter
    from skipsearch.decode.attention import grouped_sdpa

    step_variants = load_benchmark("step_variants")
    assert step_variants.VARIANTS["unfolded"].attention is adapter.sdpa_attention
    gqa = step_variants.VARIANTS["gqa"].attention
    assert gqa.func is grouped_sdpa and gqa.keywords == {"fold": False}
    folded = step_variants.VARIANTS["folded"].attention
    assert folded.func is grouped_sdpa and folded.keywords == {"fold": True}
    forced = step_variants.VARIANTS["gqa-cudnn"]
    assert forced.attention.keywords == {"fold": False} and forced.backends == [SDPBackend.CUDNN_ATTENTION]

    def silent(module, query, *args, **kwargs):  # no attention at all: (batch, width, heads, dim) of zeros
        return torch.zeros_like(query).transpose(1, 2).contiguous(), None

    compile_with = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: compile_with(*args, **{**kwargs, "backend": "eager"}))
    monkeypatch.setitem(step_variants.VARIANTS, "silent", step_variants.Variant(attention=silent))
    monkeypatch.setattr(step_variants, "profile_inductor_cpu_kernels", lambda: None)
    monkeypatch.setattr(sys, "argv", ["step_variants.py", *SMALL, "--config-only", TINY_CONFIG, "--slots", "256",
                                      "--repeats", "2", "--variants", "unfolded,silent,gqa,folded"])
    step_variants.main()
    out = capsys.readouterr().out
    differences = dict(re.findall(r"^  one-token step +(\S+) .* max difference ([\d.e+-]+) ", out, re.M))
    assert set(differences) == {"unfolded", "silent", "gqa", "folded"}
    assert max(float(differences[name]) for name in ("unfolded", "gqa", "folded")) < 1e-4 < float(differences["silent"])
    assert re.search(r"^  verify step \(5 tokens\) +unfolded .* top-1 same in 5/5 rows", out, re.M)
    assert AttentionInterface()[adapter.ENGINE_ATTENTION] is grouped_sdpa


FACTOR = 2  # read by `times`, and so guarded by dynamo


def times(x):
    return x * FACTOR


def test_step_variants_unguarded_leaves_dynamos_guards_unchecked(monkeypatch):
    """The "unguarded" variant measures what dynamo's guards cost: inside it, a compiled function whose guard fails
    (a global it read has changed) still runs the graph it has; outside, the guard recompiles it."""
    step_variants = load_benchmark("step_variants")
    compiled, x = torch.compile(times, backend="eager"), torch.ones(3)
    assert compiled(x).tolist() == [2.0] * 3
    monkeypatch.setitem(globals(), "FACTOR", 5)
    assert step_variants.under("unguarded", lambda: compiled(x))().tolist() == [2.0] * 3
    assert compiled(x).tolist() == [5.0] * 3


def test_step_variants_frozen_step_launches_fewer_kernels_than_the_regional_steps():
    """Compiled by inductor (the test above compiles eagerly): the frozen step, its linears concatenated and the
    layers fused with each other, launches fewer than the regional steps, for the same top-1 tokens."""
    out = run_script("benchmarks/step_variants.py", *SMALL, "--config-only", TINY_CONFIG, "--slots", "256",
                     "--repeats", 2, "--variants", "frozen", inductor=True)
    shipped = re.findall(r"^  (?:one-token|verify) step.* shipped (\d+) launches$", out, re.M)
    frozen = re.findall(r"^  (?:one-token|verify) step.* frozen +(\d+) launches .*; top-1 same in (\d+)/(\d+) rows", out,
                        re.M)
    assert len(shipped) == len(frozen) == 2
    assert all(int(launches) < int(regional) and same == rows for regional, (launches, same, rows) in zip(shipped, frozen))


def test_step_variants_refuses_an_unknown_variant():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "benchmarks/step_variants.py", "--variants", "math,fast"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--variants: unknown fast" in result.stderr


def test_projection():  # not a stage: predictions from the shipped GPU profiles
    projection = load_benchmark("projection")
    from skipsearch.decode.cost_profile import CostProfile
    from skipsearch.decode.economics import committed_tokens

    stats = projection.rounds_at(0.8, 4, 512)
    assert stats.verify_contexts == {(5, 512): 1000} and stats.drafted == 4000
    assert (stats.accepted + stats.rounds) / stats.rounds == pytest.approx(committed_tokens(0.8, 4), abs=1e-3)
    mapped = projection.skip_sets(32)
    assert len(mapped) == 2 and all(max(s.attn + s.mlp) < 32 and s.size >= 28 for s in mapped.values())
    assert [s.size for s in projection.skip_sets(40).values()] == [34, 34]  # the published sets as they are
    profile = CostProfile.load("nvidia-h200/llama-2-13b")
    skip = next(iter(projection.skip_sets(40).values()))
    speedups = [projection.best_speedup(profile, skip, a, 512)[0] for a in projection.ACCEPTANCE]
    assert speedups == sorted(speedups) and speedups[0] < 1.0 < speedups[-1]  # too dear at 0.6, paying at 0.95
    # Drafting one token a round, the loop verifies two, never the cheaper three this profile measured at 128.
    assert profile.contexts[0].verify_s[2] < profile.contexts[0].verify_s[1] and profile.compiled_steps
    unbounded = profile.predict_speedup(skip, projection.rounds_at(0.9, 1, 128))  # padded to any measured width
    assert projection.speedup_at(profile, skip, 0.9, 1, 128) < unbounded
    out = run_script("benchmarks/projection.py", "--shapes", "llama-3-8b", "--head-rows", 16384)
    assert "PREDICTED speedup over compiled plain decoding" in out and "head of 16,384 rows" in out
    rows = re.findall(r"^\| (0\.\d\d) \|( [\d.]+x \(k=\d\) \|){4}$", out, re.M)
    assert [acceptance for acceptance, _ in rows] == ["0.60", "0.70", "0.80", "0.90", "0.95"]
