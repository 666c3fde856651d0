"""Kernels per forward of the steps decoding runs (a benchmark script, not a test).

On a GPU, batch-1 decoding of a small model is bound by the count of kernels, not by the bytes
of weights (the H100 spent 1.5 ms on a forward of the default model whose weights it reads in
0.09 ms): this counts them, with torch.profiler, for the plain step and for a draft step, through
the engine's compiled steps (regional: CUDA graphs on CUDA, where the profiler still sees each
kernel the graph launches). On a CPU it counts what a step launches there: the operators it calls
and, in compiled steps, what the compiled graphs call: inductor's own C++ kernels and GEMM templates
(profiled by inductor's `cpp.enable_kernel_profile`) and library operators, so that a cut made for
the GPU's count shows on a CPU too. With
`--per-layer` it prints the count per decoder layer (the step's count less the embedding, final
norm and head's, read from a step with every layer skipped), the figure a cut changes.

    python benchmarks/kernel_count.py                                    # default model, CPU, eager
    python benchmarks/kernel_count.py --compile --mode frozen            # a CPU's default compiled steps
    python benchmarks/kernel_count.py --device cuda --dtype bfloat16 --compile
    python benchmarks/kernel_count.py --config-only benchmarks/configs/llama-3-8b.json --device cuda --dtype bfloat16 --compile
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile

from skipsearch.decode.engine import CompileSettings, engine_for
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet

from decode_speed import add_model_arguments, load_for_benchmark, parse_skip_sets


ALLOCATIONS = ("aten::empty", "aten::empty_like", "aten::empty_strided")  # the allocator's, not work


def launched(event, device: torch.device) -> bool:
    """Whether a profiled event is one launch of work: a CUDA kernel on a GPU. On a CPU: whatever a compiled graph
    calls (inductor's C++ kernels, its GEMM templates, MKL and ATen operators), and an operator called from Python,
    not one an operator calls inside itself; allocations are not counted."""
    if device.type == "cuda":
        return event.device_type == torch.autograd.DeviceType.CUDA
    parent = event.cpu_parent.name if event.cpu_parent is not None else ""
    if event.name in ALLOCATIONS:
        return False
    if parent.startswith("## Call CompiledFxGraph"):
        return True
    return "::" in event.name and "::" not in parent and "_kernel" not in parent and "cpp_fused" not in parent


def profile_inductor_cpu_kernels() -> None:
    """Make inductor's C++ kernels, compiled from now on, visible to the profiler (no effect on CUDA): without it a
    CPU count holds only the library operators a compiled graph calls."""
    torch._inductor.config.cpp.enable_kernel_profile = True


def count_kernels(run, device: torch.device, top: int) -> tuple[int, list[tuple[str, int]]]:
    """Kernels that one call of `run` launches (`launched`), and the most frequent by name."""
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    names = [e.name for e in prof.events() if launched(e, device)]
    return len(names), collections.Counter(names).most_common(top)


@torch.inference_mode()  # as decoding runs: the engine's cache was made in it
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--compile", action="store_true", help="the engine's compiled steps (see --mode)")
    parser.add_argument("--mode", default="regional",
                        help="compiled steps' mode: regional (studies; CUDA's default) or frozen (a CPU's default "
                             "for generate and bench) (default: %(default)s)")
    parser.add_argument("--skip-set", default="a20", help="the draft step's skip set (default: %(default)s)")
    parser.add_argument("--per-layer", action="store_true",
                        help="also the count per decoder layer (a step with every layer skipped is counted too)")
    parser.add_argument("--top", type=int, default=8, help="most frequent kernels to list (default: %(default)s)")
    args = parser.parse_args()
    profile_inductor_cpu_kernels()

    model, name, _ = load_for_benchmark(args)
    layers = model.config.num_hidden_layers
    skip = parse_skip_sets(args.skip_set, layers)[0]
    settings = CompileSettings(mode=args.mode) if args.compile else None
    options = dict(compile=True, compile_mode=args.mode) if args.compile else {}
    # One call sets everything up (compiling, capturing); the steps it leaves are what is counted.
    generate(model, [1, 2, 3, 4], skip=skip, max_new_tokens=8, policy=DraftPolicy(max_draft_tokens=2), **options)
    engine = engine_for(model)
    cache = engine.cache_for(64, settings)
    token = torch.ones((1, 1), dtype=torch.long, device=model.device)
    kind = "CUDA kernels" if model.device.type == "cuda" else "operators and compiled kernels (CPU)"
    print(f"{name} on {model.device} ({str(model.dtype).removeprefix('torch.')}), "
          f"{args.mode + ' compiled steps' if args.compile else 'eager steps'}; {kind} per forward")
    every = tuple(range(layers))
    sets = [(f"draft step {skip}", skip)] + ([("no layer (all skipped)", SkipSet(attn=every, mlp=every))]
                                             if args.per_layer else [])
    counts = {}
    for label, draft in [("plain step", None), *sets]:
        steps = engine.steps_for(cache, draft or skip, settings, 3)
        step = steps.plain if draft is None else steps.draft
        # A step's first call at a width captures its CUDA graph (warm-up forwards included): run it once first,
        # so the count is one replay's (the H100 run of 2026-11-26 counted 1,695 for a cold plain step, 552 warm).
        steps.cache.seek(8)
        step(token)
        steps.cache.seek(8)
        counts[label], common = count_kernels(lambda: step(token), model.device, args.top)
        listing = ", ".join(f"{n} x{c}" for n, c in common)
        print(f"{label:40} {counts[label]:6d}   most frequent: {listing}", flush=True)
    if args.per_layer:
        per_layer = (counts["plain step"] - counts["no layer (all skipped)"]) / layers
        print(f"per decoder layer (plain step): {per_layer:.1f}")


if __name__ == "__main__":
    main()
