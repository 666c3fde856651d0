"""Decoding engines side by side, interleaved (a benchmark script, not a test).

Compares, on the same prompts: HF eager greedy; HF's own fastest path (static cache with
torch.compile, `cache_implementation="static"`); skipsearch eager and compiled, plain and
self-speculative for the given skip sets. Prints tokens/s, speedup over HF eager, identical
outputs (share of prompts) with the top-2 logit gaps at divergences, compile times, and the
weight bandwidth achieved (bytes of weights read per forward x forwards/s) beside the
machine's measured read bandwidth (a large tensor summed), as gpt-fast prints it, and on CUDA the
host microseconds per token: wall time per token less the GPU's busy time per token (the kernels'
time in a profiled run of the same decoding). benchmarks/host_overhead.py splits host work by part.

    python benchmarks/engine_speed.py                                  # default model, CPU, fp32
    python benchmarks/engine_speed.py --device cuda --dtype bfloat16 --max-new-tokens 128
    python benchmarks/engine_speed.py --device cuda --dtype bfloat16 --config-only benchmarks/configs/llama-3-8b.json
"""

from __future__ import annotations

import argparse
import time

import torch

from skipsearch import load_model
from skipsearch.decode.divergence import first_divergence, reference_logits
from skipsearch.decode.engine import CPU_INDUCTOR_CONFIG
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.steps import synchronize
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt, model_from_config
from skipsearch.report.bench import hf_decoder, skipsearch_decoder, timed_runs
from skipsearch.search.measure import ratio_interval

from decode_speed import parse_skip_sets


def read_bandwidth(device: torch.device, megabytes: int = 1024, repeats: int = 10) -> float:
    """Bytes/s of summing a large float32 tensor: what the memory system can stream."""
    data = torch.ones(megabytes * 2**20 // 4, device=device)
    data.sum()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        data.sum()
    synchronize(device)
    return data.numel() * 4 * repeats / (time.perf_counter() - start)


def hf_compile_config(device: torch.device):
    """transformers compiles a static-cache generate by itself only on accelerators; on a CPU it must be told to.
    CUDA graphs ("reduce-overhead", its default) exist only on CUDA."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, mode="reduce-overhead" if device.type == "cuda" else "default")
    config._compile_all_devices = True
    return config


def gpu_busy_seconds(decode, prompt) -> float | None:
    """Seconds the GPU spends in kernels while `decode(prompt)` runs (profiled; None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode(prompt)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e6


def random_prompts(vocab_size: int, count: int, length: int = 48) -> list[list[int]]:
    """Prompts for a model with random weights: random ids, all of one length (HF's compiled path then compiles
    once)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one full forward reads (the embedding reads one row, so it is left out unless tied)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        total -= embedding.numel() * embedding.element_size()
    return total


def skipsearch_rows(skip_sets: list, regional: bool, eager: bool) -> dict[str, tuple]:
    """Our rows: name -> (skip set or None for plain decoding, compiled, compile mode or None for the device's)."""
    rows = {"skipsearch plain eager": (None, False, None), "skipsearch plain compiled": (None, True, None)}
    if regional:
        rows["skipsearch plain compiled, regional (studies)"] = (None, True, "regional")
    for skip in skip_sets:
        rows[f"self-spec {skip} eager"] = (skip, False, None)
        rows[f"self-spec {skip} compiled"] = (skip, True, None)
        if regional:
            rows[f"self-spec {skip} compiled, regional"] = (skip, True, "regional")
    return rows if eager else {name: row for name, row in rows.items() if row[1]}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hugging Face name, folder or .gguf (default: the embedded model)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: bfloat16 on CUDA, else float32)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--num-prompts", type=int, default=4, help="built-in prompts to decode (default: 4)")
    parser.add_argument("--prompt-offset", type=int, default=8, help="skip this many prompts (held out from tuning)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per prompt (default: 48)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts (default: 3)")
    parser.add_argument("--skip-sets", default="a20;a16,20,24",
                        help="skip sets separated by ';', each 'a' attention and/or '|m' MLP layer lists: "
                             "'a20;a16,20,24|m22' is attention 20; attention 16, 20, 24 and MLP 22 (default: %(default)s)")
    parser.add_argument("--max-draft-tokens", type=int, default=4, help="fixed draft length k (default: 4)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend for skipsearch compiled")
    parser.add_argument("--no-hf-compile", action="store_true", help="leave out HF static cache + torch.compile")
    parser.add_argument("--no-eager", action="store_true",
                        help="leave out skipsearch's eager rows (HF eager greedy stays: the outputs' reference); on a "
                             "GPU they take much of a run and are not what its goals are about")
    parser.add_argument("--no-regional", action="store_true",
                        help="on a CPU, leave out skipsearch compiled as studies run it (regional: compiled layer "
                             "kinds shared by every skip set; weights not frozen)")
    parser.add_argument("--config-only", default=None, metavar="CONFIG",
                        help="a model built from this config.json with random weights (speed does not depend on their "
                             "values; outputs and acceptance do), on random prompts of one length")
    return parser.parse_args()


def main() -> None:
    args = parse_arguments()
    if args.config_only:
        model = model_from_config(args.config_only, device=args.device, dtype=args.dtype)
        name, eos = args.config_only, model.generation_config.eos_token_id
        prompts = random_prompts(model.config.vocab_size, args.num_prompts)
    else:
        loaded = load_model(args.model, dtype=args.dtype, device=args.device)
        model, eos, name = loaded.model, loaded.model.generation_config.eos_token_id, loaded.name_or_path
        texts = load_prompts(num_prompts=args.prompt_offset + args.num_prompts, seed=0)[args.prompt_offset:]
        prompts = [encode_prompt(loaded.tokenizer, p) for p in texts]
    n, device = args.max_new_tokens, model.device
    print(f"model {name} on {device} ({model.dtype}), torch threads {torch.get_num_threads()}, "
          f"{len(prompts)} prompts x {n} new tokens, {args.repeats} repeats; every prompt decoded by every method back to "
          f"back in rotating order, speedups are geometric means of the paired per-run ratios (95% interval)")
    if device.type == "cpu" and args.backend == "inductor":
        print(f"skipsearch compiled runs inductor with {CPU_INDUCTOR_CONFIG}")

    policy = DraftPolicy(max_draft_tokens=args.max_draft_tokens, adaptive=False)
    # HF's generate with CPU_INDUCTOR_CONFIG is not a row: in transformers 5.23 / torch 2.13 it fails in a generated
    # kernel (index out of bounds) once compiled with frozen weights; see BENCHMARKS.md.
    regional_row = device.type == "cpu" and args.backend == "inductor" and not args.no_regional
    decoders = {"HF eager greedy": hf_decoder(model, n, eos)}
    if not args.no_hf_compile:
        decoders["HF static cache + compile"] = hf_decoder(model, n, eos, cache_implementation="static",
                                                           compile_config=hf_compile_config(device))
    compiled = skipsearch_rows(parse_skip_sets(args.skip_sets, model.config.num_hidden_layers), regional_row,
                               eager=not args.no_eager)
    compile_times = {}
    for name, (skip, use_compile, mode) in compiled.items():
        decode = skipsearch_decoder(model, n, eos, skip, policy, compile=use_compile, compile_mode=mode,
                                    compile_backend=args.backend)
        if use_compile:
            # The compile run is timed here, outside the passes: a warm engine is what the passes measure.
            start = time.perf_counter()
            decode(prompts[0])
            compile_times[name] = time.perf_counter() - start
        decoders[name] = decode
    # HF's compiled forward recompiles per prompt length, on nn.Module.__call__'s code object: room for them all.
    torch._dynamo.config.recompile_limit = max(64, 2 * len(prompts))
    for name in [k for k in decoders if k.startswith("HF static")]:
        # HF's compiled forward is specialised to the prompt's length and recompiles for each new one: warm it on
        # every prompt, so the passes compare warm engines (ours compiles once for any prompt length).
        start = time.perf_counter()
        for prompt in prompts:
            decoders[name](prompt)
        compile_times[name] = time.perf_counter() - start

    runs = timed_runs(decoders, prompts, args.repeats, device, show_progress=True)
    busy = {name: gpu_busy_seconds(decode, prompts[0]) for name, decode in decoders.items()}
    print_table(model, prompts, runs, busy, compile_times, args.repeats)


def print_table(model, prompts, runs: dict, busy: dict, compile_times: dict, repeats: int) -> None:
    """Every method's row: speed and ratios, bandwidth, host time, identical outputs, acceptance, compile time."""
    device = model.device
    hf = runs["HF eager greedy"]
    fastest_hf = runs.get("HF static cache + compile")
    ours = runs.get("skipsearch plain compiled")  # what self-speculative decoding must beat on the same engine
    bandwidth = read_bandwidth(device)
    weights = weight_bytes(model)
    print(f"weights read per forward {weights / 1e9:.3f} GB; measured read bandwidth {bandwidth / 1e9:.1f} GB/s")
    header = (f"{'method':48} {'tok/s':>7} {'vs HF eager (95% interval)':>28} {'vs HF static+compile':>24} "
              f"{'vs ours plain compiled':>24} {'GB/s':>7} {'% bw':>5} {'host us/tok':>11} {'identical':>9} {'accept':>6} "
              f"{'compile s':>9}  gaps")
    print(header)
    for name, run in runs.items():
        seconds, tokens, stats = sum(run.seconds), sum(run.tokens), run.stats
        # Forwards per second: plain decoding reads the weights once per token; speculative rounds read them
        # once per draft (less the skipped sublayers, ignored here) and once per verification. Stats cover the
        # first repeat, so the rate is scaled by the repeats.
        forwards = (stats.drafted + stats.rounds + len(prompts) if stats.rounds else sum(map(len, run.outputs)))
        achieved = weights * forwards * repeats / seconds
        same = sum(o == r for o, r in zip(run.outputs, hf.outputs)) / len(hf.outputs)
        gaps = [first_divergence(r, o, reference_logits(model, p, r)).top2_gap
                for p, r, o in zip(prompts, hf.outputs, run.outputs) if o != r]
        compile_s = compile_times.get(name)
        over_hf = ratio_interval(run.ratios_over(hf))
        over_fast = ratio_interval(run.ratios_over(fastest_hf)) if fastest_hf is not None else None
        over_ours = ratio_interval(run.ratios_over(ours)) if ours is not None else None
        span = lambda i: "-" if i is None else f"{i.estimate:.2f}x ({i.low:.2f}-{i.high:.2f})"  # noqa: E731
        compile_text = "-" if compile_s is None else f"{compile_s:.1f}"
        accept = "-" if stats.acceptance_rate is None else f"{stats.acceptance_rate:.2f}"
        # Host time per token: the first prompt's wall time per token (first repeat) less the GPU's busy time.
        first = run.seconds[0] / run.tokens[0]
        host = "-" if busy[name] is None else f"{1e6 * (first - busy[name] / run.tokens[0]):.0f}"
        print(f"{name:48} {tokens / seconds:7.1f} {span(over_hf):>28} {span(over_fast):>24} {span(over_ours):>24} "
              f"{achieved / 1e9:7.1f} {100 * achieved / bandwidth:4.0f}% {host:>11} {same:9.2f} {accept:>6} "
              f"{compile_text:>9}  "
              f"{', '.join(f'{g:.3f}' for g in gaps) or '-'}")


if __name__ == "__main__":
    main()
