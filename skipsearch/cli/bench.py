"""`bench`: compare skipsearch with HF greedy and its training-free peers."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import (Commands, Formatter, add_compile_flag, add_model_flags, add_prompt_flags, add_studies_dir,
                        non_negative_int, positive_int, seed_value, settings_of)


def cmd_bench(args: argparse.Namespace) -> int:
    from ..api.bench import BenchSettings, benchmark  # here: it imports torch, which --help does without

    result = benchmark(settings_of(BenchSettings, args))
    print("\n".join(result.lines()))
    print(f"wrote {result.json_path} and {result.png_path}")
    return 0


def add_bench(commands: Commands, formatter: Formatter) -> argparse.ArgumentParser:
    bench = commands.add_parser(
        "bench", help="compare skipsearch with HF greedy and its training-free peers", formatter_class=formatter,
        description="Decode the same prompts with HF greedy (the baseline), HF prompt lookup, HF early exit, "
                    "skipsearch plain and skipsearch with --config; print a table, write JSON and a bar chart.",
    )
    bench.add_argument("--config", type=Path, default=None, help="skip config JSON to benchmark")
    bench.add_argument("--early-exit-layer", type=positive_int, default=None,
                       help="also run HF assistant_early_exit at this layer (LayerSkip-style)")
    bench.add_argument("--prompt-lookup-tokens", type=non_negative_int, default=10,
                       help="HF prompt lookup decoding's n-gram draft length (0: leave it out)")
    bench.add_argument("--repeats", type=positive_int, default=3,
                       help="times every prompt is decoded by every method (back to back, rotating order); speedups "
                            "are geometric means of the paired runs with a 95%% interval")
    bench.add_argument("--cost-profile", type=Path, default=None,
                       help="cost profile for the predicted speedup (default: profile this device)")
    bench.add_argument("--project-with", type=Path, action="append", metavar="PROFILE",
                       help="also print the config's speedup PREDICTED with this cost profile, e.g. a GPU's "
                            "(repeatable; a prediction, not a measurement; stored in bench.json)")
    bench.add_argument("--seed", type=seed_value, default=0, help="seed of the prompt selection")
    bench.add_argument("--output-dir", type=Path, default=None,
                       help="where bench.json/.png go (default: <studies-dir>/bench)")
    add_studies_dir(bench)
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_prompt_flags(bench, num_prompts=4, max_new_tokens=48)
    add_model_flags(bench)
    add_compile_flag(bench)
    return bench
