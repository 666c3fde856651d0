"""The engine's grouped attention against transformers' SDPA, step by step (a benchmark script, not a test).

With a mask, transformers' SDPA repeats each key/value head for its query heads in every compiled step and every
verification; the engine's attention (decode/attention.py) does not. This times the engine's own steps both ways in
one process, paired and interleaved (each one's attention switched per call; a compiled step holds a graph for each),
at a few cache sizes: a one-token step (plain decoding, drafts) and a verify step of `--width` tokens, each written at
the cache's last slots. Prints each step's milliseconds (median) both ways and transformers' SDPA over grouped, with
its 95% interval (above 1: grouped is faster). On CUDA only eager steps compare: a compiled step's CUDA graph keeps
the attention it was captured with (there, `kernel_count.py` and `engine_speed.py` show the cut).

    python benchmarks/attention_speed.py --modes eager,regional --slots 256,1024,2048
    python benchmarks/attention_speed.py --model gemma-3-270m --modes frozen --slots 1024
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch._inductor.config

from skipsearch.decode.engine import CompileSettings, engine_for

from decode_speed import add_model_arguments, load_for_benchmark
from verify_head import pair


@torch.inference_mode()
def time_mode(model, mode: str, slots: int, width: int, repeats: int) -> None:
    engine = engine_for(model)
    settings = None if mode == "eager" else CompileSettings(mode=mode)
    cache = engine.cache_for(slots, settings)
    steps = engine.steps_for(cache, None, settings, width)
    ids = torch.ones((1, width), dtype=torch.long, device=model.device)
    position = cache.capacity - width  # the last slots: every earlier one is attended to

    def run(step, attention):
        def call():
            step.attention = attention
            cache.seek(position)
            step(ids)
        return call

    for label, step in (("one-token step", steps.plain), (f"verify step ({width} tokens)", steps.verify)):
        sdpa, grouped = run(step, contextlib.nullcontext), run(step, engine.attention)
        for call in (sdpa, grouped, sdpa, grouped):  # compiles (a graph each way), warms
            with torch._inductor.config.patch(step.inductor_config):  # the frozen mode's, for the second graph too
                call()
        interval, sdpa_s, grouped_s = pair(sdpa, grouped, repeats)
        print(f"{mode:9} {cache.capacity:6d} slots  {label:24} transformers' SDPA {1e3 * sdpa_s:7.2f} ms  "
              f"grouped {1e3 * grouped_s:7.2f} ms  SDPA over grouped {interval.estimate:.2f}x "
              f"({interval.low:.2f}-{interval.high:.2f})", flush=True)
        step.attention = engine.attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--modes", default="eager,regional", help="steps' modes: eager, regional, frozen "
                                                                  "(default: %(default)s)")
    parser.add_argument("--slots", default="256,1024,2048", help="cache sizes (default: %(default)s)")
    parser.add_argument("--width", type=int, default=5, help="a verify step's tokens (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20, help="paired timings of each step (default: %(default)s)")
    args = parser.parse_args()
    model, name, _ = load_for_benchmark(args)
    config = model.config.get_text_config(decoder=True)
    print(f"{name} on {model.device} ({str(model.dtype).removeprefix('torch.')}), {torch.get_num_threads()} threads: "
          f"{config.num_attention_heads} query heads over {config.num_key_value_heads} key/value heads")
    if model.device.type == "cuda" and args.modes != "eager":
        raise SystemExit("attention_speed.py: on CUDA only --modes eager compares (captured graphs keep their attention)")
    for mode in args.modes.split(","):
        for slots in (int(s) for s in args.slots.split(",")):
            time_mode(model, mode, slots, args.width, args.repeats)


if __name__ == "__main__":
    main()
