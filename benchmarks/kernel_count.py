"""Kernels per forward of the steps decoding runs (a benchmark script, not a test).

On a GPU, batch-1 decoding of a small model is bound by the count of kernels, not by the bytes
of weights (the H100 spent 1.5 ms on a forward of the default model whose weights it reads in
0.09 ms): this counts them, with torch.profiler, for the plain step and for a draft step, through
the engine's compiled steps (regional: CUDA graphs on CUDA, where the profiler still sees each
kernel the graph launches). On a CPU it counts the ATen operators a step runs instead, which is
what the same code launches, and is how the script is tested.

    python benchmarks/kernel_count.py                                    # default model, CPU, eager
    python benchmarks/kernel_count.py --device cuda --dtype bfloat16 --compile
    python benchmarks/kernel_count.py --config-only benchmarks/configs/llama-3-8b.json --device cuda --dtype bfloat16 --compile
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from skipsearch.decode.engine import CompileSettings, engine_for
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy

from decode_speed import add_model_arguments, load_for_benchmark, parse_skip_sets


def count_kernels(run, device: torch.device, top: int) -> tuple[int, list[tuple[str, int]]]:
    """Kernels (CUDA) or ATen operators (CPU) that one call of `run` launches, and the most frequent by name."""
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if device.type == "cuda":
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        # Operators called from Python or from a compiled region, not those an operator calls inside itself.
        names = [e.name for e in prof.events() if e.name.startswith("aten::")
                 and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return len(names), collections.Counter(names).most_common(top)


@torch.inference_mode()  # as decoding runs: the engine's cache was made in it
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--compile", action="store_true", help="the engine's compiled steps (regional)")
    parser.add_argument("--skip-set", default="a20", help="the draft step's skip set (default: %(default)s)")
    parser.add_argument("--top", type=int, default=8, help="most frequent kernels to list (default: %(default)s)")
    args = parser.parse_args()

    model, name, _ = load_for_benchmark(args)
    skip = parse_skip_sets(args.skip_set, model.config.num_hidden_layers)[0]
    options = dict(compile=True, compile_mode="regional") if args.compile else {}
    # One call sets everything up (compiling, capturing); the steps it leaves are what is counted.
    generate(model, [1, 2, 3, 4], skip=skip, max_new_tokens=8, policy=DraftPolicy(max_draft_tokens=2), **options)
    settings = CompileSettings(mode="regional") if args.compile else None
    steps = engine_for(model).steps_for(engine_for(model).cache_for(64, settings), skip, settings, 3)
    token = torch.ones((1, 1), dtype=torch.long, device=model.device)
    print(f"{name} on {model.device} ({str(model.dtype).removeprefix('torch.')}), "
          f"{'regional compiled steps' if args.compile else 'eager steps'}; "
          f"{'CUDA kernels' if model.device.type == 'cuda' else 'ATen operators (CPU)'} per forward")
    for name, step in (("plain step", steps.plain), (f"draft step {skip}", steps.draft)):
        # A step's first call at a width captures its CUDA graph (warm-up forwards included): run it once first,
        # so the count is one replay's (the H100 run of 2026-11-26 counted 1,695 for a cold plain step, 552 warm).
        steps.cache.seek(8)
        step(token)
        steps.cache.seek(8)
        count, common = count_kernels(lambda: step(token), model.device, args.top)
        listing = ", ".join(f"{n} x{c}" for n, c in common)
        print(f"{name:40} {count:6d}   most frequent: {listing}", flush=True)


if __name__ == "__main__":
    main()
