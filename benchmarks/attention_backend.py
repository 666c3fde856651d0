"""Compiled steps through SDPA's fused kernel against inductor's own attention (a benchmark script, not a test).

gpt-fast decodes under SDPA's math backend ("better for Inductor to codegen attention here", its generate.py), so
inductor writes the attention into kernels of its own. The engine's compiled steps call SDPA's fused kernel instead
(cuDNN's on the H200 of 2026-11-27, beside a Memset and the mask's preparation each layer). This times the engine's
regional steps both ways at a few cache sizes: two copies of the model, one compiled and run under the math backend
alone (a captured CUDA graph keeps the attention it was captured with), one step of each paired and interleaved with
the other's, each step writing the cache's last slots. Per size it prints the kernels (CUDA) or operators (CPU) each
step launches both ways, and fused over math with its 95% interval (below 1: inductor's attention is faster).

    python benchmarks/attention_backend.py --device cuda --dtype bfloat16 \
        --config-only benchmarks/configs/smollm2-135m.json --slots 256,1024
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from cache_resize import prepared
from decode_speed import add_model_arguments, load_for_benchmark
from kernel_count import count_kernels
from verify_head import pair


def under(backends: list[SDPBackend] | None, call):
    """`call` run with SDPA restricted to `backends` (None: SDPA's own choice)."""
    def run():
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            call()
    return run


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--slots", default="256,1024", help="cache sizes (default: %(default)s)")
    parser.add_argument("--width", type=int, default=5, help="a verify step's tokens (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20, help="paired timings of each step (default: %(default)s)")
    args = parser.parse_args()
    model, name, _ = load_for_benchmark(args)
    print(f"{name} on {model.device} ({str(model.dtype).removeprefix('torch.')}), {torch.get_num_threads()} threads, "
          f"regional steps: SDPA's fused kernel against its math backend (inductor's own attention)")
    copies = {"fused": (model, None), "math": (copy.deepcopy(model), [SDPBackend.MATH])}
    for slots in (int(s) for s in args.slots.split(",")):
        calls = {}
        for label, (copy_of_model, backends) in copies.items():
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():  # compiled under the backends
                steps, graphs, seconds, capacity = prepared(copy_of_model, slots, args.width)
            calls[label] = {step: under(backends, call) for step, call in steps.items()}
            print(f"{capacity} slots, {label}: {graphs} new graphs, {seconds:.1f} s", flush=True)
        for step in calls["fused"]:
            launches = {label: count_kernels(calls[label][step], model.device, top=0)[0] for label in calls}
            interval, fused_s, math_s = pair(calls["fused"][step], calls["math"][step], args.repeats)
            print(f"  {step:24} fused {1e3 * fused_s:7.2f} ms, {launches['fused']} launches  math {1e3 * math_s:7.2f} "
                  f"ms, {launches['math']} launches  fused over math {interval.estimate:.2f}x "
                  f"({interval.low:.2f}-{interval.high:.2f})", flush=True)


if __name__ == "__main__":
    main()
