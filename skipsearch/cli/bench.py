"""`bench`: compare skipsearch with HF greedy and its training-free peers."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import (add_compile_flag, add_model_flags, add_number_flags, add_projection_flag, add_prompt_flags,
                        add_studies_dir, non_negative_int, positive_int, seed_value, settings_of)


HELP = "compare skipsearch with HF greedy and its training-free peers"
DESCRIPTION = ("Decode the same prompts with HF greedy (the baseline), HF prompt lookup, HF early exit, "
               "skipsearch plain and skipsearch with --config; print a table, write JSON and a bar chart. Prompts "
               "with a category field are drawn stratified and reported per category too.")


def cmd_bench(args: argparse.Namespace) -> int:
    from ..api.bench import BenchSettings, benchmark  # here: it imports torch, which --help does without

    result = benchmark(settings_of(BenchSettings, args))
    print("\n".join(result.lines()))
    charts = f"{result.png_path} and {result.categories_png}" if result.categories_png else str(result.png_path)
    print(f"wrote {result.json_path}{', ' if result.categories_png else ' and '}{charts}")
    return 0


def add_bench_flags(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("--config", type=Path, default=None,
                       help="skip config JSON to benchmark, on prompts its study neither decoded nor ranked a head on "
                            "(configs exported by this release name them; of an older one, a note says none can be "
                            "left out)")
    bench.add_argument("--include-study-prompts", action="store_true",
                       help="draw from every prompt, the --config study's own too (its figure then is in-sample)")
    add_number_flags(bench, [
        ("--early-exit-layer", positive_int, None, "also run HF assistant_early_exit at this layer (LayerSkip-style)"),
        ("--prompt-lookup-tokens", non_negative_int, 10,
         "HF prompt lookup decoding's n-gram draft length (0: leave it out)"),
        ("--repeats", positive_int, 3, "times every prompt is decoded by every method (back to back, rotating order); "
                                       "speedups are geometric means of the paired runs with a 95%% interval"),
    ])
    bench.add_argument("--cost-profile", type=Path, default=None,
                       help="cost profile for the predicted speedup: a file from `profile` or a shipped profile's "
                            "name, e.g. nvidia-h200/llama-3-8b (default: profile this device as bench decodes: "
                            "eager forwards, or with --compile on CUDA the compiled steps; a CPU's compiled steps "
                            "are priced by its eager forwards)")
    add_projection_flag(bench, "the config's", "; stored in bench.json")
    bench.add_argument("--seed", type=seed_value, default=0, help="seed of the prompt selection")
    bench.add_argument("--output-dir", type=Path, default=None,
                       help="where bench.json/.png go (default: <studies-dir>/bench)")
    add_studies_dir(bench)
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_prompt_flags(bench, num_prompts=4, max_new_tokens=48)
    add_compile_flag(add_model_flags(bench))
