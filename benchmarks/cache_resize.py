"""What a resized cache costs the regional steps: compiles, setup seconds and speed (a benchmark script, not a test).

The regional steps' compiled layer functions outlive the engine's cache: the first cache's graphs are specialised to
its length, the first cache of another length recompiles each function once with the length dynamic, and later
lengths reuse those graphs (regional.py). This shows what that buys and whether it costs speed. One copy of the model
("resized") first decodes at `--first` slots and then at each of `--slots`; for each size a fresh copy ("fresh")
compiles graphs specialised to it (with dynamo's automatic dynamic shapes off: dynamo remembers per source function
that the length changed, so a default compile after the resize would take it dynamic too). Per size it prints both
copies' new graphs and setup seconds (a plain and a verify step's first calls), then the two copies' steps paired and
interleaved at that size: fresh over resized, with its 95% interval (below 1: the dynamic length is slower).

    python benchmarks/cache_resize.py --config-only benchmarks/configs/smollm2-135m.json --slots 512,2048
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch._dynamo.utils import counters

from skipsearch.decode.engine import CompileSettings, engine_for
from skipsearch.decode.steps import synchronize

from decode_speed import add_model_arguments, load_for_benchmark
from verify_head import pair

SETTINGS = CompileSettings(mode="regional")


def prepared(model, slots: int, width: int, settings: CompileSettings = SETTINGS):
    """The plain and verify steps at `slots` in `settings`' mode (regional unless given), each called once (compiling
    what they need), with their setup's new graphs and seconds, and a timed call of each writing the cache's last
    slots (it returns the step's logits: on CUDA a graph's buffer, valid until the step runs again)."""
    engine = engine_for(model)
    graphs, start = counters["stats"]["unique_graphs"], time.perf_counter()
    cache = engine.cache_for(slots, settings)
    steps = engine.steps_for(cache, None, settings, width)
    calls = {}
    for label, step, tokens in (("one-token step", steps.plain, 1), (f"verify step ({width} tokens)", steps.verify,
                                                                        width)):
        ids = torch.ones((1, tokens), dtype=torch.long, device=model.device)

        def call(step=step, ids=ids, position=cache.capacity - tokens):
            cache.seek(position)
            logits = step(ids)
            synchronize(model.device)
            return logits

        call()
        calls[label] = call
    return calls, counters["stats"]["unique_graphs"] - graphs, time.perf_counter() - start, cache.capacity


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--first", type=int, default=256, help="the resized copy's first cache (default: %(default)s)")
    parser.add_argument("--slots", default="512,2048", help="cache sizes after it (default: %(default)s)")
    parser.add_argument("--width", type=int, default=5, help="a verify step's tokens (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20, help="paired timings of each step (default: %(default)s)")
    args = parser.parse_args()
    model, name, _ = load_for_benchmark(args)
    print(f"{name} on {model.device} ({str(model.dtype).removeprefix('torch.')}), {torch.get_num_threads()} threads")
    resized = copy.deepcopy(model)
    _, graphs, seconds, capacity = prepared(resized, args.first, args.width)
    print(f"resized copy, first cache {capacity} slots: {graphs} graphs, {seconds:.1f} s")
    for slots in (int(s) for s in args.slots.split(",")):
        dynamic, graphs, seconds, capacity = prepared(resized, slots, args.width)
        print(f"{capacity} slots: resized copy {graphs} new graphs, {seconds:.1f} s", end="; ", flush=True)
        fresh = copy.deepcopy(model)
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            static, graphs, seconds, _ = prepared(fresh, slots, args.width)
        print(f"fresh copy {graphs} graphs, {seconds:.1f} s")
        for label in static:
            interval, static_s, dynamic_s = pair(static[label], dynamic[label], args.repeats)
            print(f"  {label:24} fresh {1e3 * static_s:7.2f} ms  resized {1e3 * dynamic_s:7.2f} ms  fresh over "
                  f"resized {interval.estimate:.2f}x ({interval.low:.2f}-{interval.high:.2f})", flush=True)
        del fresh, static


if __name__ == "__main__":
    main()
